"""A module's parameters and gradients, offloaded and onloaded: what is kept per module, and the copies."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from hal.backends.interface import Backend
from hal.offload.mover import Mover, Slot, check_on_device
from hal.offload.reports import OffloadError


@dataclass(slots=True)
class ParamEntry:
    param: torch.nn.Parameter
    data: Slot
    grad: Slot


@dataclass(slots=True)
class ModuleState:
    backend: Backend
    entries: dict[str, ParamEntry] = field(default_factory=dict)
    offloaded: bool = False

    def slots(self) -> list[Slot]:
        return [s for e in self.entries.values() for s in (e.data, e.grad)]


# What is kept per module while it lives (host buffers reused by every later offload).
module_states: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def parameter_label(name: str) -> str:
    return f"parameter {name!r}"


def parameter_names(module: torch.nn.Module | None) -> dict[int, str]:
    """id(parameter) -> its name in `module`, for naming optimizer state in errors."""
    if module is None:
        return {}
    return {id(p): name for name, p in module.named_parameters()}


def offload_module(module: torch.nn.Module, backend: Backend, mover: Mover) -> None:
    """Queue the copies of `module`'s parameters and gradients to their host buffers on `mover`."""
    state = module_states.get(module)
    if state is not None and state.offloaded:
        first = next(iter(state.entries), None)
        raise OffloadError(
            f"module {type(module).__name__} is already offloaded"
            + (f" ({parameter_label(first)} lives in host memory)" if first else "")
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
        check_on_device(backend, parameter_label(name), p.data)
        if p.grad is not None:
            check_on_device(backend, f"gradient of {parameter_label(name)}", p.grad)
    if state is None:
        state = module_states[module] = ModuleState(backend)
    entries: dict[str, ParamEntry] = {}
    for name, p in params:
        entry = state.entries.get(name)
        if entry is None or entry.param is not p:
            entry = ParamEntry(p, Slot(parameter_label(name)), Slot(f"gradient of {parameter_label(name)}"))
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


def onload_module(module: torch.nn.Module, backend: Backend, mover: Mover) -> None:
    """Queue the copies of `module`'s offloaded parameters and gradients back to the device on `mover`."""
    state = module_states.get(module)
    if state is None or not state.offloaded:
        first = next((n for n, _ in module.named_parameters()), None)
        raise OffloadError(
            f"module {type(module).__name__} was never offloaded"
            + (f" ({parameter_label(first)} is on the device)" if first else "")
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
            raise OffloadError(f"{parameter_label(name)} was added to the module after it was offloaded; cannot onload it")
        if p.data.data_ptr() != entry.data.host.data_ptr() or p.data.shape != entry.data.host.shape:
            raise OffloadError(f"{parameter_label(name)} was replaced while offloaded (its data is no longer the host buffer)")
    for name in state.entries:
        if name not in current:
            raise OffloadError(f"{parameter_label(name)} was removed from the module while it was offloaded")

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
