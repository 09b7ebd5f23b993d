"""What one vLLM worker needs of each checkpoint tensor, learnt from vLLM's own loaders.

`record_needs(model, specs, device)` runs inside the worker. It puts the model in vLLM's
layerwise-reload state (every loadable tensor on the meta device, in the checkpoint layout
of the worker's shard: hal.integrations.vllm.internals.loaders_on_meta), wraps each
tensor's original loader so the recording knows whose loader runs, and calls
`model.load_weights` once with a *stand-in* per checkpoint tensor:

- a `Stand` is a tensor with no storage whose payload is a meta view of a meta tensor of
  the checkpoint tensor's shape (its root). Every op a loader applies to it runs on the
  payload and must give a view of the same root (narrow, chunk, unbind, transpose, a
  reshape that needs no copy, a `.to()` that changes nothing but the device), so the
  payload's geometry *is* the region of the checkpoint tensor that reaches the parameter;
- `copy_` from a stand-in into a loadable tensor (or `param[i] = stand_in`) records the
  region and its strided destination (a `Need`, hal.sync.plan.needs);
- while a loader runs, a torch-function mode records constant fills of loadable tensors
  (vLLM zeroes the padded rows of a vocabulary: a `Fill`) and refuses in-place arithmetic
  or a copy of anything computed into them.

Whatever the record cannot express is refused at the op by `UnexpressibleLoad`, naming the
parameter, the loader, the op and the checkpoint tensor: a cast, arithmetic, a copy that
broadcasts, a region that is no box, a hole in a layer (`coverage_problems`). No weight
byte is read or written and nothing beyond meta tensors is allocated; on the way out every
layer gets its kernel tensors back, the same objects with the same bytes.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from hal.integrations.vllm import internals
from hal.sync.plan.needs import Fill, Target, UnexpressibleLoad, View, WorkerNeeds, coverage_problems, need_of_copy
from hal.sync.spec import TensorSpec

_ALIASES = {torch.Tensor.to, torch.Tensor.cpu}  # a move to a device: the landing copies anyway
_NOT_WRITES = {"requires_grad_", "share_memory_"}


def _on_device(func: Any) -> bool:
    """Whether `func` asks where the tensor is (`.device`, `.get_device()`, the `.is_<device>`
    flags): the stand-in answers that itself (the worker's device), never its meta payload."""
    if func == torch.Tensor.device.__get__ or func == torch.Tensor.get_device:
        return True
    return _op(func) == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "").startswith("is_")


def _storage(tensor: torch.Tensor) -> int:
    # meta tensors have no addresses (every data_ptr is 0): the storage object tells views apart
    return tensor.untyped_storage()._cdata


def _op(func: Any) -> str:
    return getattr(func, "__name__", None) or repr(func)


def _in_place(name: str) -> bool:
    return (name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES) or name.startswith("__i")


class Stand(torch.Tensor):
    """A checkpoint tensor's stand-in: no storage; `payload` is a meta view of `root`."""

    @staticmethod
    def __new__(cls, index: int, payload: torch.Tensor, root: torch.Tensor, recorder: "Recorder") -> "Stand":
        stand = torch.Tensor._make_wrapper_subclass(
            cls, payload.shape, strides=payload.stride(), storage_offset=payload.storage_offset(),
            dtype=payload.dtype, device=recorder.device, requires_grad=False,
        )
        stand.index, stand.payload, stand.root, stand.recorder = index, payload, root, recorder
        return stand

    def __repr__(self) -> str:  # noqa: D105 - a stand-in prints as what it stands for
        return f"Stand({self.recorder.specs[self.index].name!r}, {tuple(self.shape)})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next(a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Stand))
        recorder, name = first.recorder, _op(func)
        if _on_device(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[1], Stand) and not isinstance(args[0], Stand):
            return recorder.copy(args[0], args[1])
        if func is torch.Tensor.__setitem__ and len(args) == 3 and isinstance(args[2], Stand) and not isinstance(args[0], Stand):
            with torch._C.DisableTorchFunctionSubclass():
                region = args[0][args[1]]
            recorder.copy(region, args[2])
            return None
        if isinstance(args[0] if args else None, Stand) and (_in_place(name) or func is torch.Tensor.__setitem__):
            raise recorder.refuse(first, name, " (a write into it)")
        if func in _ALIASES and args and args[0] is first:
            return first.moved(func, args[1:], kwargs)
        unwrapped = tree_map(lambda a: a.payload if isinstance(a, Stand) else a, (args, kwargs))
        try:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*unwrapped[0], **unwrapped[1])
        except Exception as exc:  # noqa: BLE001 - whatever fails on a meta payload is an op the record cannot take
            raise recorder.refuse(first, name, f", which fails on a stand-in ({type(exc).__name__}: {exc})") from None
        return first.wrap(out, name)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        stand = next(a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, Stand))
        raise stand.recorder.refuse(stand, str(func), " below torch's function layer")

    def wrap(self, out: Any, name: str) -> Any:
        """An op's result on the payload: a region of the same root is a stand-in again."""
        if isinstance(out, torch.Tensor):
            if _storage(out) != _storage(self.root):
                raise self.recorder.refuse(self, name, ", which makes a new tensor rather than a region of it")
            if out.dtype != self.root.dtype:
                raise self.recorder.refuse(self, name, f", which reads its bytes as {out.dtype}")
            return Stand(self.index, out, self.root, self.recorder)
        if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
            return type(out)(self.wrap(o, name) for o in out)
        return out

    def moved(self, func: Any, args: tuple, kwargs: dict) -> "Stand":
        """`.to(...)`, `.cpu()`, `.cuda()`: the same stand-in, unless it changes the dtype or the layout."""
        if func is torch.Tensor.to:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
            if dtype is not None and dtype != self.dtype:
                raise self.recorder.refuse(self, f"to({dtype})", f", a cast from {self.dtype}")
            if memory_format not in (None, torch.preserve_format) and not self.payload.is_contiguous(memory_format=memory_format):
                raise self.recorder.refuse(self, f"to(memory_format={memory_format})", ", which copies it")
        return self


class _Watch(TorchFunctionMode):
    """Active while a loader runs: records fills of loadable tensors, refuses other writes
    into them that do not come from a stand-in."""

    def __init__(self, recorder: "Recorder") -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dest = args[0] if args else None
        if isinstance(dest, torch.Tensor) and not isinstance(dest, Stand):
            name = _op(func)
            if func is torch.Tensor.__setitem__ and not isinstance(args[2], Stand):
                self.recorder.write(dest, name, args[2], index=args[1])
            elif _in_place(name) and not (name == "copy_" and isinstance(args[1], Stand)):
                value = 0 if name == "zero_" else args[1] if name == "fill_" and len(args) > 1 else None
                self.recorder.write(dest, name, value)
        return func(*args, **kwargs)


class Recorder:
    """One recording: the loadable tensors watched, the copies and fills seen, the loader running."""

    def __init__(self, specs: Iterable[TensorSpec], device: torch.device | str) -> None:
        self.specs = tuple(specs)
        self.device = torch.device(device)
        self.targets: list[tuple[str, str, torch.Tensor, int]] = []
        self.storages: dict[int, int] = {}
        self.copies: list[tuple[int, View, int, View, str]] = []
        self.fills: list[Fill] = []
        self.running: tuple[str, str] | None = None  # (target, loader) of the loader running
        self.refusal: UnexpressibleLoad | None = None

    # ---- set-up -----------------------------------------------------------------------------
    def stamp(self, layer: str, name: str, loader: Callable[..., Any]) -> Callable[..., Any]:
        """`loader`, telling the recording whose loader runs (the wrap of `loaders_on_meta`)."""
        what = (f"{layer}.{name}" if layer else name, getattr(loader, "__qualname__", None) or _op(loader))

        def stamped(*args: Any, **kwargs: Any) -> Any:
            outer, self.running = self.running, what
            try:
                with _Watch(self):
                    return loader(*args, **kwargs)
            finally:
                self.running = outer

        return stamped

    def watch(self, targets: Iterable[tuple[str, str, torch.Tensor, int]]) -> None:
        """The tensors loaders may write: (layer, name, tensor, declared padding), in model order."""
        for target in targets:
            tensor = target[2]
            if tensor.storage_offset() != 0 or not tensor.is_contiguous():
                raise UnexpressibleLoad(f"parameter '{target[0]}.{target[1]}' is not a contiguous tensor of its own: a shard receive cannot land in it")
            self.storages.setdefault(_storage(tensor), len(self.targets))
            self.targets.append(target)

    def target_of(self, tensor: torch.Tensor) -> int | None:
        return self.storages.get(_storage(tensor))

    # ---- during the load --------------------------------------------------------------------
    def refuse(self, stand: Stand | None, op: str, detail: str = "") -> UnexpressibleLoad:
        """The refusal of `op` (remembered: raised again after the load if a caller swallowed it)."""
        on = f" to checkpoint tensor {self.specs[stand.index].name!r}" if stand is not None else ""
        who = f"parameter {self.running[0]!r}: loader {self.running[1]}" if self.running else "the model's load_weights"
        error = UnexpressibleLoad(f"{who} applies {op}{on}{detail}; a shard receive cannot express it")
        self.refusal = self.refusal or error
        return error

    def copy(self, dest: torch.Tensor, stand: Stand) -> torch.Tensor:
        if dest.numel() != stand.numel():
            raise self.refuse(stand, "copy_", f", {list(stand.shape)} into a region of {list(dest.shape)} (a broadcast)")
        target = self.target_of(dest)
        if target is None:
            raise self.refuse(stand, "copy_", " into a tensor that is none of the model's loadable tensors (a temporary)")
        payload = stand.payload
        src = (payload.storage_offset(), tuple(payload.shape), tuple(payload.stride()))
        dst = (dest.storage_offset(), tuple(dest.shape), tuple(dest.stride()))
        self.copies.append((stand.index, src, target, dst, self.running[1] if self.running else "load_weights"))
        return dest

    def write(self, dest: torch.Tensor, name: str, value: Any, index: Any = None) -> None:
        """A write into `dest` that does not come from a stand-in: a fill when `value` is a number."""
        target = self.target_of(dest)
        if target is None:
            return  # a temporary of the loader's own
        if not isinstance(value, numbers.Number) or isinstance(value, bool):
            layer, tensor = self.targets[target][:2]
            raise self.refuse(None, name, f" to parameter '{layer}.{tensor}' with a computed value")
        if index is not None:
            with torch._C.DisableTorchFunctionSubclass():
                dest = dest[index]
        if dest.numel():
            self.fills.append(Fill(target, dest.storage_offset(), tuple(dest.shape), tuple(dest.stride()), float(value)))

    def run(self, load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any]) -> None:
        """`load_weights` over one stand-in per checkpoint tensor, in checkpoint order."""

        def stand_ins():
            for index, spec in enumerate(self.specs):
                root = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
                yield spec.name, Stand(index, root.view(root.shape), root, self)

        with torch.no_grad():
            load_weights(stand_ins())
        if self.refusal is not None:  # raised at the op; raised again if a caller swallowed it
            raise self.refusal

    # ---- the record -------------------------------------------------------------------------
    def needs(self, worker: int = 0) -> WorkerNeeds:
        """The record, checked: each copy one box, each touched layer rebuilt exactly."""
        touched = {self.targets[c[2]][0] for c in self.copies} | {self.targets[f.target][0] for f in self.fills}
        kept = [i for i, t in enumerate(self.targets) if t[0] in touched]
        renumber = {old: new for new, old in enumerate(kept)}
        targets = tuple(Target(l, n, tuple(t.shape), p) for l, n, t, p in (self.targets[i] for i in kept))
        needs = []
        for tensor, src, target, dst, loader in self.copies:
            need = need_of_copy(tensor, self.specs[tensor], src, renumber[target], dst)
            if isinstance(need, str):
                raise UnexpressibleLoad(
                    f"parameter '{targets[renumber[target]].describe()}': loader {loader} copies from checkpoint tensor "
                    f"{self.specs[tensor].name!r} {need}; a shard receive cannot express it"
                )
            needs.append(need)
        needs.sort(key=lambda n: (n.tensor, n.target, n.dst_offset))
        fills = tuple(Fill(renumber[f.target], f.offset, f.shape, f.stride, f.value) for f in self.fills)
        record = WorkerNeeds(worker, self.specs, targets, tuple(needs), fills)
        problems = coverage_problems(record)
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise UnexpressibleLoad("; ".join(problems[:3]) + more + "; a shard receive cannot rebuild these layers")
        return record


def record_needs(model: torch.nn.Module, specs: Iterable[TensorSpec], device: torch.device | str, *, worker: int = 0) -> WorkerNeeds:
    """What this vLLM worker's `model` needs of each checkpoint tensor of `specs` (wire
    dtypes, checkpoint order) and where each part lands, from its own loaders; `device`
    is the worker's (the stand-ins report it, as the tensors received will).
    `UnexpressibleLoad` names what cannot be recorded. Leaves the model as it was."""
    recorder = Recorder(specs, device)
    with internals.loaders_on_meta(model, recorder.stamp) as targets:
        recorder.watch((t.layer, t.name, t.tensor, t.padding) for t in targets)
        recorder.run(model.load_weights)
    return recorder.needs(worker)

