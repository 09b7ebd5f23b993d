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

Where each part lives: the reports in hal.offload.reports, host buffers and the copy
stream in hal.offload.mover, a module's parameters and gradients in hal.offload.modules,
an optimizer's state in hal.offload.optimizers; this module is the API over them.

Limits: parameters are moved one tensor each; two parameters that are views of one
storage come back as separate tensors (tied weights that are the same `Parameter`
object are fine: `named_parameters` lists them once). Buffers (`module.buffers()`)
are not moved. An onloaded tensor is contiguous even if the original was not.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.utils.weak import WeakIdKeyDictionary

from hal.backends.interface import Backend
from hal.offload.modules import module_states, offload_module, onload_module, parameter_names
from hal.offload.mover import Mover
from hal.offload.optimizers import check_can_offload, check_can_onload, offload_optimizer, onload_optimizer, optimizer_states
from hal.offload.reports import MoveReport, OffloadError, OnloadedReport

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


def _backend(backend: Backend | None) -> Backend:
    if backend is not None:
        return backend
    import hal

    return hal.current()


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
    mover = Mover(backend, "offload")
    if optimizer is not None:
        # Validate the optimizer before queueing module copies, so a bad optimizer moves nothing.
        check_can_offload(optimizer)
    if module is not None:
        offload_module(module, backend, mover)
    if optimizer is not None:
        offload_optimizer(optimizer, parameter_names(module), backend, mover)
    report = mover.run()
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
    mover = Mover(backend, "onload")
    if optimizer is not None:
        check_can_onload(optimizer)
    if module is not None:
        onload_module(module, backend, mover)
    if optimizer is not None:
        onload_optimizer(optimizer, backend, mover)
    return mover.run()


def is_offloaded(obj: torch.nn.Module | torch.optim.Optimizer) -> bool:
    """True while `obj` (a module or an optimizer) lives in host memory through `offload`."""
    state = _states_of(obj).get(obj)
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
    registry = _states_of(obj)
    state = registry.get(obj)
    if state is None:
        return 0
    if state.offloaded:
        raise OffloadError(f"{type(obj).__name__} is offloaded: its host buffers hold the only copy; onload it first")
    released = sum(slot.host.numel() * slot.host.element_size() for slot in state.slots() if slot.host is not None)
    del registry[obj]
    return released


def _states_of(obj: torch.nn.Module | torch.optim.Optimizer) -> WeakIdKeyDictionary:
    return optimizer_states if isinstance(obj, torch.optim.Optimizer) else module_states
