"""The steady state: what each side of a sync recognises as unchanged since the last one.

A job syncs the same tensors every step. What a sync needs of them beyond their bytes (a
spec per tensor, the plan, the lists a segment is packed from; on the receiving side the
engine's destinations, checked against the specs) depends only on which tensors they are,
so it is kept and recognised again at a cost per tensor of a few C-level compares, never
a Python step:

- `KnownSource` (the sender's): the last listing of its source (hal.sync.source.Listing)
  and the specs made from it, for one kind of source at a time (its class, and the
  state-dict adapters its listing was made with, `Listing.adapter`: hal.sync.adapters):
  a source of another kind may
  declare or yield other specs and bytes from the same tensors (a `ModuleSource` subclass
  that converts them, `MergedSource`, a Megatron source, a `ModuleSource` with another
  rename or adapter), so a sync from it starts afresh. The same names with the same shapes and dtypes are the
  same specs, so the same plan; the same tensor objects besides, at the same addresses
  and as contiguous as they were, are the same lists and prepared copies to pack from (`epoch`):
  a parameter whose memory was replaced in place (`p.data = ...`), or which moved, gets
  them made again in the same sync.
- `KnownDestinations` (the receiver's): the sink's destinations it checked last sync,
  kept while the sink says they are unchanged (`SinkPolicy.destinations`): a sink that
  names none; the same sink showing the same generation; for a sink that maps names to
  tensors (`copy_into`), the same objects under the same names with the same shape,
  dtype, contiguity and address.

Anything else is checked again, as on a first sync, in the same sync.
"""

from __future__ import annotations

from operator import attrgetter, eq, is_
from typing import Any

import torch

from hal.sync.spec import TensorSpec
from hal.sync.source import PLAIN, Listing

_shape, _dtype = attrgetter("shape"), attrgetter("dtype")


class Snapshot:
    """Tensors as they were when kept: their shapes and dtypes, and for plain tensors read as
    memory (`memory=True`) their contiguity and addresses. Read back as lists of tuples,
    dtypes, bools and ints, compared inside `map`: no Python step per tensor, and nothing
    the collector tracks made per tensor while comparing."""

    __slots__ = ("shapes", "dtypes", "contiguous", "ptrs")

    def __init__(self, tensors: list[torch.Tensor] = (), memory: bool = False) -> None:
        self.shapes = [tuple(t.shape) for t in tensors]
        self.dtypes = [t.dtype for t in tensors]
        self.contiguous = list(map(torch.Tensor.is_contiguous, tensors)) if memory else []
        self.ptrs = list(map(torch.Tensor.data_ptr, tensors)) if memory else []

    def same_shapes_and_dtypes(self, tensors: list[torch.Tensor]) -> bool:
        """Whether every tensor still has its shape and dtype (compared one at a time: a list
        of thousands of shapes alive at once would set off the collector)."""
        return all(map(eq, map(_shape, tensors), self.shapes)) and all(map(is_, map(_dtype, tensors), self.dtypes))

    def same_memory(self, tensors: list[torch.Tensor]) -> bool:
        """Whether every tensor is still at its address and as contiguous as it was: the memory
        a copy prepared from it reads or writes (on another device it is another address)."""
        return list(map(torch.Tensor.data_ptr, tensors)) == self.ptrs and list(map(torch.Tensor.is_contiguous, tensors)) == self.contiguous


def same_listing(listing: Listing, last: Listing) -> bool:
    """Whether `listing` names the same tensor objects as `last`, in the same order, made by
    the same adapters."""
    return listing is last or (
        listing.names == last.names
        and len(listing.tensors) == len(last.tensors)
        and all(map(is_, listing.tensors, last.tensors))
        and listing.adapter == last.adapter
    )


class KnownSource:
    """A sender's memory of its source's last listing (see the module doc)."""

    def __init__(self) -> None:
        self.kind: type | None = None
        """The class of the source the listing is from (`begin`; its adapters are the listing's)."""
        self.listing: Listing | None = None
        self.metadata: list[TensorSpec] = []
        self.epoch = 0
        """Bumped whenever the listed tensors change (other objects, or their memory): what
        is made from one listing (the packer's lists and prepared copies) carries it."""
        self.readable = False
        """The packer may read the tensors from the listing (plain tensors, yielded as listed)."""
        self._kept = Snapshot()  # the listed tensors as they were (their memory only when readable)
        self._position: dict[str, int] | None = None
        self._pending: Listing | None = None  # accepted by `recall`, not yet settled

    def begin(self, source: object) -> None:
        """A sync from `source` starts: what was kept from a source of another class is
        forgotten (a listing, its specs, the lists packed from it); from a source with other
        adapters, it is not recalled (`recall`)."""
        if type(source) is not self.kind:
            self.forget()
            self.kind = type(source)

    def recall(self, listing: Listing) -> list[TensorSpec] | None:
        """The last sync's metadata when `listing` names the same tensors with the same shapes
        and dtypes, else None. Which tensors to read is settled later (`settle`): the header
        needs only the specs."""
        last = self.listing
        if last is None:
            return None
        if listing is not last and (listing.names != last.names or listing.adapter != last.adapter):
            return None
        if not self._kept.same_shapes_and_dtypes(listing.tensors):
            return None
        self._pending = listing
        return self.metadata

    def settle(self) -> None:
        """Take the listing `recall` accepted as the one to read from: the same lists and
        prepared copies (`epoch`) only if it holds the same objects at the same addresses.
        The sender calls it while the receivers check the header, off the critical path."""
        listing, self._pending = self._pending, None
        if listing is None:
            return
        last = self.listing
        if not same_listing(listing, last) or listing.as_yielded != last.as_yielded or (self.readable and not self._kept.same_memory(listing.tensors)):
            self._take(listing)
        self.listing = listing

    def remember(self, listing: Listing, metadata: list[TensorSpec]) -> None:
        """`metadata` is what the source declared for `listing` this sync."""
        self.metadata = metadata
        self._take(listing)

    def forget(self) -> None:
        self.kind, self.listing, self.metadata, self._position, self.readable, self._pending = None, None, [], None, False, None
        self.epoch += 1

    def _take(self, listing: Listing) -> None:
        self.listing, self._pending = listing, None
        self.epoch += 1
        self._position = None
        self.readable = listing.as_yielded and set(map(type, listing.tensors)) <= PLAIN
        self._kept = Snapshot(listing.tensors, memory=self.readable)

    def position(self, name: str) -> int:
        """Where tensor `name` is in the listing (made once per listing)."""
        if self._position is None:
            self._position = {n: i for i, n in enumerate(self.listing.names)}
        return self._position[name]


class KnownDestinations:
    """A receiver's memory of the destinations it checked last sync (see the module doc).

    `recall` answers what was checked when nothing it depended on changed: the header's
    spec tuple (the decoder hands out the same tuple for the same specs), which tensors may
    land in place, the sink object and what it says of its destinations."""

    def __init__(self) -> None:
        self.forget()

    def recall(self, same: tuple, equal: tuple, sink: Any) -> Any:
        """What `remember` kept under `same` (compared item by item by identity) and `equal`
        (by value; its first item the sink's `SinkPolicy.destinations`), if the sink's
        destinations are unchanged; else None."""
        if len(same) != len(self._same) or not all(map(is_, same, self._same)) or equal != self._equal:
            return None
        if equal[0] != "mapped":
            return self._checked  # "none", or the same sink at the same generation
        compared, self._compared = self._compared, None
        return self._checked if compared is sink or self._unchanged(sink) else None

    def precheck(self, sink: Any, policy: Any) -> None:
        """Compare a mapped sink's tensors with those kept, ahead of the header (the receiver
        waits for it anyway, while the sender reads its own source): `recall` then only
        looks the answer up."""
        self._compared = sink if policy.destinations == "mapped" and self._unchanged(sink) else None

    def _unchanged(self, sink: Any) -> bool:
        tensors = self._tensors
        # the same objects under the same names, each still as it was: the shape it was
        # checked for, the dtype and layout that decided whether it is written in place,
        # and its address (on another device it is another address)
        return (
            self._comparable
            and all(map(is_, map(sink.tensors.get, self._names), self._objects))
            and self._kept.same_shapes_and_dtypes(tensors)
            and self._kept.same_memory(tensors)
        )

    def remember(self, same: tuple, equal: tuple, checked: Any, names: list[str], objects: list[Any]) -> None:
        """`checked` is what the receiver made of the sink's answers `objects` (one per name
        in `names`, the sync's order) under `same` and `equal`."""
        self._same, self._equal, self._checked, self._names, self._objects = same, equal, checked, names, objects
        tensors = [o for o in objects if o is not None]
        self._comparable = set(map(type, tensors)) <= PLAIN  # a subclass may have no address to compare
        self._tensors = tensors if self._comparable else []
        self._kept = Snapshot(self._tensors, memory=True)

    def forget(self) -> None:
        self._compared: Any = None  # the sink `precheck` found unchanged, for the next `recall`
        self._same: tuple = ()
        self._equal: tuple = ()
        self._checked: Any = None
        self._names: list[str] = []
        self._objects: list[Any] = []
        self._comparable = False
        self._tensors: list[torch.Tensor] = []
        self._kept = Snapshot()


class KnownDeclaration:
    """A trainer rank's memory of what it declared in the last M-to-N sync (hal.sync.send.sharded):
    the listing of its source's local tensors and the declaration made from it. The same
    tensor objects with the same global shapes, dtypes and placements are the same
    declaration, so the same digest and plan: no declaration per tensor, no encoding of it.
    Their bytes are read every sync from the objects themselves (a local shard whose memory
    was replaced in place is read where it is now)."""

    def __init__(self) -> None:
        self.listing: Listing | None = None
        self.declared: list | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self._kept = Snapshot()
        self._placed: list[torch.Tensor] = []  # the distributed tensors: their placements and meshes
        self._placements: list[Any] = []
        self._meshes: list[Any] = []

    def recall(self, listing: Listing) -> list | None:
        """The last declaration when `listing` holds the same tensors, as they were; else None."""
        last = self.listing
        if last is None:
            return None
        if not same_listing(listing, last):
            return None
        placed = self._placed
        if not (
            self._kept.same_shapes_and_dtypes(listing.tensors)
            and all(map(is_, map(_placements, placed), self._placements))
            and all(map(is_, map(_mesh, placed), self._meshes))
        ):
            return None
        self.listing = listing
        return self.declared

    def remember(self, listing: Listing, declared: list) -> None:
        self.listing, self.declared = listing, declared
        self.tensors = dict(zip(listing.names, listing.tensors))
        self._kept = Snapshot(listing.tensors)
        self._placed = [t for t in listing.tensors if type(t) not in PLAIN and hasattr(t, "placements")]
        self._placements = list(map(_placements, self._placed))
        self._meshes = list(map(_mesh, self._placed))

    def forget(self) -> None:
        self.__init__()


_placements, _mesh = attrgetter("placements"), attrgetter("device_mesh")
