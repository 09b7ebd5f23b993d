"""What test_recording.py runs inside a vLLM worker (importable by spawned workers).

The oracle of a recording: replaying the recorded needs on *id tensors* (each checkpoint
element an int64 of its own: tensor index << 40 | flat index, + 1, so 0 means "zeroed")
must give, element for element, what vLLM's real loaders write when fed those id tensors
into int64 stand-ins of every loadable tensor (-1: never written).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hal.integrations.vllm import internals
from hal.integrations.vllm.recording import record_needs
from hal.sync.plan.needs import WorkerNeeds, encode_needs
from hal.sync.spec import TensorSpec


def ids(index: int, spec: TensorSpec) -> torch.Tensor:
    return (torch.arange(spec.numel, dtype=torch.int64) + (index << 40) + 1).reshape(spec.shape)


def real_loaders_on_ids(model: torch.nn.Module, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """What vLLM's own loaders write into each loadable tensor, fed id tensors."""
    written = {}
    with internals.loaders_on_meta(model, lambda layer, name, loader: loader) as targets:
        for target in targets:
            stand_in = torch.full(tuple(target.tensor.shape), -1, dtype=torch.int64)
            stand_in.__class__ = target.tensor.__class__  # the loaders read the parameter's class and attributes
            stand_in.__dict__ = target.tensor.__dict__.copy()
            setattr(target.module, target.name, stand_in)
            written[f"{target.layer}.{target.name}" if target.layer else target.name] = stand_in
        with torch.no_grad():
            model.load_weights((spec.name, ids(i, spec)) for i, spec in enumerate(specs))
    return {key: value.detach().as_subclass(torch.Tensor).clone() for key, value in written.items()}


def replayed(needs: WorkerNeeds) -> dict[str, torch.Tensor]:
    """The record applied to id tensors: every need's box copied to its destination, every fill set."""
    out = {t.describe(): torch.full(t.shape, -1, dtype=torch.int64) for t in needs.targets}
    for need in needs.needs:
        source = ids(need.tensor, needs.specs[need.tensor])[tuple(slice(o, o + n) for o, n in zip(need.offsets, need.sizes))]
        out[needs.targets[need.target].describe()].as_strided(need.sizes, need.dst_strides, need.dst_offset).copy_(source)
    for fill in needs.fills:
        out[needs.targets[fill.target].describe()].as_strided(fill.shape, fill.stride, fill.offset).fill_(int(fill.value))
    return out


def _state(model: torch.nn.Module) -> dict[str, Any]:
    tensors = {**{f"param {n}": t for n, t in model.named_parameters(remove_duplicate=False)},
               **{f"buffer {n}": t for n, t in model.named_buffers(remove_duplicate=False)}}
    return {
        "tensors": {n: (t, t.detach().clone(), getattr(t, internals.LOADER_ATTR, None)) for n, t in tensors.items()},
        "non_persistent": {n: set(m._non_persistent_buffers_set) for n, m in model.named_modules()},
    }


def changes(before: dict[str, Any], model: torch.nn.Module) -> list[str]:
    """What differs from `before` (`_state`): another object, other bytes, another loader."""
    after = _state(model)
    problems = [f"{n}: gone or new" for n in before["tensors"].keys() ^ after["tensors"].keys()]
    for name, (tensor, values, loader) in before["tensors"].items():
        now = after["tensors"].get(name)
        if now is None:
            continue
        if now[0] is not tensor:
            problems.append(f"{name}: another object")
        elif not torch.equal(now[1], values):
            problems.append(f"{name}: other bytes")
        if now[2] is not loader:
            problems.append(f"{name}: another loader ({now[2]!r}, was {loader!r})")
    problems += [f"module {n}: non-persistent buffers {s}" for n, s in after["non_persistent"].items() if s != before["non_persistent"][n]]
    return problems


def check(specs: list[TensorSpec], model: torch.nn.Module) -> dict[str, Any]:
    """Record this worker's needs, check the model is untouched, compare with the oracle."""
    before = _state(model)
    start = time.perf_counter()
    needs = record_needs(model, specs, "cpu")
    seconds = time.perf_counter() - start
    touched = changes(before, model)
    oracle = real_loaders_on_ids(model, specs)
    mine = replayed(needs)
    mismatch = [k for k in oracle if k in mine and not torch.equal(oracle[k], mine[k])]
    missed = [k for k in oracle if k not in mine and bool((oracle[k] != -1).any())]
    extra = [k for k in mine if k not in oracle]
    return {
        "needs": encode_needs(needs),
        "seconds": seconds,
        "changes": touched + changes(before, model),
        "reload_in_progress": internals.reload_in_progress(model),
        "mismatch": mismatch,
        "missed": missed,  # written by the real loaders, absent from the record
        "extra": extra,
        "compared": sorted(k for k in oracle if k in mine),
    }
