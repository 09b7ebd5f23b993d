"""Which trainer rank sends which rows of which tensor: the plan of an M-to-N sync.

Every trainer rank declares what it holds, from metadata alone (no gather): per tensor
its global shape, dtype and how it holds it,

- `shard0`: an FSDP2 / DTensor `Shard(0)` over the trainer group: rank i holds the rows
  `torch.chunk` gives it (ceil(n / M) rows each, the last ones possibly fewer or none);
- `whole`: the whole tensor (a plain tensor, or a DTensor `Replicate()`). Held by several
  ranks it is replicated there, and they split its rows between them the same way, so
  that each sends a share; held by one rank (a pipeline stage's layers) that rank sends it.
- `block`: a contiguous block of the tensor, at given offsets in every dimension (a
  `Block`: a tensor-parallel rank's column block of a row-parallel weight, its rows of a
  fused weight's part; a DTensor `Shard(d)` for d > 0 over the trainer group, the block
  `torch.chunk` gives the rank along d). The distinct blocks of a tensor must tile it
  exactly once; ranks declaring the same block hold replicas of it and split its rows
  between them, as replicated whole tensors do.

A 0-d tensor, and an empty one (no elements, whatever its rows), goes whole from one of
its holders.

The ranks exchange their declarations once per layout (a digest each sync, the
declarations themselves only when a digest changed) and every rank builds the same
`ShardPlan`: per trainer rank, the row ranges it sends, in one global order. A
declaration that does not fit the others (another shape or dtype, `shard0` missing on a
rank) is refused on every rank with an error naming the parameter and the ranks.

On the wire, each rank's share of a tensor is a tensor of its own named
`"<name>@<first row>"` (`shard_name`), or `"<name>@<o0>:<o1>..."` for a block that does
not start at column 0 (offsets up to the last non-zero one), so the sync core carries it
unchanged and each receiver knows from the header alone where the block goes
(`parse_block_name`); the wire tensor's shape is the block's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import torch

from hal.sync import errors
from hal.sync.spec import TensorSpec

SHARD0, WHOLE, BLOCK = "shard0", "whole", "block"
KINDS = (SHARD0, WHOLE, BLOCK)


def shard_name(name: str, first: int | tuple[int, ...]) -> str:
    """A share's wire name: `first` is its first row, or its offset in every dimension."""
    if isinstance(first, int):
        return f"{name}@{first}"
    offsets = list(first) or [0]
    while len(offsets) > 1 and offsets[-1] == 0:  # one spelling per block
        offsets.pop()
    return f"{name}@{':'.join(map(str, offsets))}"


def parse_block_name(wire_name: str) -> tuple[str, tuple[int, ...]]:
    """(the tensor's name, the block's offsets, at least one) of a share's wire name;
    ValueError if it is none, or not spelled as `shard_name` spells it."""
    name, at, where = wire_name.rpartition("@")
    parts = where.split(":")
    if (
        not at or not name
        or any(not p.isdigit() or (len(p) > 1 and p[0] == "0") for p in parts)
        or (len(parts) > 1 and parts[-1] == "0")
    ):
        raise ValueError(f"{wire_name!r} is not a share's name (<name>@<first row>[:<offset>...])")
    return name, tuple(int(p) for p in parts)


def rows_of(shape: tuple[int, ...]) -> int:
    """How many rows a tensor is split by (dim 0); a 0-d tensor is one row."""
    return shape[0] if shape else 1


def chunk_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """The rows `torch.chunk(t, parts)` (and FSDP2's `Shard(0)`) gives part `index`."""
    size = -(-rows // parts) if rows else 0
    lo = min(index * size, rows)
    return lo, min(lo + size, rows)


@dataclass(frozen=True, slots=True)
class Declared:
    """One tensor as one trainer rank holds it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # SHARD0, WHOLE or BLOCK
    offsets: tuple[int, ...] = ()  # BLOCK: where the rank's block starts, per dimension
    block: tuple[int, ...] = ()  # BLOCK: the block's shape


@dataclass(frozen=True, slots=True)
class Share:
    """A block of one tensor (rows [lo, hi) of it, or a block at `offsets` in every
    dimension), sent by one trainer rank as its own wire tensor."""

    spec: TensorSpec  # the whole tensor
    offsets: tuple[int, ...]  # where the share starts, per dimension (() for a 0-d tensor)
    wire: TensorSpec  # the share as it travels (name `shard_name(spec.name, offsets)`, the block's shape)
    held: tuple[int, ...] = ()  # where the sending rank's local tensor starts in the whole (() : at 0)

    @property
    def lo(self) -> int:
        """The share's first row."""
        return self.offsets[0] if self.offsets else 0

    @property
    def hi(self) -> int:
        """One past the share's last row."""
        return self.lo + rows_of(self.wire.shape)

    def local_index(self) -> tuple[slice, ...]:
        """Where the share is in the sending rank's local tensor (which starts at `held`)."""
        held = self.held or (0,) * len(self.offsets)
        return tuple(slice(o - h, o - h + n) for o, h, n in zip(self.offsets, held, self.wire.shape))


def _row_share(spec: TensorSpec, lo: int, hi: int, held: tuple[int, ...] = ()) -> Share:
    offsets = (lo, *(0,) * (len(spec.shape) - 1)) if spec.shape else ()
    return Share(spec, offsets, TensorSpec(shard_name(spec.name, lo), (hi - lo, *spec.shape[1:]) if spec.shape else (), spec.dtype), held)


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Every trainer rank's shares, in one global order (the same on every rank)."""

    specs: tuple[TensorSpec, ...]  # the whole tensors, in order
    shares: tuple[tuple[Share, ...], ...]  # per trainer rank
    kinds: tuple[str, ...]  # per tensor, SHARD0, WHOLE or BLOCK, as declared
    digests: tuple[int, ...] = field(compare=False)  # the declarations it was built from

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def bytes_of(self, rank: int) -> int:
        """What trainer rank `rank` sends per sync."""
        return sum(share.wire.nbytes for share in self.shares[rank])


def build_shard_plan(declarations: list[list[Declared]], digests: tuple[int, ...] = ()) -> ShardPlan:
    """The plan from every rank's declaration (index = trainer rank); refuses what does not fit."""
    world = len(declarations)
    order: list[str] = []
    held: dict[str, list[tuple[int, Declared]]] = {}
    for rank, declared in enumerate(declarations):
        seen: set[str] = set()
        for d in declared:
            if d.name in seen:
                raise errors.SpecMismatchError(f"parameter {d.name!r} is declared twice by trainer rank {rank}")
            seen.add(d.name)
            if d.name not in held:
                order.append(d.name)
                held[d.name] = []
            held[d.name].append((rank, d))
    problems: list[str] = []
    specs: list[TensorSpec] = []
    kinds: list[str] = []
    shares: list[list[Share]] = [[] for _ in range(world)]
    for index, name in enumerate(order):
        holders = held[name]
        first_rank, first = holders[0]
        other = [(r, d) for r, d in holders[1:] if (d.shape, d.dtype, d.kind) != (first.shape, first.dtype, first.kind)]
        if other:
            r, d = other[0]
            problems.append(
                f"parameter {name!r}: trainer rank {first_rank} holds {first.kind} {first.shape} {first.dtype}, "
                f"rank {r} holds {d.kind} {d.shape} {d.dtype}"
            )
            continue
        if first.kind == SHARD0 and len(holders) != world:
            missing = sorted(set(range(world)) - {r for r, _ in holders})
            problems.append(f"parameter {name!r}: sharded over the trainer group but not declared by trainer rank(s) {missing}")
            continue
        spec = TensorSpec(name, first.shape, first.dtype)
        ranks = [r for r, _ in holders]
        rows = rows_of(spec.shape)
        if not spec.shape or spec.numel == 0:
            # nothing to split: one holder sends it whole (an empty one as zero bytes of its
            # global shape, never its local shard's: FSDP2 and DTensor give it other shapes)
            owner = ranks[index % len(ranks)]
            shares[owner].append(_row_share(spec, 0, rows))
        elif first.kind == BLOCK:
            problem = _block_shares(spec, holders, shares)
            if problem is not None:
                problems.append(problem)
                continue
        else:
            for part, rank in enumerate(ranks):
                lo, hi = chunk_rows(rows, len(ranks), part)
                if hi > lo:
                    shares[rank].append(_row_share(spec, lo, hi))
        specs.append(spec)
        kinds.append(first.kind)
    errors.refuse_specs(problems, "trainer ranks disagree on the layout: ")
    return ShardPlan(tuple(specs), tuple(tuple(s) for s in shares), tuple(kinds), tuple(digests))


def _block_shares(spec: TensorSpec, holders: list[tuple[int, Declared]], shares: list[list[Share]]) -> str | None:
    """Each holder's shares of a tensor declared as blocks (added to `shares`), or the
    problem with the blocks: they must tile the tensor exactly once. Ranks that declare
    the same block are its replicas and split its rows (`chunk_rows`)."""
    replicas: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for rank, d in holders:
        replicas.setdefault((d.offsets, d.block), []).append(rank)
    problem = tiling_problem(spec.shape, [(o, b) for o, b in replicas], "declared")
    if problem is not None:
        held = "; ".join(f"ranks {r} the block at {o} of {b}" for (o, b), r in replicas.items())
        return f"parameter {spec.name!r}: the blocks declared do not tile {spec.shape} exactly once: {problem} ({held})"
    new: list[tuple[int, Share]] = []
    for (offsets, block), ranks in replicas.items():
        if not math.prod(block):
            continue
        for part, rank in enumerate(ranks):
            lo, hi = chunk_rows(block[0], len(ranks), part)
            if hi > lo:
                at = (offsets[0] + lo, *offsets[1:])
                wire = TensorSpec(shard_name(spec.name, at), (hi - lo, *block[1:]), spec.dtype)
                new.append((rank, Share(spec, at, wire, offsets)))
    for rank, share in sorted(new, key=lambda item: item[1].offsets):  # one order on every rank: by place
        shares[rank].append(share)
    return None


def covering_blocks(shares: Iterable[tuple[TensorSpec, tuple[int, ...], tuple[int, ...]]]) -> list[str]:
    """Problems with a set of shares (whole tensor, offsets, the block's shape): each
    tensor must be covered exactly once. Empty when it is."""
    blocks: dict[str, tuple[TensorSpec, list[tuple[tuple[int, ...], tuple[int, ...]]]]] = {}
    for spec, offsets, sizes in shares:
        blocks.setdefault(spec.name, (spec, []))[1].append((tuple(offsets), tuple(sizes)))
    problems = []
    for name, (spec, boxes) in blocks.items():
        problem = tiling_problem(spec.shape, boxes, "sent")
        if problem is not None:
            problems.append(f"parameter {name!r}: {problem}")
    return problems


def tiling_problem(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], verb: str) -> str | None:
    """What is wrong with `boxes` (offsets, sizes) as a tiling of a tensor of `shape`
    (each element exactly once), or None. Row blocks (whole in every other dimension, as
    every FSDP2 share is) are checked as row ranges and named so; others as boxes."""
    if not shape:
        boxes = [((0,), (1,)) for o, n in boxes]  # a 0-d tensor: one row
        shape = (1,)
    for offsets, sizes in boxes:
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
            o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)
        ):
            return f"a block of {sizes} at {offsets} does not fit in {shape}"
    if math.prod(shape):  # an empty block covers nothing (an empty tensor's one share covers it all)
        boxes = [box for box in boxes if math.prod(box[1])]
    if all(sizes[1:] == shape[1:] for _, sizes in boxes):
        at = 0
        for lo, hi in sorted((o[0], o[0] + n[0]) for o, n in boxes):
            if lo != at:
                return f"rows {at}..{lo} {'missing' if lo > at else verb + ' twice'}"
            at = hi
        return None if at == shape[0] else f"rows {at}..{shape[0]} missing"
    full = [b for b in sorted(boxes) if math.prod(b[1])]
    for i, (a, an) in enumerate(full):
        for b, bn in full[i + 1 :]:
            if all(x < y + m and y < x + n for x, n, y, m in zip(a, an, b, bn)):
                return f"the blocks at {a} of {an} and at {b} of {bn} overlap ({verb} twice)"
    covered = sum(math.prod(n) for _, n in full)
    total = math.prod(shape)
    return None if covered == total else f"{total - covered} of {total} elements missing"
