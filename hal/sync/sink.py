"""What a receiver delivers into: the one receiving contract.

A `Sink` is the engine side of a sync. The `Receiver` owns every copy and every
decision about where bytes land; the sink only says where it would like each tensor
(`destination`), takes tensors once they are complete and checked (`apply`), and hears
when a sync it took part of failed (`abort`):

    class MyEngine:
        policy = SinkPolicy()              # what it needs of the receiver (below)
        def destination(self, name):       # a tensor the receiver may write, or None
            return self.weights.get(name)
        def apply(self, pairs):            # complete tensors, in sending order
            ...
        def abort(self):                   # the sync failed after some pairs were applied
            ...

`destination(name)` returning a tensor means: write this tensor's new bytes there (the
receiver lands them in place when they travel alone and the sender vouches that the
whole tensor follows, or when they travel back to back with others in one segment and
their destinations lie back to back in one allocation in the same order (one flat
buffer of weights); it copies them there otherwise, casting if the dtype differs),
and `apply` then receives that very tensor. Returning None means: hand me a view in
`apply`, valid only during the call (copy what you keep, as `load_weights` does). On a
device, a view is ready in the order of the receiver's current stream: torch ops on that
stream (the default) read it after the bytes landed; reading it on another stream or on
the host needs that stream synchronized first.

A tensor is written into a destination, or handed to `apply`, only once all of its
bytes are here and, with verification, checked: after a failed sync every destination
holds its old bytes or its new bytes, never a mix (the one exception, a connection that
breaks in the middle of an in-place transfer, is reported by name: `Receiver.torn`).

What a sink needs of the receiver beyond that it declares once, as `policy`, a
`SinkPolicy` (every field has the default most sinks want):

- `in_place` (True): destinations may be received into directly. False: every tensor goes
  through the receiver's buffer and one copy, so not even a broken connection can tear
  one; also for a sink whose owner changes its destinations between syncs.
- `whole_buckets` (False): `apply` once per bucket, for a sink that pays for tensors of one
  group (a layer) arriving in different calls.
- `apply_unchanged` (False): in a delta sync (`SyncConfig.delta`) `apply` gets only the
  tensors that changed since the previous version, unless this is set (a sink that
  re-processes whole layers must see every tensor).
- `destinations` ("ask"): how the receiver learns where tensors go, and that this changed
  (another tensor under a name, one resized, re-typed or moved). "ask": it asks
  `destination(name)` for every tensor of every sync and checks each answer. A sink that
  can say more saves that per-tensor work on every sync after the first: "none" (it never
  names a destination: nothing is asked), "mapped" (they are the tensors of its mapping
  `tensors`, `MappedSink`: read in bulk and compared by identity, shape, dtype, strides
  and address with those checked), "generation" (it raises `generation` whenever one
  changes, `self.policy = self.policy.bumped()`: kept while the same sink shows the same
  generation). Whatever differs is checked again, in the same sync.

The receiver reads `policy` once, at the start of each sync.

When every tensor has an exact destination (wire dtype, contiguous, this device), the sync
is not verified and `in_place` holds, the destinations are a delta's base: changed words
are scattered into them, so they must hold, between syncs, exactly what the last sync
delivered (else the receiver keeps its own image of the sync, one model's worth of memory).

A plain callable `apply(pairs)` is accepted wherever a sink is (`as_sink`).
"""

from __future__ import annotations

import dataclasses
from operator import itemgetter
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import torch

Pairs = list[tuple[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SinkPolicy:
    """What a sink needs of the receiver (see the module doc)."""

    in_place: bool = True
    whole_buckets: bool = False
    apply_unchanged: bool = False
    destinations: str = "ask"
    """How the receiver learns the destinations: "ask", "none", "mapped" or "generation" (above)."""
    generation: int = 0
    """With destinations="generation": raised by the sink whenever a destination changes."""

    def __post_init__(self) -> None:
        for field in ("in_place", "whole_buckets", "apply_unchanged"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"SinkPolicy.{field} must be a bool, got {getattr(self, field)!r}")
        if self.destinations not in DESTINATIONS:
            raise ValueError(f"SinkPolicy.destinations must be one of {', '.join(map(repr, DESTINATIONS))}, got {self.destinations!r}")
        if type(self.generation) is not int or self.generation < 0:
            raise TypeError(f"SinkPolicy.generation must be an int >= 0, got {self.generation!r}")

    def bumped(self) -> "SinkPolicy":
        """This policy with the generation raised: the sink's destinations changed."""
        if self.destinations != "generation":
            raise ValueError(f"SinkPolicy.bumped: destinations={self.destinations!r} keeps no generation")
        return dataclasses.replace(self, generation=self.generation + 1)


# SinkPolicy.destinations, from the most work per sync to the least (the module doc)
DESTINATIONS = ("ask", "mapped", "generation", "none")

# What sinks declared before `SinkPolicy`, as attributes: refused by name, never ignored.
_FORMER_ATTRIBUTES = ("in_place", "whole_buckets", "apply_unchanged")


@runtime_checkable
class Sink(Protocol):
    policy: SinkPolicy

    def destination(self, name: str) -> torch.Tensor | None: ...
    def apply(self, pairs: Pairs) -> None: ...
    def abort(self) -> None: ...


@runtime_checkable
class MappedSink(Sink, Protocol):
    """A sink declaring `SinkPolicy(destinations="mapped")`: `destination(name)` is `tensors.get(name)`."""

    tensors: Mapping[str, torch.Tensor]


class CallableSink:
    """A sink around a plain `apply(pairs)` callable: no destinations, nothing to abort."""

    policy = SinkPolicy(destinations="none")

    def __init__(self, fn: Callable[[Pairs], Any]) -> None:
        self.fn = fn

    def destination(self, name: str) -> torch.Tensor | None:
        return None

    def apply(self, pairs: Pairs) -> None:
        self.fn(pairs)

    def abort(self) -> None:
        pass


def as_sink(target: Any) -> Sink:
    """`target` as a `Sink`: a sink as is, a callable wrapped in `CallableSink`."""
    methods = all(callable(getattr(target, m, None)) for m in ("destination", "apply", "abort"))
    if methods:
        policy = getattr(target, "policy", None)
        if not isinstance(policy, SinkPolicy):
            former = [a for a in _FORMER_ATTRIBUTES if hasattr(target, a)]
            hint = f" (it sets {', '.join(former)}: move them into the policy)" if former else ""
            got = "none" if policy is None else f"a {type(policy).__name__}"
            raise TypeError(
                f"sink {type(target).__name__} must declare `policy = SinkPolicy(...)` (hal.sync.sink), got {got}{hint}"
            )
        if policy.destinations == "mapped" and not isinstance(target, MappedSink):
            raise TypeError(f"sink {type(target).__name__} declares SinkPolicy(destinations='mapped') but has no `tensors` mapping")
        return target
    if callable(target):
        return CallableSink(target)
    raise TypeError(
        f"cannot receive into a {type(target).__name__}: pass a Sink (policy, destination, apply, abort) or a callable apply(pairs)"
    )


class CopyInto:
    """A `Sink` that writes each received tensor into `tensors[name]` (an engine's weights).

    Every name is a destination: the receiver writes the tensor's new bytes there (in
    place when they travel alone and the sender vouches for the whole tensor, by a copy
    through the backend otherwise, casting if the dtypes differ) and only then calls
    `apply`. With `record=True`, `apply` records the names in `received`, in order, across
    syncs (clear it between syncs to see what one sync delivered); by default nothing is
    kept, so a sink kept for a whole run holds no memory per sync. A name the engine does
    not hold is refused before anything is applied (the receiver asks `destination` at
    the header check). With `in_place=False` nothing is ever received straight into a
    tensor: every tensor goes through the receiver's buffer first, so even a connection
    that breaks mid-transfer cannot leave a tensor torn (at the cost of one more copy).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, in_place: bool = True, record: bool = False) -> None:
        if not isinstance(record, bool):
            raise TypeError(f"copy_into: record must be a bool, got {record!r}")
        self.tensors = tensors
        # the mapping is the user's, changed behind the sink's back: compared each sync
        self.policy = SinkPolicy(in_place=in_place, destinations="mapped")
        self.record = record
        self.received: list[str] = []
        """The names applied, with `record=True` (empty otherwise)."""

    def destination(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)

    def apply(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        # The receiver hands over only names it checked against `tensors` at the header: the
        # bytes are in place already, and nothing is left to do per tensor (called per
        # segment with thousands). Recording, each name is checked first.
        if not self.record:
            return
        names = list(map(itemgetter(0), pairs))
        if not all(map(self.tensors.__contains__, names)):
            missing = next(n for n in names if n not in self.tensors)
            raise KeyError(f"parameter {missing!r}: the engine holds no tensor of that name")
        self.received.extend(names)

    def abort(self) -> None:
        pass


def copy_into(tensors: Mapping[str, torch.Tensor], *, in_place: bool = True, record: bool = False) -> CopyInto:
    """A sink for `Receiver.receive` that writes into `tensors` (see `CopyInto`)."""
    return CopyInto(tensors, in_place=in_place, record=record)
