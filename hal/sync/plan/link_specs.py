"""What one link of an M x N plan carries as a sync of the core: its pieces as wire tensors.

A link (sender r -> worker w, hal.sync.plan.mxn) travels as one sync of the core whose
tensors are its pieces, in the link's order: each named `shard_name(tensor, corner)`
(`"<name>@<o0>:<o1>"`, hal.sync.plan.shards), the piece's box as its shape, its tensor's wire
dtype. A worker whose needs hold one box of a tensor twice (a tied embedding loaded into
two parameters) receives it once per need: those names also carry the need's index
(`"...#<need>"`). The sender and the worker both derive these specs from the plan (the
sender to announce them, the worker to check that the header announces exactly them, in
order), so that a header that differs says the two built different plans.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hal.sync.plan.mxn import MxNPlan, Piece
from hal.sync.plan.shards import shard_name
from hal.sync.spec import TensorSpec


def piece_name(name: str, offsets: tuple[int, ...], need: int | None = None) -> str:
    """A piece's wire name: its tensor's name and corner, and `need` when the link carries
    another piece at the same corner."""
    base = shard_name(name, offsets)
    return base if need is None else f"{base}#{need}"


@dataclass(frozen=True, eq=False)
class LinkSpecs:
    """One link's pieces and, per piece, its wire tensor (same order: the link's sync)."""

    sender: int
    worker: int
    pieces: tuple[Piece, ...]
    specs: tuple[TensorSpec, ...]
    nbytes: int
    _index: dict[str, int] = field(default_factory=dict, repr=False)

    def position(self, name: str) -> int:
        """The index of the piece a wire tensor of this link carries (KeyError if none)."""
        if not self._index:
            self._index.update((spec.name, i) for i, spec in enumerate(self.specs))
        return self._index[name]


def link_specs(plan: MxNPlan, sender: int, worker: int) -> LinkSpecs:
    """The wire tensors of the link from `sender` to `worker` (made on each call: keep it
    with the plan)."""
    link = plan.links[sender][worker]
    pieces = link.pieces
    corners: dict[tuple[int, tuple[int, ...]], int] = {}
    for piece in pieces:
        key = (piece.tensor, piece.offsets)
        corners[key] = corners.get(key, 0) + 1
    specs = tuple(
        TensorSpec(
            piece_name(plan.specs[p.tensor].name, p.offsets, p.need if corners[(p.tensor, p.offsets)] > 1 else None),
            p.sizes,
            plan.specs[p.tensor].dtype,
        )
        for p in pieces
    )
    return LinkSpecs(sender, worker, pieces, specs, link.nbytes)
