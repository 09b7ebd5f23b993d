"""Where a sync reads the trainer's weights from.

A source declares its tensors (`metadata()`, cheap, no gather) and yields fully
materialized `(name, tensor)` pairs in the same order on each iteration, a fresh pass
every time: nothing per-sync survives into the next sync. This mirrors vLLM's
`WeightSource`, so a vLLM source can be passed as is.

A source may also list its tensors (`ListedSource.listing`): the tensor objects it holds,
without a spec per tensor. A sender keeps the last listing and, when the next one lists
the same objects with the same shapes and dtypes, reuses the specs, the plan and the
lists it packs from (hal.sync.plan.steady): a sync of unchanged tensors then costs per
segment, not per tensor. `ModuleSource` and `TensorSource` list theirs. What a sender
learned from one kind of source (its class) it reuses only for a source of that kind: a
subclass that converts what it yields is another kind (hal.sync.plan.steady), and so is
a listing made by other adapters (below).

Names and layouts are a state-dict adapter's (hal.sync.adapters): `ModuleSource`'s
`adapter` (a `Chain`: wrapper prefixes, transformers' packed experts, a rename) makes the
checkpoint's tensors of the module's, and its listing carries it (`Listing.adapter`): part
of the key of what a sender keeps from one sync to the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import chain, repeat
from operator import attrgetter, is_, is_not, itemgetter
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence, runtime_checkable

import torch

from hal.sync.adapters.base import PLAIN, Chain, StateDictAdapter, adapt, stand_in
from hal.sync.adapters.checkpoint_layout import checkpoint_layout
from hal.sync.adapters.local_rows import LocalRows
from hal.sync.adapters.names import WRAPPER_COMPONENTS, Rename, Unwrap, unwrapped_name
from hal.sync.spec import TensorSpec

__all__ = [
    "PLAIN", "WRAPPER_COMPONENTS", "ListedSource", "Listing", "LocalSource", "ModuleSource", "TensorSource", "WeightSource",
    "as_source", "materialize", "persistent_buffers", "unwrapped_name",
]

_UNWRAP = Unwrap()


@runtime_checkable
class WeightSource(Protocol):
    def metadata(self) -> Sequence[TensorSpec]: ...
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


@runtime_checkable
class LocalSource(Protocol):
    """A source that can also say what this rank holds without a gather: what every trainer
    rank sending its own rows reads (hal.sync.send.sharded). `ModuleSource` and `TensorSource` are."""

    def local_tensors(self) -> list[tuple[str, torch.Tensor]]: ...


@dataclass(frozen=True, slots=True, eq=False)
class Listing:
    """The tensors a source holds for a sync, in `metadata()` order: their names and the
    tensor objects themselves (a DTensor as it is, not gathered), or views of them (a
    checkpoint's per-expert tensors: hal.sync.adapters.checkpoint_layout; of a DTensor, meta views
    that only say its shape, with `as_yielded` false)."""

    names: list[str]
    tensors: list[torch.Tensor]
    as_yielded: bool
    """Iterating the source yields these very tensors (or detached aliases of them), so a
    sender may read plain ones from here instead of iterating: False for a source whose
    iteration does more (a subclass that overrides `__iter__`)."""
    basis: Any = None
    """What the source recognises its own unchanged listing by, next sync (its own business)."""
    adapter: Any = None
    """The state-dict adapters (hal.sync.adapters) that made these tensors of the source's
    own, compared by `==`: part of the key of what a sender keeps from one sync to the next
    (another adapter may make other bytes of the same tensors under the same names)."""


@runtime_checkable
class ListedSource(Protocol):
    """A source that can list its tensors (see the module doc)."""

    def listing(self, last: Listing | None) -> Listing:
        """This sync's listing. `last` is the listing its sender kept from the last sync (of
        this source or another): returning it unchanged says the same names map to the same
        tensor objects (their shapes and dtypes the sender checks itself)."""
        ...


def materialize(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor: FSDP DTensors gather through `full_tensor()` (a collective)."""
    if type(tensor) is torch.Tensor:  # the common case, without an attribute lookup
        return tensor
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` out of autograd (a copy from it must not join a graph); a new tensor object
    only when it is in one."""
    return tensor.detach() if tensor.requires_grad else tensor


class ModuleSource:
    """The parameters and persistent buffers of a module (what its `state_dict()` holds,
    each tensor once), as the engine's checkpoint holds them: through the state-dict
    adapters (hal.sync.adapters) `Unwrap` (names without the wrappers torch inserts,
    `WRAPPER_COMPONENTS`: activation checkpointing, FSDP1, `torch.compile`), then the
    checkpoint's layout, then `adapter`, then `rename` (its `adapter` attribute: their `Chain`).

    A transformers model is sent as its checkpoint holds it (`checkpoint=True`,
    hal.sync.adapters.checkpoint_layout): transformers 5's 3-D expert parameters
    (`mlp.experts.gate_up_proj`) as the checkpoint's one tensor per expert
    (`mlp.experts.{e}.gate_proj.weight`, ...), views of the parameter, under the names
    transformers' own conversion mapping gives them. `checkpoint=False`: the module's own
    names and layouts.

    `rename(name)` returns the name the engine expects (given the checkpoint's name), or
    None to leave the tensor out of the sync (e.g. LoRA adapters when only the base
    travels). `adapter`: another state-dict adapter (or a `Chain` of them) applied before
    `rename`. Persistent buffers travel because training may change them and the engine
    loads them from a checkpoint (a MoE router's `e_score_correction_bias` in
    DeepSeek-V3's layout); non-persistent ones (rotary `inv_freq`) are the module's own
    cache and stay. `buffers=False`: parameters only.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        rename: Callable[[str], str | None] | None = None,
        *,
        buffers: bool = True,
        checkpoint: bool = True,
        adapter: StateDictAdapter | None = None,
    ) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"ModuleSource needs a torch.nn.Module, got {type(module).__name__}")
        for field, value in (("buffers", buffers), ("checkpoint", checkpoint)):
            if not isinstance(value, bool):
                raise TypeError(f"ModuleSource: {field} must be a bool, got {type(value).__name__}")
        if adapter is not None and not isinstance(adapter, StateDictAdapter):
            raise TypeError(f"ModuleSource: adapter must be a StateDictAdapter (hal.sync.adapters), got {type(adapter).__name__}")
        self.module = module
        self.rename = rename
        self.buffers = buffers
        self.checkpoint = checkpoint
        self.adapter = Chain(
            _UNWRAP, checkpoint_layout(module) if checkpoint else None, adapter, Rename(rename) if rename is not None else None
        )

    def _named(self, split: Callable, whole: Callable | None = None, layout: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) per tensor sent, in order: `whole(tensor)` (the tensor itself without
        `whole`) for one the checkpoint holds as it is; what a rule makes of `split(name, tensor)`
        for one it holds otherwise (`name`: the module's)."""
        named = self.module.named_parameters()
        if self.buffers:
            named = chain(named, persistent_buffers(self.module))
        return adapt(named, self.adapter, whole=whole, split=split, layout=layout)

    def metadata(self) -> list[TensorSpec]:
        # DTensor reports its global shape, so no gather happens here (nor for its views: made of a meta tensor)
        return [TensorSpec.of(name, p) for name, p in self._named(split=_stand_in, layout=True)]

    def listing(self, last: Listing | None) -> Listing:
        """The parameters and buffers (the objects themselves), or the tensors the checkpoint
        holds made of them (views, made once per listing; stand-ins of what an adapter
        computes). `named_parameters()` costs microseconds per parameter (names built,
        modules walked through generators): while the module tree still holds the same
        modules, parameters and buffers under the same names (`_ModuleTree.unchanged`), the
        last listing is handed back instead, to a source of the same class with the same
        adapters only (another may yield other bytes)."""
        basis = last.basis if last is not None else None
        if (
            isinstance(basis, _ModuleTree) and basis.kind is type(self) and basis.module is self.module
            and basis.buffers == self.buffers and basis.adapter == self.adapter and basis.unchanged()
        ):
            return last
        tree = _ModuleTree(self.module, self.adapter, self.buffers)  # before the walk: a change during it shows next time
        tree.kind = type(self)
        split: list[torch.Tensor] = []

        def viewed(name: str, tensor: torch.Tensor) -> torch.Tensor:
            split.append(tensor)
            return _stand_in(name, tensor)

        named = list(self._named(split=viewed, layout=True))
        tree.watch_split(split)
        # a split DTensor is listed as meta views (its shape), what an adapter computes as
        # stand-ins: the sender iterates (gathers, computes) it
        as_yielded = type(self).__iter__ is ModuleSource.__iter__ and self.adapter.views and all(type(t) in PLAIN for t in split)
        return Listing(list(map(itemgetter(0), named)), list(map(itemgetter(1), named)), as_yielded, tree, self.adapter)

    def local_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors as this rank holds them (DTensors not gathered), out of autograd. A
        checkpoint tensor made of an FSDP2-sharded parameter (transformers' packed experts)
        is this rank's alone where its rows hold all of it, another rank's where they hold
        none of it (left out), refused by name where it spans two ranks' rows
        (hal.sync.adapters.local_rows)."""
        rows = LocalRows()

        def split(name: str, tensor: torch.Tensor) -> torch.Tensor:
            return tensor.detach() if type(tensor) in PLAIN else rows.global_stand_in(name, tensor)

        out = []
        for name, tensor in self._named(whole=torch.Tensor.detach, split=split):
            if rows.made_of_shard(tensor):
                tensor = rows.local_view(name, tensor)
                if tensor is None:
                    continue
            out.append((name, tensor))
        return out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._named(whole=_materialized, split=_split_materialized)


def _materialized(tensor: torch.Tensor) -> torch.Tensor:
    return materialize(tensor.detach())


def _split_materialized(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return materialize(tensor.detach())


_stand_in = stand_in  # `tensor` out of autograd, or for a DTensor a meta tensor of its (global) shape


class TensorSource:
    """Already materialized `(name, tensor)` pairs (a state dict's items, a list)."""

    def __init__(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.pairs = list(pairs)
        # made anew every sync by many callers: checked without a Python step per tensor, the
        # loop only to name the offender
        if not all(map(isinstance, map(itemgetter(1), self.pairs), repeat(torch.Tensor))):
            for name, tensor in self.pairs:
                if not isinstance(tensor, torch.Tensor):
                    raise TypeError(f"TensorSource: {name!r} is a {type(tensor).__name__}, not a tensor")

    def metadata(self) -> list[TensorSpec]:
        return [TensorSpec.of(name, t) for name, t in self.pairs]

    def listing(self, last: Listing | None) -> Listing:
        """The pairs' names and tensors (a fresh listing: the sender compares it with `last`)."""
        pairs = self.pairs
        return Listing(list(map(itemgetter(0), pairs)), list(map(itemgetter(1), pairs)), type(self).__iter__ is TensorSource.__iter__)

    def local_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors as this rank holds them (DTensors not gathered), out of autograd."""
        return [(name, _detached(t)) for name, t in self.pairs]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        plain = torch.Tensor
        for name, tensor in self.pairs:
            # the common case (a plain tensor out of autograd) without a call per tensor
            yield name, tensor if type(tensor) is plain and not tensor.requires_grad else materialize(_detached(tensor))


_not_none = partial(is_not, None)
_MODULES, _PARAMETERS, _BUFFERS = attrgetter("_modules"), attrgetter("_parameters"), attrgetter("_buffers")
_NON_PERSISTENT = attrgetter("_non_persistent_buffers_set")


def persistent_buffers(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`module`'s buffers that its `state_dict()` holds, under their full names, each
    tensor once (`named_buffers` drops a buffer held twice)."""
    for name, buffer in module.named_buffers():
        owner, _, key = name.rpartition(".")
        if key not in module.get_submodule(owner)._non_persistent_buffers_set:
            yield name, buffer


class _ModuleTree:
    """A module tree as a `ModuleSource` listed it: every module, and each slot (a dict and
    a key) that held a child module, a parameter or (when listed) a buffer, with what it held.

    `unchanged()` reads every slot again, in C (no Python step per parameter: `map` over
    prepared lists), and compares by identity: a parameter, buffer or module replaced
    (through `setattr`, `register_buffer` or a write into the dict, as FSDP2 does), added,
    removed or renamed, a buffer made persistent or not (each module's set of non-persistent
    names is compared by its size), and a module's dicts replaced (as
    `ModuleList.__delitem__` does), all show. Not shown: keys of one dict reordered in
    place, which changes only the order the sync sends the same names in. A tensor's own
    shape, dtype and memory may change under the same object (`p.data = ...`): the sender
    checks shapes and dtypes, and copies from the object."""

    def __init__(self, module: torch.nn.Module, adapter: Chain | None, buffers: bool = False) -> None:
        self.module, self.adapter, self.buffers = module, adapter, buffers
        self.kind: type | None = None  # the class of the source that listed it
        self.split: list[torch.Tensor] = []  # tensors listed as views of them: their memory, watched
        self.split_memory: list[Any] = []
        modules = [module]
        for m in modules:  # grows as it is walked: breadth first
            modules.extend(filter(_not_none, m._modules.values()))
        self.modules = modules
        self.dict_getters = (_MODULES, _PARAMETERS) + ((_BUFFERS, _NON_PERSISTENT) if buffers else ())
        self.dicts = [list(map(get, modules)) for get in self.dict_getters]
        self.sizes = self._sizes()
        self.slot_dicts: list[dict] = []
        self.slot_keys: list[str] = []
        self.held: list[Any] = []
        for dicts in self.dicts[:3]:  # the non-persistent sets hold names, not slots: their sizes say enough
            for d in dicts:
                for key, value in d.items():
                    self.slot_dicts.append(d)
                    self.slot_keys.append(key)
                    self.held.append(value)

    def _sizes(self) -> list[int]:
        return [n for dicts in self.dicts for n in map(len, dicts)]

    def watch_split(self, tensors: list[torch.Tensor]) -> None:
        """The listing holds views of `tensors` (an adapter's: hal.sync.adapters), not the tensors:
        their memory replaced in place (`p.data = ...`) leaves the views on the old memory,
        so it is compared too (a DTensor's shape and dtype only: it is listed by shape)."""
        self.split = tensors
        self.split_memory = _memory(tensors)

    def unchanged(self) -> bool:
        modules = self.modules
        return (
            all(all(map(is_, map(get, modules), dicts)) for get, dicts in zip(self.dict_getters, self.dicts))
            and self._sizes() == self.sizes
            and all(map(is_, map(dict.get, self.slot_dicts, self.slot_keys), self.held))
            and (not self.split or _memory(self.split) == self.split_memory)
        )


def _memory(tensors: list[torch.Tensor]) -> list[Any]:
    """Where and how each tensor lies: address, strides, shape and dtype (shape and dtype only
    for a tensor subclass, which may have no address)."""
    return [
        (t.data_ptr(), t.stride(), t.shape, t.dtype) if type(t) in PLAIN else (t.shape, t.dtype)
        for t in tensors
    ]


def as_source(source: object) -> WeightSource:
    """Accept a module, a source, a dict of tensors or a list of pairs."""
    if isinstance(source, torch.nn.Module):
        return ModuleSource(source)
    if isinstance(source, WeightSource):
        return source
    if isinstance(source, dict):
        return TensorSource(source.items())
    if isinstance(source, (list, tuple)):
        return TensorSource(source)
    raise TypeError(
        f"cannot sync from a {type(source).__name__}: pass a torch.nn.Module, a dict or list of "
        "(name, tensor), or an object with metadata() and __iter__"
    )
