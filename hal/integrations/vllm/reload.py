"""One weight update of the engine's model, as vLLM's layerwise reload applies it:
`LayerwiseReload`, which each engine generation drives through `start`, `load` (per bucket)
and `finish` (hal.integrations.vllm.engine for vLLM 0.25 on; on 0.23-0.24 the worker has
started the reload already, hal.integrations.vllm.engine_v023).

What it keeps across updates, and why:
- `CarryArena`: memory for received tensors that wait for the rest of their layer, or that
  vLLM keeps past the call that handed them over (a layer it processes only at the end of
  the update: a padded vocabulary's embedding).
- `kernel_tensors` / `kernel_changes`: the parameters the model computes with (the tensors,
  their shapes and dtypes), taken when the engine starts and compared before each sync. The reload copies each layer's
  processed tensors back into the layer's kernel tensors, so a parameter that something
  else laid out anew in between (vllm-ascend 0.23's `NPUWorker.wake_up` transposes MoE
  expert weights back to the checkpoint's layout) would make it fail half-way.

Every vLLM name it uses goes through hal.integrations.vllm.internals.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

import hal
from hal.integrations.vllm import internals as vllm_internals
from hal.integrations.vllm import tied as vllm_tied

Loader = Callable[[list[tuple[str, torch.Tensor]]], None]
"""How tensors reach the model: `model.load_weights`, or the one a vLLM 0.23-0.24 worker hands over."""


class CarryArena:
    """Reused memory for received tensors that a layerwise reload keeps past their bucket.

    A layer split across buckets is only processed when its last tensor arrives; its
    earlier tensors must outlive their bucket. Copying them here instead of cloning
    avoids allocating (and page-faulting) fresh memory every sync. Reset at the start of
    each sync only, so tensors that vLLM keeps until the end of the reload stay valid.
    Grows to the most a sync needed, up to `cap_bytes`; beyond that, tensors are cloned.
    """

    ALIGN = 64

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.buf: torch.Tensor | None = None
        self.used = 0
        self.wanted = 0
        self._clones: set[int] = set()  # storages of this sync's clones (alive while vLLM holds them)

    def reset(self) -> None:
        if self.wanted > (0 if self.buf is None else self.buf.numel()):
            self.buf = None  # free before allocating the larger one
            self.buf = hal.current().empty(min(self.wanted, self.cap_bytes))
        self.used = 0
        self.wanted = 0
        self._clones = set()

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        end = self.used + -(-nbytes // self.ALIGN) * self.ALIGN
        self.wanted = max(self.wanted, end)
        if self.buf is None or end > self.buf.numel() or not tensor.is_contiguous():
            clone = tensor.clone()
            self._clones.add(clone.untyped_storage().data_ptr())
            return clone
        out = self.buf[self.used : self.used + nbytes].view(tensor.dtype).view(tensor.shape)
        hal.current().copy_(out, tensor)  # on the current stream, which the loader's copies follow
        self.used = end
        return out

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lies in memory this arena handed out in this sync (its buffer or a clone)."""
        storage = tensor.untyped_storage().data_ptr()
        return storage in self._clones or (self.buf is not None and storage == self.buf.untyped_storage().data_ptr())

    def retain(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` itself when it is already the arena's, else a kept copy of it."""
        return tensor if self.owns(tensor) else self.keep(tensor)


# One parameter as the engine found it: (name, owning module, attribute, the tensor, shape, dtype).
Kernel = tuple[str, torch.nn.Module, str, torch.Tensor, torch.Size, torch.dtype]


def kernel_tensors(model: torch.nn.Module) -> list[Kernel]:
    """Every parameter `model` computes with, now, with the module attribute that holds it
    (a tied one once, under its first name, as `named_parameters` lists it)."""
    seen: set[int] = set()
    kernels = []
    for prefix, module in model.named_modules():
        for attr, p in module._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                kernels.append((f"{prefix}.{attr}" if prefix else attr, module, attr, p, p.shape, p.dtype))
    return kernels


def kernel_changes(
    kernels: list[Kernel], params_of: Callable[[torch.nn.Module], dict[str, torch.Tensor]] | None = None
) -> list[str]:
    """Each parameter of `kernels` whose module now holds another tensor, or one of another
    shape or dtype, named with both. A layerwise reload keeps each kernel tensor (it
    copies into it), so a different tensor means something else laid the weights out anew;
    by shape alone a transpose of a square matrix would pass. About half a microsecond per
    parameter (no module traversal, one lookup each): 9 ms for 16,000 here. `params_of`: where
    a module's parameters are read (default: its `_parameters`; while a reload the worker
    started runs, the kernel tensors the reload keeps aside)."""
    changes = []
    for name, module, attr, kernel, shape, dtype in kernels:
        p = (module._parameters if params_of is None else params_of(module)).get(attr)
        if p is kernel and p.shape == shape and p.dtype == dtype:
            continue
        what = "the same tensor" if p is kernel else "another tensor" if p is not None else "no tensor"
        now = f"now {tuple(p.shape)}, {p.dtype}" if p is not None else "now none"
        changes.append(f"parameter {name!r}: {what} since the engine started (shape {tuple(shape)}, {dtype} at start, {now})")
    return changes


class LayerwiseReload:
    """The engine's weight updates, each one layerwise reload of its model, one at a time.

    Per update: `start` (vLLM's reload begins; or `worker_load` says the worker began it),
    `load` for each bucket, `finish` (every layer that did not get all of its tensors gets
    its old kernel tensors back, then the tied weights are refreshed). Across updates it
    keeps the carry arena, the kernel tensors found when the engine started (`kernel_changes`)
    and the checkpoint's layers (`layer_of`).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.kernels = kernel_tensors(model)
        """What each reload copies processed tensors back into, as the engine found them."""
        self.layer_of: dict[str, frozenset[str]] = {}
        """Per checkpoint tensor, the tensors of its layer (which the reload processes together)."""
        self.carry: CarryArena | None = None
        self.open = False
        """Whether a reload is in progress (between `start` and `finish`)."""
        self.seen: set[str] = set()
        """The tensors loaded in this reload."""
        self.refreshed_tied: list[str] = []
        """Modules whose state derived from a tied weight was rebuilt when the last reload finished."""
        self._model: torch.nn.Module | None = None
        self._model_config: object = None
        self._load: Loader | None = None
        self._restore_experts: Callable[[], None] | None = None

    def expect(self, layer_of: dict[str, frozenset[str]], nbytes: int) -> None:
        """The checkpoint the engine receives from now on: its layers, and its size (the
        carry arena holds up to a quarter of it, at least 64 MiB)."""
        self.layer_of = layer_of
        self.carry = CarryArena(cap_bytes=max(64 << 20, nbytes // 4))

    def start(self, model: torch.nn.Module, model_config: object, *, worker_load: Loader | None = None) -> None:
        """Open a reload of `model`. vLLM's layerwise reload starts here, unless the worker
        started it already and loads through `worker_load` (vLLM 0.23-0.24's worker owns an
        update). Fused MoE experts are re-packed as at start-up when their layer is processed
        (vLLM 0.28 on skips that on updates; undone at `finish`)."""
        if self.carry is None:
            raise RuntimeError("hal weight transfer: not initialized; call init_weight_transfer_engine first")
        if worker_load is None:
            vllm_internals.initialize_layerwise_reload(model)
        self._restore_experts = vllm_internals.reprocess_experts_on_reload(model)
        self._model, self._model_config = model, model_config
        self._load = worker_load if worker_load is not None else model.load_weights
        self.open = True
        self.seen = set()
        self.carry.reset()

    def load(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket's tensors (views valid during this call only). A layer whose
        tensors are not all here yet keeps the ones it got until its last one arrives:
        those are copied into the carry arena, and so is what vLLM itself holds past this
        call (a layer it processes at the end)."""
        self.seen.update(name for name, _ in pairs)
        keep, layer_of, seen = self.carry.keep, self.layer_of, self.seen
        self._load([(n, t if layer_of.get(n, frozenset((n,))) <= seen else keep(t)) for n, t in pairs])
        vllm_internals.retain_deferred_loads(self.carry.retain)

    def finish(self, *, quiet: bool | None = None) -> None:
        """End the reload, if one is open: every layer that was not (fully) loaded gets its
        old kernel tensors back, so the engine serves whole weights whatever happened; then
        a weight tied to another module (lm_head to embed_tokens), loaded through its owner,
        has what was derived from it rebuilt (`refreshed_tied`). A reload that loaded nothing
        (a sync refused after the worker started it) puts every layer back on purpose,
        without vLLM's per-layer warning; `quiet` says whether to warn where the reload's
        layers were not loaded through `load` (a landing: hal.integrations.vllm.landing)."""
        if not self.open:
            return
        self.open = False
        model, model_config = self._model, self._model_config
        self._model, self._model_config, self._load = None, None, None
        silent = not self.seen if quiet is None else quiet
        warnings = vllm_internals.restoring_every_layer() if silent else contextlib.nullcontext()
        try:
            with warnings:
                vllm_internals.finalize_layerwise_reload(model, model_config)
        finally:
            restore, self._restore_experts = self._restore_experts, None
            if restore is not None:
                restore()
        self.refreshed_tied = vllm_tied.refresh_tied_weights(model)

    def kernel_changes(self) -> list[str]:
        """`kernel_changes` of the kernel tensors found at start-up; while a reload is open
        (the worker started it), the layers hold meta tensors: compared with what it keeps aside."""
        return kernel_changes(self.kernels, params_of=vllm_internals.reload_kernel_parameters if self.open else None)
