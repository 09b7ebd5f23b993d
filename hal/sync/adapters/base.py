"""The state-dict adapter: one contract for "trainer tensors as checkpoint tensors".

A trainer holds its weights under its own names and layouts (wrapper prefixes, a peft
model's `base_layer`, transformers 5's packed experts, Megatron's fused QKV shards); the
engine loads a checkpoint's. An adapter says, for one model, what each trainer tensor is in
the checkpoint, as torchtitan's `StateDictAdapter.to_hf` does, in the one direction a sync
needs (the engine's loader reads the checkpoint's names: nothing maps them back).

It answers in two steps, so that a sender learns names and layouts without touching bytes
and reads the bytes as views where it can:

    rules = adapter.rules(names, tensors)   # once per layout: reads names, shapes, dtypes only
    rules.get(name)                         # None: the checkpoint holds the tensor as it is
                                            # Renamed(n): whole, under `n` (None: left out)
                                            # a Derived rule: apply(tensor) -> its tensors

`adapt(pairs, adapter)` applies them to a state dict's pairs, lazily (one tensor made at a
time: a gather, a merge). `Chain(a, b, ...)` composes adapters: each is given the names the
one before it made. An adapter that only renames (`NameAdapter`) is applied as one function
per name, without a table. Adapters compare by what they map with (`==`), so a source made
anew every sync with the same adapters is the same kind of source for the steady state
(hal.sync.plan.steady).

Imports nothing of hal.sync (a `Block`, hal.sync.plan.declare's, may be what a rule makes:
a tensor-parallel rank's part of a larger tensor).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator, Sequence

import torch

if TYPE_CHECKING:  # pragma: no cover
    from hal.sync.plan.declare import Block

# Only these are read as they are (a tensor subclass such as a DTensor may need a gather)
PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))

Held = tuple[str, "torch.Tensor | Block"]
NameFunction = Callable[[str], "str | None"]


class Rule:
    """What one trainer tensor is in the checkpoint (an adapter's answer for one name)."""

    __slots__ = ()
    whole: ClassVar[bool]
    """The checkpoint holds the tensor itself (`Renamed`), not tensors made from it."""


class Renamed(Rule):
    """The tensor, whole, under another name; `name` None leaves it out of the checkpoint."""

    __slots__ = ("name",)
    whole = True

    def __init__(self, name: str | None) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Renamed({self.name!r})"


class Derived(Rule):
    """Tensors made from the trainer's tensor: views of it (a split, a transpose, a shard's
    block) or, when `views` is false, new tensors (a merge)."""

    __slots__ = ()
    whole = False
    views: ClassVar[bool] = True
    """`apply` gives views of its tensor: a listing may hold them and read the tensor's memory
    every sync. False: it computes (the sender must call it every sync)."""

    @abstractmethod
    def apply(self, tensor: torch.Tensor) -> list[Held]:
        """The checkpoint's (name, tensor) pairs made from `tensor` (already materialized:
        gathered, detached)."""

    def layout(self, tensor: torch.Tensor) -> list[Held]:
        """The pairs' names, shapes and dtypes from a stand-in of `tensor` (a meta tensor, or
        the tensor itself), without reading its bytes: views of it, by default."""
        return self.apply(tensor)


class StateDictAdapter(ABC):
    """Trainer tensors as checkpoint tensors (see the module doc)."""

    views: ClassVar[bool] = True
    """Every tensor it makes is a view of a trainer tensor (False: it computes, a merge)."""

    @abstractmethod
    def rules(self, names: list[str], tensors: list[torch.Tensor]) -> dict[str, Rule]:
        """The rule of every name of `names` (a state dict's, in order) that the checkpoint
        holds otherwise; a name without one is the checkpoint's as it is. Reads the tensors'
        names, shapes and dtypes only (they may be DTensors, or meta stand-ins)."""

    def name_function(self) -> NameFunction | None:
        """When this adapter only renames or leaves out tensors: the function of one name
        that does it (applied per name, with no table of rules). None otherwise."""
        return None

    def to_checkpoint(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> list[Held]:
        """A state dict's pairs as the checkpoint holds them (torchtitan's `to_hf`)."""
        return list(adapt(pairs, self))


class NameAdapter(StateDictAdapter):
    """An adapter that only renames tensors, or leaves them out (`name` returns None)."""

    @abstractmethod
    def name(self, name: str) -> str | None:
        """The checkpoint's name of the trainer's tensor `name`; None to leave it out."""

    def name_function(self) -> NameFunction:
        return self.name

    def rules(self, names: list[str], tensors: list[torch.Tensor]) -> dict[str, Rule]:
        rename = self.name_function()
        rules: dict[str, Rule] = {}
        for name in names:
            target = rename(name)
            if target != name:
                rules[name] = Renamed(target)
        return rules


class Chain(StateDictAdapter):
    """Adapters applied one after another: each is given the names (and the tensors' stand-ins)
    the one before it made. Nested chains are flattened; None entries are skipped."""

    def __init__(self, *adapters: StateDictAdapter | None) -> None:
        flat: list[StateDictAdapter] = []
        for adapter in adapters:
            if adapter is None:
                continue
            if isinstance(adapter, Chain):
                flat.extend(adapter.adapters)
            elif isinstance(adapter, StateDictAdapter):
                flat.append(adapter)
            else:
                raise TypeError(f"Chain: {type(adapter).__name__} is not a StateDictAdapter (hal.sync.adapters)")
        self.adapters: tuple[StateDictAdapter, ...] = tuple(flat)
        functions = [a.name_function() for a in flat]
        self._names = None if None in functions else _composed(functions)

    @property
    def views(self) -> bool:  # type: ignore[override]
        return all(a.views for a in self.adapters)

    def name_function(self) -> NameFunction | None:
        return self._names

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Chain) and self.adapters == other.adapters

    __hash__ = None  # type: ignore[assignment]  # its adapters need not be hashable

    def __repr__(self) -> str:
        return f"Chain({', '.join(map(repr, self.adapters))})"

    def rules(self, names: list[str], tensors: list[torch.Tensor]) -> dict[str, Rule]:
        stages = self.stages(names, tensors)
        rules: dict[str, Rule] = {}
        for name in names:
            rule = _through(stages, name)
            if rule is not None:
                rules[name] = rule
        return rules

    def stages(self, names: list[str], tensors: list[torch.Tensor]) -> list[dict[str, Rule]]:
        """Each adapter's rules, for the names the adapters before it made (made from stand-ins
        of the tensors: meta views of a DTensor, nothing gathered)."""
        stages = []
        last = len(self.adapters) - 1
        for at, adapter in enumerate(self.adapters):
            rules = adapter.rules(names, tensors)
            stages.append(rules)
            if at == last or not rules:
                continue
            next_names: list[str] = []
            next_tensors: list[Any] = []
            for name, tensor in zip(names, tensors):
                rule = rules.get(name)
                if rule is None:
                    next_names.append(name)
                    next_tensors.append(tensor)
                elif rule.whole:
                    if rule.name is not None:
                        next_names.append(rule.name)
                        next_tensors.append(tensor)
                else:
                    for made, held in rule.layout(stand_in(name, tensor)):
                        next_names.append(made)
                        next_tensors.append(held)
            names, tensors = next_names, next_tensors
        return stages


class _Then(Derived):
    """A derived rule, then what the later adapters of a chain make of its tensors."""

    __slots__ = ("rule", "later")

    def __init__(self, rule: Derived, later: list[dict[str, Rule]]) -> None:
        self.rule, self.later = rule, later

    @property
    def views(self) -> bool:  # type: ignore[override]
        return self.rule.views and all(r.views for stage in self.later for r in stage.values() if not r.whole)

    def apply(self, tensor: torch.Tensor) -> list[Held]:
        return [pair for made in self.rule.apply(tensor) for pair in _follow(self.later, 0, *made, layout=False)]

    def layout(self, tensor: torch.Tensor) -> list[Held]:
        return [pair for made in self.rule.layout(tensor) for pair in _follow(self.later, 0, *made, layout=True)]


def _through(stages: list[dict[str, Rule]], name: str) -> Rule | None:
    """The composite rule of the first stage's `name` (None: kept as it is)."""
    target = name
    for k in range(len(stages)):
        rule = stages[k].get(target)
        if rule is None:
            continue
        if not rule.whole:
            later = stages[k + 1 :]  # (a rename before it changes nothing it makes: its names are its own)
            return _Then(rule, later) if any(later) else rule
        target = rule.name
        if target is None:
            return Renamed(None)
    return None if target == name else Renamed(target)


def _follow(stages: list[dict[str, Rule]], at: int, name: str, held: Any, *, layout: bool) -> list[Held]:
    """What stages `at`.. make of a tensor (or block) an earlier stage made."""
    for k in range(at, len(stages)):
        rule = stages[k].get(name)
        if rule is None:
            continue
        if rule.whole:
            name = rule.name
            if name is None:
                return []
            continue
        if not isinstance(held, torch.Tensor):
            raise ValueError(f"tensor {name!r}: {type(held).__name__} made by one adapter cannot be split again by another ({rule!r})")
        made = rule.layout(held) if layout else rule.apply(held)
        return [pair for m in made for pair in _follow(stages, k + 1, *m, layout=layout)]
    return [(name, held)]


def _composed(functions: list[NameFunction]) -> NameFunction:
    if len(functions) == 1:
        return functions[0]
    if len(functions) == 2:
        first, second = functions

        def both(name: str) -> str | None:
            name = first(name)
            return None if name is None else second(name)

        return both

    def every(name: str) -> str | None:
        for function in functions:
            name = function(name)
            if name is None:
                return None
        return name

    return every


def stand_in(name: str, tensor: Any) -> Any:
    """`tensor` out of autograd, or for a tensor subclass (a DTensor) a meta tensor of its
    (global) shape: what the shapes of tensors made from it are read from, without a gather."""
    if type(tensor) in PLAIN:
        return tensor.detach() if tensor.requires_grad else tensor
    if not isinstance(tensor, torch.Tensor):
        return tensor  # a block: what its adapter made, as it is
    return torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")


def adapt(
    pairs: Iterable[tuple[str, torch.Tensor]],
    adapter: StateDictAdapter | None,
    *,
    whole: Callable[[torch.Tensor], torch.Tensor] | None = None,
    split: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    layout: bool = False,
) -> Iterator[Held]:
    """`pairs` as `adapter`'s checkpoint holds them, one tensor at a time.

    `whole(tensor)`: what a tensor the checkpoint holds as it is becomes (a gather, a
    detach; the tensor itself without it). `split(name, tensor)`: what a derived rule is
    given of the trainer's tensor `name` (its full tensor; without it, the tensor itself).
    `layout`: only names, shapes and dtypes are wanted (`Derived.layout`: a merge is not
    computed). Applied per name when the adapter only renames, else from its rules (made
    from the whole list of pairs first)."""
    if adapter is None:
        for name, tensor in pairs:
            yield name, whole(tensor) if whole else tensor
        return
    rename = adapter.name_function()
    if rename is not None:  # the common case: no table, one call per name
        for name, tensor in pairs:
            target = rename(name)
            if target is not None:
                yield target, whole(tensor) if whole else tensor
        return
    pairs = pairs if isinstance(pairs, list) else list(pairs)
    rules = adapter.rules([p[0] for p in pairs], [p[1] for p in pairs])
    for name, tensor in pairs:
        rule = rules.get(name)
        if rule is None:
            yield name, whole(tensor) if whole else tensor
        elif rule.whole:
            if rule.name is not None:
                yield rule.name, whole(tensor) if whole else tensor
        else:
            base = split(name, tensor) if split else tensor
            yield from (rule.layout(base) if layout else rule.apply(base))

