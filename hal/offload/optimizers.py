"""An optimizer's state tensors, offloaded and onloaded: what is kept per optimizer, and the copies.

Only state tensors on the backend's device move (Adam keeps `step` on the host unless
capturable); they are found by the optimizer's parameters and named after them in errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from hal.backends.interface import Backend
from hal.offload.modules import parameter_label
from hal.offload.mover import Mover, Slot
from hal.offload.reports import OffloadError


@dataclass(slots=True)
class OptimizerState:
    backend: Backend
    entries: dict[int, tuple[torch.Tensor, dict[str, Slot]]] = field(default_factory=dict)
    """id(param) -> (param, {state key -> slot}); the param is kept so ids stay unique."""
    offloaded: bool = False

    def slots(self) -> list[Slot]:
        return [s for _, by_key in self.entries.values() for s in by_key.values()]


# What is kept per optimizer while it lives (host buffers reused by every later offload).
optimizer_states: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def optimizer_params(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            out.append((names.get(id(p), f"param_groups[{g}]['params'][{i}]"), p))
    return out


def check_can_offload(optimizer: torch.optim.Optimizer) -> None:
    state = optimizer_states.get(optimizer)
    if state is not None and state.offloaded:
        raise OffloadError(f"optimizer {type(optimizer).__name__} is already offloaded; onload it first")


def check_can_onload(optimizer: torch.optim.Optimizer) -> None:
    state = optimizer_states.get(optimizer)
    if state is None or not state.offloaded:
        raise OffloadError(f"optimizer {type(optimizer).__name__} was never offloaded; nothing to onload")


def offload_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], backend: Backend, mover: Mover) -> None:
    """Queue the copies of `optimizer`'s device state tensors to their host buffers on `mover`
    (`names`: id(parameter) -> name, for errors)."""
    check_can_offload(optimizer)
    state = optimizer_states.get(optimizer)
    if state is not None and state.backend is not backend:
        raise OffloadError(
            f"optimizer {type(optimizer).__name__} was offloaded with backend {state.backend.name!r} before; "
            f"now asked to use {backend.name!r}"
        )
    moving: list[tuple[torch.Tensor, str, str, torch.Tensor]] = []
    for pname, p in optimizer_params(optimizer, names):
        pstate = optimizer.state.get(p)
        if not pstate:
            continue
        for key, value in pstate.items():
            if isinstance(value, torch.Tensor) and value.device == backend.device():
                moving.append((p, pname, key, value))
    if state is None:
        state = optimizer_states[optimizer] = OptimizerState(backend)
    entries: dict[int, tuple[torch.Tensor, dict[str, Slot]]] = {}
    for p, pname, key, value in moving:
        old = state.entries.get(id(p))
        old_slots = old[1] if old is not None and old[0] is p else {}
        _, new_slots = entries.setdefault(id(p), (p, {}))
        slot = old_slots.get(key) or Slot(f"optimizer state {key!r} of {parameter_label(pname)}")
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


def onload_optimizer(optimizer: torch.optim.Optimizer, backend: Backend, mover: Mover) -> None:
    """Queue the copies of `optimizer`'s offloaded state tensors back to the device on `mover`."""
    check_can_onload(optimizer)
    state = optimizer_states[optimizer]
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
