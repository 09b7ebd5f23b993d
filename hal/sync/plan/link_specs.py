"""What one link of an M x N plan carries as a sync of the core: its pieces as wire tensors.

A link (sender r -> worker w, hal.sync.plan.mxn) travels as one sync of the core whose
tensors are its pieces, in the link's order: each named `shard_name(tensor, corner)`
(`"<name>@<o0>:<o1>"`, hal.sync.plan.shards), the piece's box as its shape, its tensor's wire
dtype. A worker whose needs hold one box of a tensor twice (a tied embedding loaded into
two parameters) receives it once per need: those names also carry the need's index
(`"...#<need>"`). The sender and the worker both derive these specs from the plan (the
sender to announce them, the worker to check that the header announces exactly them, in
order), so that a header that differs says the two built different plans. An engine
worker, which does not hold what every trainer rank holds, reads its links from the
headers instead (`links_from_headers`) and checks that they bring it exactly its needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from hal.sync import errors
from hal.sync.plan.mxn import MxNPlan, Piece
from hal.sync.plan.needs import Need, WorkerNeeds, box_text
from hal.sync.plan.shards import parse_block_name, shard_name, tiling_problem
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


def links_from_headers(needs: WorkerNeeds, headers: Sequence[tuple[TensorSpec, ...]]) -> list[LinkSpecs]:
    """This worker's links as the trainer ranks' headers announce them (`headers[r]`: the
    wire tensors of rank r's link to it), checked against its own `needs`: each piece a box
    of a checkpoint tensor of its wire dtype, inside exactly one of the worker's needs (or
    the one its name gives), and every need covered by the pieces of all the links exactly
    once. A worker checks this instead of building the whole M x N plan, which needs what
    every trainer rank holds; what reaches it is all the landing needs to know.
    `SpecMismatchError` naming each problem (the parameter, the box, the ranks)."""
    index = {spec.name: i for i, spec in enumerate(needs.specs)}
    of_tensor: dict[int, list[int]] = {}
    for k, need in enumerate(needs.needs):
        of_tensor.setdefault(need.tensor, []).append(k)
    problems: list[str] = []
    landed: dict[int, list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = {}
    links = []
    for sender, specs in enumerate(headers):
        pieces = []
        for spec in specs:
            piece = _piece_of(spec, sender, needs, index, of_tensor, problems)
            if piece is None:
                continue
            pieces.append(piece)
            landed.setdefault(piece.need, []).append((sender, piece.offsets, piece.sizes))
        links.append(LinkSpecs(sender, needs.worker, tuple(pieces), tuple(specs), sum(s.nbytes for s in specs)))
    for k, need in enumerate(needs.needs):
        if not need.numel:
            continue
        boxes = landed.get(k, [])
        relative = [(tuple(o - b for o, b in zip(offsets, need.offsets)), sizes) for _, offsets, sizes in boxes]
        problem = tiling_problem(need.sizes, relative, "sent") if boxes else None
        if problem is not None or not boxes:
            name, senders = needs.specs[need.tensor].name, sorted({s for s, _, _ in boxes})
            what = f"relative to that box, {problem} (sent by trainer rank(s) {senders})" if boxes else "no trainer rank sends any of it"
            problems.append(f"parameter {name!r}: engine worker {needs.worker} needs {box_text(need.offsets, need.sizes)}; {what}")
    errors.refuse_specs(problems, "the trainer ranks' links do not bring this engine worker exactly its needs: ")
    return links


def _piece_of(spec: TensorSpec, sender: int, needs: WorkerNeeds, index: dict[str, int], of_tensor: dict[int, list[int]], problems: list[str]) -> Piece | None:
    """The piece a wire tensor announces, or None with its problem appended."""
    base, mark, hint = spec.name.rpartition("#")
    if not mark:
        base, hint = spec.name, ""
    elif not hint.isdigit():
        problems.append(f"trainer rank {sender} announces {spec.name!r}, which is no piece's name")
        return None
    try:
        name, corner = parse_block_name(base)
    except ValueError as exc:
        problems.append(f"trainer rank {sender}: {exc}")
        return None
    t = index.get(name)
    if t is None:
        problems.append(f"parameter {name!r}: trainer rank {sender} sends a piece of it, which this engine worker's checkpoint does not hold")
        return None
    whole = needs.specs[t]
    ndim = len(whole.shape)
    offsets = corner[:ndim] + (0,) * (ndim - len(corner))
    if len(spec.shape) != ndim or len(corner) > max(ndim, 1) or spec.dtype != whole.dtype or any(
        o + n > d for o, n, d in zip(offsets, spec.shape, whole.shape)
    ):
        problems.append(
            f"parameter {name!r}: trainer rank {sender} sends {list(spec.shape)} {spec.dtype} at {list(offsets)}, "
            f"which does not fit its {list(whole.shape)} {whole.dtype}"
        )
        return None
    sizes = tuple(spec.shape)
    inside = [k for k in of_tensor.get(t, ()) if _contains(needs.needs[k], offsets, sizes)]
    if hint:
        k = int(hint)
        if k not in inside:
            problems.append(f"parameter {name!r}: trainer rank {sender} sends {box_text(offsets, sizes)} for need {k}, which does not hold it")
            return None
    elif len(inside) == 1:
        k = inside[0]
    else:
        what = "no box this engine worker needs" if not inside else f"inside {len(inside)} of its needs and does not say which"
        problems.append(f"parameter {name!r}: trainer rank {sender} sends {box_text(offsets, sizes)}, {what}")
        return None
    return Piece(t, offsets, sizes, -1, k)


def _contains(need: Need, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
    return all(b <= o and o + s <= b + n for o, s, b, n in zip(offsets, sizes, need.offsets, need.sizes))
