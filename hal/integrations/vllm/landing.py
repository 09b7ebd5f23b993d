"""Received pieces landed straight into one vLLM worker's parameters: `LayerLanding`.

A shard receive (issue 41) brings each worker only the regions of checkpoint tensors its
own loaders would take (its `WorkerNeeds`, recorded by hal.integrations.vllm.recording).
They land where those loaders would have written them: in the layer of vLLM's layerwise
reload, in the checkpoint layout of the worker's shard, which vLLM then processes itself.
Per layer:

- `open`: vLLM's own staging of the layer (`materialize_layer`: an empty tensor for each
  of its tensors on the meta device), once, its bytes counted;
- `destination`: the strided region of a staged tensor that a piece lands in (a recorded
  `Need` narrowed to the piece: `MxNPlan.destination`). A tensor vLLM keeps live during
  its reload (`bias` from 0.27: its loaders write the tensor the layer computes with) gets
  a held copy instead, written into the live one only when the layer completes, so a
  layer that does not complete keeps its old bias;
- `complete`: the recorded fills (the padded rows of a vocabulary zeroed), the held live
  tensors copied in, then vLLM's own processing of the layer (`_layerwise_process` with
  nothing buffered: `quant_method.process_weights_after_loading`, the fused-MoE experts'
  post-load step that `LayerwiseReload.start` turns on, the processed values copied into
  the tensors the layer computes with). The staged tensors are dropped: no second copy of
  the model is ever held, at most the layers open at once.

The reload itself is the engine's `LayerwiseReload` (hal.integrations.vllm.reload), the
one the whole-tensor path drives: `start` opens it (vLLM 0.25 on; on 0.23-0.24 the
worker has opened it already and the engine's reload says so), `finish` ends it after the
last layer (layers no checkpoint tensor reaches get their kernel tensors back, the tied
head is refreshed), and `abort` ends it after a failure: every layer that did not
complete gets its old kernel tensors back (vLLM's `finalize_layerwise_reload`), every
completed one keeps its new ones, so each tensor holds old or new bytes.

Threads: `open` and `destination` may be called from receiving threads; `complete`,
`finish` and `abort` from one thread (the caller's, which vLLM's model runs on).
Every vLLM name goes through hal.integrations.vllm.internals.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from hal.integrations.vllm import internals as vllm_internals
from hal.integrations.vllm.reload import LayerwiseReload, Loader
from hal.sync.errors import SpecMismatchError
from hal.sync.plan.needs import Fill, UnexpressibleLoad, View, WorkerNeeds


@dataclass(slots=True)
class _Staged:
    """One open layer: where each of its targets lands, and what it holds."""

    module: torch.nn.Module
    homes: dict[int, torch.Tensor]
    """Per target index: the staged tensor, or the held copy of a live one."""
    live: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per target index of a live tensor: the tensor the layer computes with."""
    nbytes: int = 0


class LayerLanding:
    """Lands one worker's pieces into its model, layer by layer, over the engine's reload.

    Built once per worker from its model, its recorded `needs` and the engine's `reload`;
    per update: `start`, then per layer `open`, `destination` for each piece, `complete`;
    then `finish` (or `abort` after a failure). `open_bytes` / `peak_bytes`: the staged
    memory now, and the most this update held at once.
    """

    def __init__(self, model: torch.nn.Module, needs: WorkerNeeds, reload: LayerwiseReload) -> None:
        modules = dict(model.named_modules())
        self.needs = needs
        targets_of: dict[str, list[int]] = {}
        for index, target in enumerate(needs.targets):
            targets_of.setdefault(target.layer, []).append(index)
        self.layers: tuple[str, ...] = tuple(targets_of)
        """The layers pieces land in, in the model's order."""
        self.targets_of: dict[str, tuple[int, ...]] = {layer: tuple(indices) for layer, indices in targets_of.items()}
        """Per layer, the indices of its targets in `needs.targets`."""
        self.elements: dict[str, int] = dict.fromkeys(self.layers, 0)
        """Per layer, the elements its pieces carry: a layer has all of them when this many landed."""
        for need in needs.needs:
            self.elements[needs.targets[need.target].layer] += need.numel
        self._fills: dict[str, list[Fill]] = {layer: [] for layer in self.layers}
        for fill in needs.fills:
            self._fills[needs.targets[fill.target].layer].append(fill)
        self._layer_modules: dict[str, torch.nn.Module] = {}
        for layer in self.layers:
            module = modules.get(layer)
            if module is None:
                raise SpecMismatchError(f"layer {layer!r} of worker {needs.worker}'s recorded needs is not a module of this model")
            if vllm_internals.processed_at_end(module):
                raise UnexpressibleLoad(
                    f"layer {layer!r} ({type(module).__name__}): vLLM processes it only when its reload ends; "
                    "a shard receive cannot complete it layer by layer"
                )
            self._layer_modules[layer] = module
        self._model = model
        self._reload = reload
        self._staged: dict[str, _Staged] = {}
        self._lock = threading.Lock()
        self.completed: set[str] = set()
        """The layers that completed in this update (new bytes; the others keep their old ones)."""
        self.open_bytes = 0
        self.peak_bytes = 0

    # ---- one update -----------------------------------------------------------------------
    def start(self, model_config: Any, *, worker_load: Loader | None = None) -> None:
        """Begin an update: the engine's reload opens (`LayerwiseReload.start`; a vLLM
        0.23-0.24 worker opened vLLM's already and hands over `worker_load`), unless the
        engine opened it itself."""
        if self._staged or self.open_bytes:
            raise RuntimeError("hal landing: an update is in progress; finish or abort it first")
        if not self._reload.open:
            self._reload.start(self._model, model_config, worker_load=worker_load)
        self.completed = set()
        self.peak_bytes = 0

    def open(self, layer: str) -> int:
        """Stage `layer` for its pieces (once per update): returns the bytes this allocated
        (0 when it was open already)."""
        with self._lock:
            if layer in self._staged:
                return 0
            module = self._module(layer)
            if not self._reload.open:
                raise RuntimeError(f"hal landing: layer {layer!r} is not in a reload; call start first")
            if layer in self.completed:
                raise RuntimeError(f"hal landing: layer {layer!r} completed already in this update")
            if not vllm_internals.layer_in_reload(module):
                raise RuntimeError(f"hal landing: layer {layer!r} left the reload already (vLLM processed it or put it back)")
            targets = [(i, self.needs.targets[i]) for i in self.targets_of[layer]]
            was_live = {i for i, t in targets if not getattr(module, t.name).is_meta}
            on_meta = {name for name, tensor in _tensors(module).items() if tensor.is_meta}
            vllm_internals.materialize_layer(module)
            staged = _Staged(module, {})
            staged.nbytes = sum(_nbytes(t) for name, t in _tensors(module).items() if name in on_meta and not t.is_meta)
            for index, target in targets:
                tensor = getattr(module, target.name)
                if tuple(tensor.shape) != target.shape or not tensor.is_contiguous():
                    raise SpecMismatchError(
                        f"parameter {target.describe()!r}: staged as {tuple(tensor.shape)} "
                        f"({'contiguous' if tensor.is_contiguous() else 'strided'}), recorded as {target.shape}"
                    )
                if index in was_live:
                    staged.live[index] = tensor
                    home = torch.empty_like(tensor.data)
                    staged.nbytes += _nbytes(home)
                else:
                    home = tensor.data
                if target.padding:
                    home.zero_()  # what no loader writes (declared padding) reads as zeros, as at start-up
                staged.homes[index] = home
            self._staged[layer] = staged
            self.open_bytes += staged.nbytes
            self.peak_bytes = max(self.peak_bytes, self.open_bytes)
            return staged.nbytes

    def destination(self, target: int, view: View) -> torch.Tensor:
        """The region `view` (offset, shape, strides in elements) of target `target` (an
        index into `needs.targets`) of an open layer: a piece copied into it lands there."""
        spec = self.needs.targets[target]
        staged = self._staged.get(spec.layer)
        if staged is None:
            raise RuntimeError(f"hal landing: layer {spec.layer!r} is not open (parameter {spec.describe()!r})")
        home = staged.homes[target]
        offset, shape, strides = view
        last = offset + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else offset - 1
        if offset < 0 or last >= home.numel() or any(s < 0 for s in strides):
            raise SpecMismatchError(
                f"parameter {spec.describe()!r}: the region at offset {offset} of shape {list(shape)} and strides "
                f"{list(strides)} lies outside its {spec.numel} elements"
            )
        return home.as_strided(shape, strides, home.storage_offset() + offset)

    def complete(self, layer: str) -> None:
        """Every piece of `layer` landed: fill what its loaders fill, copy held live tensors
        in, and have vLLM process it (it computes with the new weights from now on)."""
        with self._lock:
            staged = self._staged.pop(layer, None)
            if staged is None:
                raise RuntimeError(f"hal landing: layer {layer!r} is not open")
            self.open_bytes -= staged.nbytes
        with torch.no_grad():
            for fill in self._fills[layer]:
                staged.homes[fill.target].as_strided(fill.shape, fill.stride, fill.offset).fill_(fill.value)
            for index, live in staged.live.items():
                live.data.copy_(staged.homes[index])
            vllm_internals.process_layer(staged.module)
        self.completed.add(layer)

    def finish(self) -> None:
        """End the update after every layer completed: the engine's reload ends (layers no
        piece reaches keep their kernel tensors, the tied head is refreshed). A layer that
        did not complete is a caller's error: the update is aborted and the layers named.
        A layer no piece reaches (its loaders only fill it) completes here."""
        for layer in self.layers:
            if not self.elements[layer] and layer not in self.completed and self._reload.open:
                self.open(layer)
                self.complete(layer)
        missing = [layer for layer in self.layers if layer not in self.completed]
        if missing:
            self.abort()
            more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
            raise RuntimeError(f"hal landing: layers {missing[:3]}{more} did not complete; they keep their old weights")
        self._reload.finish(quiet=False)

    def abort(self) -> None:
        """End the update after a failure: every layer that did not complete gets its old
        kernel tensors back (staged ones are dropped), completed ones keep their new ones."""
        with self._lock:
            self._staged.clear()
            self.open_bytes = 0
        self._reload.finish(quiet=True)

    def _module(self, layer: str) -> torch.nn.Module:
        module = self._layer_modules.get(layer)
        if module is None:
            raise KeyError(f"hal landing: no piece of worker {self.needs.worker}'s needs lands in layer {layer!r}")
        return module


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's own parameters and buffers (what vLLM's reload stages per layer)."""
    tensors = {**module._parameters, **module._buffers}
    return {name: tensor for name, tensor in tensors.items() if tensor is not None}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
