"""What the vLLM engine keeps around vLLM's layerwise reload (hal.integrations.vllm).

- `CarryArena`: memory for received tensors that wait for the rest of their layer, or that
  vLLM keeps past the call that handed them over (a layer it processes only at the end of
  the update: a padded vocabulary's embedding).
- `kernel_tensors` / `kernel_changes`: the parameters the model computes with (the tensors,
  their shapes and dtypes), taken when the engine starts and compared before each sync. The reload copies each layer's
  processed tensors back into the layer's kernel tensors, so a parameter that something
  else laid out anew in between (vllm-ascend 0.23's `NPUWorker.wake_up` transposes MoE
  expert weights back to the checkpoint's layout) would make it fail half-way.
"""

from __future__ import annotations

from typing import Callable

import torch

import hal


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
