"""Move a module's parameters and gradients, and an optimizer's state, to host memory and back.

    import hal.offload as offload

    offload.offload(model, optimizer)            # after the training step
    with offload.onloaded(model) as report:      # around a weight sync
        sender.send(ModuleSource(model), version=step)
    report.onload.seconds                        # None when nothing was moved

Everything goes through the Backend contract (`hal.current()` or an explicit
`backend=`): host buffers come from `backend.empty_pinned` (page-locked where
`supports_pinned_memory`), device tensors from `backend.empty`, copies are
`backend.copy_` on a copy stream followed by an event the host waits for. So the
same code is correct on the `sim` backend, whose copies really are asynchronous.

Host buffers are allocated on the first offload and kept, keyed by parameter (and by
optimizer-state key), so every later offload copies into the same host memory: no
second host copy, no allocation. `release_host_buffers` gives them back.

On the `cpu` backend (and `sim`) "device" and "host" are both host memory; the
bookkeeping is the same: offloaded tensors live in the `empty_pinned` buffers, onloaded
ones in fresh `backend.empty` tensors.

Limits: parameters are moved one tensor each; two parameters that are views of one
storage come back as separate tensors (tied weights that are the same `Parameter`
object are fine: `named_parameters` lists them once). Buffers (`module.buffers()`)
are not moved. An onloaded tensor is contiguous even if the original was not.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal

import torch
from torch.utils.weak import WeakIdKeyDictionary

from hal.backend import Backend

__all__ = [
    "MoveReport",
    "OnloadedReport",
    "OffloadError",
    "offload",
    "onload",
    "onloaded",
    "is_offloaded",
    "release_host_buffers",
]


class OffloadError(RuntimeError):
    """An offload or onload that cannot be done as asked; the message names the tensor."""


@dataclass(frozen=True, slots=True)
class MoveReport:
    """What one `offload` or `onload` call moved."""

    direction: Literal["offload", "onload"]
    """Which way the tensors went: device to host ("offload") or host to device ("onload")."""
    tensors: int
    """Tensors copied (parameters, gradients and optimizer-state tensors)."""
    bytes: int
    """Bytes copied."""
    host_bytes_allocated: int
    """Host (pinned where possible) bytes newly allocated by this call; 0 when every buffer was reused."""
    seconds: float | None
    """Wall time of the copies including the final wait; None when nothing was moved."""

    def as_dict(self) -> dict[str, Any]:
        return {
            f"{self.direction}_tensors": self.tensors,
            f"{self.direction}_bytes": self.bytes,
            f"{self.direction}_host_bytes_allocated": self.host_bytes_allocated,
            f"{self.direction}_s": self.seconds,
        }


@dataclass(slots=True)
class OnloadedReport:
    """What `onloaded` did: the onload on entry, and the offload on exit (None until then)."""

    onload: MoveReport
    """The onload done on entering the block (0 tensors, seconds None when nothing was offloaded)."""
    offload: MoveReport | None = None
    """The offload done on leaving the block; None while inside it."""

    def as_dict(self) -> dict[str, Any]:
        out = self.onload.as_dict()
        if self.offload is not None:
            out.update(self.offload.as_dict())
        return out


# ---- internal state ----------------------------------------------------------------------


@dataclass(slots=True)
class _Slot:
    """One tensor that can live on the device or in its host buffer."""

    label: str  # for error messages: "parameter 'layer.weight'"
    host: torch.Tensor | None = None  # the reused host buffer
    on_host: bool = False


@dataclass(slots=True)
class _ParamEntry:
    param: torch.nn.Parameter
    data: _Slot
    grad: _Slot


@dataclass(slots=True)
class _ModuleState:
    backend: Backend
    entries: dict[str, _ParamEntry] = field(default_factory=dict)
    offloaded: bool = False


@dataclass(slots=True)
class _OptimizerState:
    backend: Backend
    # id(param) -> (param, {state key -> slot}); the param is kept so ids stay unique.
    entries: dict[int, tuple[torch.Tensor, dict[str, _Slot]]] = field(default_factory=dict)
    offloaded: bool = False


_modules: "WeakIdKeyDictionary" = WeakIdKeyDictionary()
_optimizers: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def _backend(backend: Backend | None) -> Backend:
    if backend is not None:
        return backend
    import hal

    return hal.current()


class _Mover:
    """Collects copies of one direction, runs them on a copy stream, waits once."""

    def __init__(self, backend: Backend, direction: Literal["offload", "onload"]) -> None:
        self.backend = backend
        self.direction = direction
        self.tensors = 0
        self.bytes = 0
        self.host_bytes_allocated = 0
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._after: list[Callable[[], None]] = []

    def host_buffer(self, slot: _Slot, like: torch.Tensor) -> torch.Tensor:
        """The slot's host buffer, allocated only when missing or of another shape/dtype."""
        host = slot.host
        if host is None or host.shape != like.shape or host.dtype != like.dtype:
            host = self.backend.empty_pinned(tuple(like.shape), like.dtype)
            slot.host = host
            self.host_bytes_allocated += host.numel() * host.element_size()
        return host

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._copies.append((dst, src))
        self.tensors += 1
        self.bytes += src.numel() * src.element_size()

    def then(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the host after every copy has completed."""
        self._after.append(fn)

    def run(self, stream_holder: dict[str, Any]) -> MoveReport:
        seconds: float | None = None
        if self._copies:
            backend = self.backend
            stream = stream_holder.get("stream")
            if stream is None:
                stream = stream_holder["stream"] = backend.new_stream()
            start = time.perf_counter()
            # The tensors may still be written by work queued on the current stream.
            stream.wait_stream(backend.current_stream())
            for dst, src in self._copies:
                backend.copy_(dst, src, stream=stream)
            done = stream.record_event()
            done.synchronize()
            seconds = time.perf_counter() - start
        for fn in self._after:
            fn()
        self._copies.clear()
        return MoveReport(
            direction=self.direction,
            tensors=self.tensors,
            bytes=self.bytes,
            host_bytes_allocated=self.host_bytes_allocated,
            seconds=seconds,
        )


# One copy stream per backend instance, created on first use.
_streams: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def _stream_holder(backend: Backend) -> dict[str, Any]:
    holder = _streams.get(backend)
    if holder is None:
        holder = _streams[backend] = {}
    return holder


def _check_on_device(backend: Backend, label: str, tensor: torch.Tensor) -> None:
    expected = backend.device()
    if tensor.device != expected:
        raise OffloadError(
            f"{label} is on {tensor.device}, expected {expected} (backend {backend.name!r}); "
            f"offload moves tensors from the backend's device only"
        )


def _module_label(name: str) -> str:
    return f"parameter {name!r}"


def _param_names(module: torch.nn.Module | None) -> dict[int, str]:
    if module is None:
        return {}
    return {id(p): name for name, p in module.named_parameters()}


def _optimizer_params(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            out.append((names.get(id(p), f"param_groups[{g}]['params'][{i}]"), p))
    return out


# ---- module parameters and gradients ------------------------------------------------------


def _offload_module(module: torch.nn.Module, backend: Backend, mover: _Mover) -> None:
    state = _modules.get(module)
    if state is not None and state.offloaded:
        first = next(iter(state.entries), None)
        raise OffloadError(
            f"module {type(module).__name__} is already offloaded"
            + (f" ({_module_label(first)} lives in host memory)" if first else "")
            + "; onload it first"
        )
    if state is not None and state.backend is not backend:
        raise OffloadError(
            f"module {type(module).__name__} was offloaded with backend {state.backend.name!r} before; "
            f"now asked to use {backend.name!r}"
        )
    params = list(module.named_parameters())
    # Validate everything before moving anything: nothing half-offloaded.
    for name, p in params:
        _check_on_device(backend, _module_label(name), p.data)
        if p.grad is not None:
            _check_on_device(backend, f"gradient of {_module_label(name)}", p.grad)
    if state is None:
        state = _modules[module] = _ModuleState(backend)
    entries: dict[str, _ParamEntry] = {}
    for name, p in params:
        entry = state.entries.get(name)
        if entry is None or entry.param is not p:
            entry = _ParamEntry(p, _Slot(_module_label(name)), _Slot(f"gradient of {_module_label(name)}"))
        entries[name] = entry
    state.entries = entries  # parameters removed from the module drop their buffers

    for name, entry in entries.items():
        p = entry.param
        host = mover.host_buffer(entry.data, p.data)
        mover.copy(host, p.data)
        grad = p.grad
        if grad is not None:
            host_grad = mover.host_buffer(entry.grad, grad)
            mover.copy(host_grad, grad)
        else:
            host_grad = None

        def swap(p=p, host=host, host_grad=host_grad, entry=entry) -> None:
            # Clear the grad first: assigning .data of another device under a grad is refused.
            p.grad = None
            p.data = host
            entry.data.on_host = True
            if host_grad is not None:
                p.grad = host_grad
            entry.grad.on_host = host_grad is not None

        mover.then(swap)

    def mark() -> None:
        state.offloaded = True

    mover.then(mark)


def _onload_module(module: torch.nn.Module, backend: Backend, mover: _Mover) -> None:
    state = _modules.get(module)
    if state is None or not state.offloaded:
        first = next((n for n, _ in module.named_parameters()), None)
        raise OffloadError(
            f"module {type(module).__name__} was never offloaded"
            + (f" ({_module_label(first)} is on the device)" if first else "")
            + "; nothing to onload"
        )
    if state.backend is not backend:
        raise OffloadError(
            f"module {type(module).__name__} was offloaded with backend {state.backend.name!r}, "
            f"cannot onload it with {backend.name!r}"
        )
    current = dict(module.named_parameters())
    for name, p in current.items():
        entry = state.entries.get(name)
        if entry is None or entry.param is not p:
            raise OffloadError(f"{_module_label(name)} was added to the module after it was offloaded; cannot onload it")
        if p.data.data_ptr() != entry.data.host.data_ptr() or p.data.shape != entry.data.host.shape:
            raise OffloadError(f"{_module_label(name)} was replaced while offloaded (its data is no longer the host buffer)")
    for name in state.entries:
        if name not in current:
            raise OffloadError(f"{_module_label(name)} was removed from the module while it was offloaded")

    for name, entry in state.entries.items():
        p = entry.param
        dev = backend.empty(tuple(p.data.shape), p.data.dtype)
        mover.copy(dev, entry.data.host)
        grad = p.grad
        dev_grad = None
        if grad is not None:
            dev_grad = backend.empty(tuple(grad.shape), grad.dtype)
            mover.copy(dev_grad, grad)

        def swap(p=p, dev=dev, dev_grad=dev_grad, entry=entry) -> None:
            p.grad = None
            p.data = dev
            entry.data.on_host = False
            if dev_grad is not None:
                p.grad = dev_grad
            entry.grad.on_host = False

        mover.then(swap)

    def mark() -> None:
        state.offloaded = False

    mover.then(mark)


# ---- optimizer state ------------------------------------------------------------------------


def _offload_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], backend: Backend, mover: _Mover) -> None:
    state = _optimizers.get(optimizer)
    if state is not None and state.offloaded:
        raise OffloadError(f"optimizer {type(optimizer).__name__} is already offloaded; onload it first")
    if state is not None and state.backend is not backend:
        raise OffloadError(
            f"optimizer {type(optimizer).__name__} was offloaded with backend {state.backend.name!r} before; "
            f"now asked to use {backend.name!r}"
        )
    # Only tensors on the device move: Adam keeps `step` on the host unless capturable.
    moving: list[tuple[torch.Tensor, str, str, torch.Tensor]] = []
    for pname, p in _optimizer_params(optimizer, names):
        pstate = optimizer.state.get(p)
        if not pstate:
            continue
        for key, value in pstate.items():
            if isinstance(value, torch.Tensor) and value.device == backend.device():
                moving.append((p, pname, key, value))
    if state is None:
        state = _optimizers[optimizer] = _OptimizerState(backend)
    entries: dict[int, tuple[torch.Tensor, dict[str, _Slot]]] = {}
    for p, pname, key, value in moving:
        old = state.entries.get(id(p))
        old_slots = old[1] if old is not None and old[0] is p else {}
        _, new_slots = entries.setdefault(id(p), (p, {}))
        slot = old_slots.get(key) or _Slot(f"optimizer state {key!r} of {_module_label(pname)}")
        new_slots[key] = slot
        host = mover.host_buffer(slot, value)
        mover.copy(host, value)

        def swap(p=p, key=key, host=host, slot=slot) -> None:
            optimizer.state[p][key] = host
            slot.on_host = True

        mover.then(swap)
    state.entries = entries

    def mark() -> None:
        state.offloaded = True

    mover.then(mark)


def _onload_optimizer(optimizer: torch.optim.Optimizer, backend: Backend, mover: _Mover) -> None:
    state = _optimizers.get(optimizer)
    if state is None or not state.offloaded:
        raise OffloadError(f"optimizer {type(optimizer).__name__} was never offloaded; nothing to onload")
    if state.backend is not backend:
        raise OffloadError(
            f"optimizer {type(optimizer).__name__} was offloaded with backend {state.backend.name!r}, "
            f"cannot onload it with {backend.name!r}"
        )
    for p, slots in state.entries.values():
        pstate = optimizer.state.get(p, {})
        for key, slot in slots.items():
            value = pstate.get(key)
            if not isinstance(value, torch.Tensor) or value.data_ptr() != slot.host.data_ptr():
                raise OffloadError(f"{slot.label} was replaced while offloaded (it is no longer the host buffer)")
            dev = backend.empty(tuple(value.shape), value.dtype)
            mover.copy(dev, slot.host)

            def swap(p=p, key=key, dev=dev, slot=slot) -> None:
                optimizer.state[p][key] = dev
                slot.on_host = False

            mover.then(swap)

    def mark() -> None:
        state.offloaded = False

    mover.then(mark)


# ---- public API -------------------------------------------------------------------------------


def _check_args(module: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None, what: str) -> None:
    if module is None and optimizer is None:
        raise ValueError(f"{what}: pass a module, an optimizer, or both")
    if module is not None and not isinstance(module, torch.nn.Module):
        raise TypeError(f"{what}: module must be a torch.nn.Module, got {type(module).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{what}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")


def offload(
    module: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    backend: Backend | None = None,
    empty_cache: bool = True,
) -> MoveReport:
    """Move `module`'s parameters and gradients, and `optimizer`'s state, to host memory.

    Host buffers are allocated on the first call and reused after. Raises `OffloadError`
    naming the tensor when something is already offloaded or not on the backend's device;
    nothing is moved in that case. With `empty_cache`, the device memory freed is returned
    to the runtime (`backend.empty_cache()`).
    """
    _check_args(module, optimizer, "offload")
    backend = _backend(backend)
    mover = _Mover(backend, "offload")
    if optimizer is not None:
        # Validate the optimizer before queueing module copies, so a bad optimizer moves nothing.
        state = _optimizers.get(optimizer)
        if state is not None and state.offloaded:
            raise OffloadError(f"optimizer {type(optimizer).__name__} is already offloaded; onload it first")
    if module is not None:
        _offload_module(module, backend, mover)
    if optimizer is not None:
        _offload_optimizer(optimizer, _param_names(module), backend, mover)
    report = mover.run(_stream_holder(backend))
    if empty_cache and report.tensors:
        backend.empty_cache()
    return report


def onload(
    module: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    backend: Backend | None = None,
) -> MoveReport:
    """Bring back to the device what `offload` moved; the host buffers stay for the next offload.

    Raises `OffloadError` naming the tensor when the module or optimizer was never offloaded
    or a tensor was replaced while offloaded; nothing is moved in that case.
    """
    _check_args(module, optimizer, "onload")
    backend = _backend(backend)
    mover = _Mover(backend, "onload")
    if optimizer is not None:
        state = _optimizers.get(optimizer)
        if state is None or not state.offloaded:
            raise OffloadError(f"optimizer {type(optimizer).__name__} was never offloaded; nothing to onload")
    if module is not None:
        _onload_module(module, backend, mover)
    if optimizer is not None:
        _onload_optimizer(optimizer, backend, mover)
    return mover.run(_stream_holder(backend))


def is_offloaded(obj: torch.nn.Module | torch.optim.Optimizer) -> bool:
    """True while `obj` (a module or an optimizer) lives in host memory through `offload`."""
    registry = _optimizers if isinstance(obj, torch.optim.Optimizer) else _modules
    state = registry.get(obj)
    return bool(state is not None and state.offloaded)


@contextlib.contextmanager
def onloaded(
    module: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    backend: Backend | None = None,
) -> Iterator[OnloadedReport]:
    """Onload whatever of `module` / `optimizer` is offloaded, run the block, offload it again.

    What was not offloaded is left alone (and not timed): for a module that lives on the
    device, the report's onload and offload both show 0 tensors and `seconds=None`. The
    offload on exit runs even when the block raises.
    """
    _check_args(module, optimizer, "onloaded")
    backend = _backend(backend)
    mod = module if module is not None and is_offloaded(module) else None
    opt = optimizer if optimizer is not None and is_offloaded(optimizer) else None
    if mod is None and opt is None:
        nothing = MoveReport("onload", 0, 0, 0, None)
        report = OnloadedReport(onload=nothing)
        yield report
        report.offload = MoveReport("offload", 0, 0, 0, None)
        return
    report = OnloadedReport(onload=onload(mod, opt, backend=backend))
    try:
        yield report
    finally:
        report.offload = offload(mod, opt, backend=backend)


def release_host_buffers(obj: torch.nn.Module | torch.optim.Optimizer) -> int:
    """Forget the host buffers kept for `obj` (it must be onloaded); returns the bytes released."""
    registry = _optimizers if isinstance(obj, torch.optim.Optimizer) else _modules
    state = registry.get(obj)
    if state is None:
        return 0
    if state.offloaded:
        raise OffloadError(f"{type(obj).__name__} is offloaded: its host buffers hold the only copy; onload it first")
    released = 0
    if isinstance(state, _ModuleState):
        slots = [s for e in state.entries.values() for s in (e.data, e.grad)]
    else:
        slots = [s for _, d in state.entries.values() for s in d.values()]
    for slot in slots:
        if slot.host is not None:
            released += slot.host.numel() * slot.host.element_size()
    del registry[obj]
    return released
