"""Which trainer rank sends which rows of which tensor: the plan of an M-to-N sync.

Every trainer rank declares what it holds, from metadata alone (no gather): per tensor
its global shape, dtype and how it holds it,

- `shard0`: an FSDP2 / DTensor `Shard(0)` over the trainer group: rank i holds the rows
  `torch.chunk` gives it (ceil(n / M) rows each, the last ones possibly fewer or none);
- `whole`: the whole tensor (a plain tensor, or a DTensor `Replicate()`). Held by several
  ranks it is replicated there, and they split its rows between them the same way, so
  that each sends a share; held by one rank (a pipeline stage's layers) that rank sends it.

A 0-d tensor, and an empty one (no elements, whatever its rows), goes whole from one of
its holders.

The ranks exchange their declarations once per layout (a digest each sync, the
declarations themselves only when a digest changed) and every rank builds the same
`ShardPlan`: per trainer rank, the row ranges it sends, in one global order. A
declaration that does not fit the others (another shape or dtype, `shard0` missing on a
rank) is refused on every rank with an error naming the parameter and the ranks.

On the wire, each rank's share of a tensor is a tensor of its own named
`"<name>@<first row>"` (`shard_name`), so the sync core carries it unchanged and each
receiver knows from the header alone where the rows go (`parse_shard_name`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from hal.sync import errors
from hal.sync.header_json import WIRE_DTYPES, dtype_from_name, dtype_name
from hal.sync.plan import TensorSpec
from hal.sync.protocol import GroupChannel

SHARD0, WHOLE = "shard0", "whole"
_TRAVELS = frozenset(WIRE_DTYPES.values())


def shard_name(name: str, first_row: int) -> str:
    return f"{name}@{first_row}"


def parse_shard_name(wire_name: str) -> tuple[str, int]:
    """(the tensor's name, its first row) of a share's wire name; ValueError if it is none."""
    name, at, row = wire_name.rpartition("@")
    if not at or not name or not row.isdigit() or (len(row) > 1 and row[0] == "0"):
        raise ValueError(f"{wire_name!r} is not a share's name (<name>@<first row>)")
    return name, int(row)


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
    kind: str  # SHARD0 or WHOLE


def declare(named: Iterable[tuple[str, torch.Tensor]], rank: int, world_size: int) -> list[Declared]:
    """What this rank holds, from each tensor's metadata (a DTensor's placements)."""
    out: list[Declared] = []
    dtensor = _dtensor_types()
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"parameter {name!r}: a {type(tensor).__name__}, not a tensor")
        kind = WHOLE
        if dtensor is not None and isinstance(tensor, dtensor[0]):
            kind = _dtensor_kind(name, tensor, rank, world_size, dtensor)
        if tensor.dtype not in _TRAVELS:  # refused here, on every rank, by name
            raise ValueError(f"parameter {name!r}: dtype {tensor.dtype} cannot travel in a sync; supported: {', '.join(WIRE_DTYPES)}")
        out.append(Declared(name, tuple(tensor.shape), tensor.dtype, kind))
    return out


def _dtensor_types() -> tuple[type, type, type] | None:
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # a torch without distributed tensors: only plain tensors exist
        return None
    return DTensor, Shard, Replicate


def _dtensor_kind(name: str, tensor: Any, rank: int, world_size: int, types: tuple[type, type, type]) -> str:
    _, shard, replicate = types
    placements = tuple(tensor.placements)
    mesh = tensor.device_mesh
    if len(placements) != 1:
        raise ValueError(
            f"parameter {name!r}: placements {placements} over a {mesh.ndim}-d mesh; a sharded sync takes a 1-d mesh "
            "of the trainer group (FSDP2's fully_shard over that group)"
        )
    placement = placements[0]
    if isinstance(placement, replicate):
        return WHOLE
    if type(placement) is not shard or placement.dim != 0:
        raise ValueError(f"parameter {name!r}: placement {placement!r} is not supported: a sharded sync takes Shard(0) or Replicate()")
    if mesh.size() != world_size or mesh.get_local_rank() != rank:
        raise ValueError(
            f"parameter {name!r}: sharded over a mesh of {mesh.size()} ranks where this is rank {mesh.get_local_rank()}, "
            f"but the trainer group has {world_size} ranks and this is rank {rank}: shard it over the trainer group"
        )
    return SHARD0


def encode_declared(declared: list[Declared]) -> bytes:
    rows = [[d.name, list(d.shape), dtype_name(d.dtype), d.kind] for d in declared]
    return json.dumps(rows, separators=(",", ":")).encode()


def decode_declared(payload: bytes, rank: int) -> list[Declared]:
    """Another trainer rank's declaration (JSON, never pickled)."""
    try:
        rows = json.loads(payload)
        out = []
        for name, shape, dtype, kind in rows:
            if kind not in (SHARD0, WHOLE):
                raise ValueError(f"kind {kind!r}")
            out.append(Declared(str(name), tuple(int(d) for d in shape), dtype_from_name(dtype), kind))
        return out
    except (ValueError, TypeError, AttributeError) as exc:
        raise errors.HeaderError(f"trainer rank {rank}'s declaration of its tensors is unreadable: {exc}") from None


def declared_digest(declared: list[Declared]) -> int:
    return int.from_bytes(hashlib.sha256(encode_declared(declared)).digest()[:8], "little") >> 1


@dataclass(frozen=True, slots=True)
class Share:
    """Rows [lo, hi) of one tensor, sent by one trainer rank as its own wire tensor."""

    spec: TensorSpec  # the whole tensor
    lo: int
    hi: int
    wire: TensorSpec  # the share as it travels (name `shard_name(spec.name, lo)`)


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Every trainer rank's shares, in one global order (the same on every rank)."""

    specs: tuple[TensorSpec, ...]  # the whole tensors, in order
    shares: tuple[tuple[Share, ...], ...]  # per trainer rank
    kinds: tuple[str, ...]  # per tensor, SHARD0 or WHOLE, as declared
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
        specs.append(spec)
        kinds.append(first.kind)
        ranks = [r for r, _ in holders]
        rows = rows_of(spec.shape)
        if not spec.shape or spec.numel == 0:
            # nothing to split: one holder sends it whole (an empty one as zero bytes of its
            # global shape, never its local shard's: FSDP2 and DTensor give it other shapes)
            owner = ranks[index % len(ranks)]
            shares[owner].append(Share(spec, 0, rows, TensorSpec(shard_name(name, 0), spec.shape, spec.dtype)))
            continue
        for part, rank in enumerate(ranks):
            lo, hi = chunk_rows(rows, len(ranks), part)
            if hi > lo:
                wire = TensorSpec(shard_name(name, lo), (hi - lo, *spec.shape[1:]), spec.dtype)
                shares[rank].append(Share(spec, lo, hi, wire))
    errors.refuse_specs(problems, "trainer ranks disagree on the layout: ")
    return ShardPlan(tuple(specs), tuple(tuple(s) for s in shares), tuple(kinds), tuple(digests))


class ShardPlanExchange:
    """Agrees the `ShardPlan` over the trainer group: a digest per rank every sync (one
    small all-reduce), the declarations only when some digest changed."""

    def __init__(self, channel: GroupChannel) -> None:
        self.channel = channel
        self.plan: ShardPlan | None = None
        self.builds = 0

    def agree(self, declared: list[Declared] | BaseException) -> ShardPlan:
        """The plan every rank builds. `declared` an exception: this rank could not declare
        its tensors; then every rank raises the same `SpecMismatchError` naming each such
        rank and its error, at once rather than at the timeout."""
        channel = self.channel
        digests = torch.zeros(channel.world_size, dtype=torch.int64, device=channel.control_device)
        undeclared = isinstance(declared, BaseException)
        digests[channel.rank] = _UNDECLARED if undeclared else declared_digest(declared)
        channel.allreduce(digests, "layout digests")
        theirs = tuple(int(d) for d in digests.cpu().tolist())
        failed = [r for r, d in enumerate(theirs) if d == _UNDECLARED]
        if failed:  # only then do the messages travel
            own = errors.report_exception(declared, sender=True, keep_class=True) if undeclared else errors.RankReport(sender=True)
            reports = channel.agree(own, "layout declarations")
            why = "; ".join(f"trainer rank {r}: {reports[r].error}" for r in failed if reports[r].error)
            raise errors.SpecMismatchError(f"trainer rank(s) {failed} could not declare the tensors they hold: {why}")
        if self.plan is not None and self.plan.digests == theirs:
            return self.plan
        payloads = channel.all_gather_bytes(encode_declared(declared), "layout declarations")
        declarations = [declared if r == channel.rank else decode_declared(p, r) for r, p in enumerate(payloads)]
        self.plan = None
        plan = build_shard_plan(declarations, theirs)
        self.plan, self.builds = plan, self.builds + 1
        return plan


_UNDECLARED = -1  # a digest no declaration has (digests are non-negative)


def covering(shares: Iterable[tuple[TensorSpec, int, int]]) -> list[str]:
    """Problems with a set of shares (whole tensor, first row, end row): each tensor's rows
    must be covered exactly once. Empty when they are."""
    rows: dict[str, tuple[TensorSpec, list[tuple[int, int]]]] = {}
    for spec, lo, hi in shares:
        rows.setdefault(spec.name, (spec, []))[1].append((lo, hi))
    problems = []
    for name, (spec, ranges) in rows.items():
        ranges.sort()
        at = 0
        for lo, hi in ranges:
            if lo != at:
                problems.append(f"parameter {name!r}: rows {at}..{lo} {'missing' if lo > at else 'sent twice'}")
                break
            at = hi
        else:
            if at != rows_of(spec.shape):
                problems.append(f"parameter {name!r}: rows {at}..{rows_of(spec.shape)} missing")
    return problems


def row_bytes(spec: TensorSpec) -> int:
    """Bytes of one row (dim 0) of a contiguous tensor of `spec`."""
    return math.prod(spec.shape[1:]) * spec.dtype.itemsize if spec.shape else spec.nbytes
