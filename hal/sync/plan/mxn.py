"""One plan for M senders and N workers: who sends which box of which tensor to whom.

The inputs are both metadata, both agreed by digest:

- the holdings: the trainer's `ShardPlan` (hal.sync.plan.shards): per trainer rank its
  shares, boxes that tile every tensor exactly once (FSDP2 rows, Megatron TP x PP blocks,
  the whole model for one sender);
- the needs: one `WorkerNeeds` per engine worker (hal.sync.plan.needs), recorded from the
  engine's own loaders: the boxes of each checkpoint tensor the worker takes in.

`build_mxn_plan` intersects them: each `Piece` is one need's box cut by one share, sent by
that share's owner to that need's worker, once. A box several workers need (a norm, the
router, a KV head that workers outnumber) is a piece for each of them. A `Link` is one
sender's pieces for one worker, in checkpoint order; `bytes_in[w]` is worker w's shard
plus what it shares, `bytes_out[r]` sender r's share times the workers that need it.

Checked, each refusal naming the tensor, the trainer ranks and the workers: every element
a worker needs is covered exactly once by the shares (a tensor no rank declares, or a
shape that differs, is refused before anything moves); a tensor declared and needed by no
worker is dropped and named (`MxNPlan.dropped`: vLLM ignores a tied `lm_head`).

Built in arrays (int64 torch columns joined on the tensor index; hal imports no numpy), so
that a model of 91k tensors plans in seconds; `Link.pieces` makes the Python objects of
one link when asked.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import math
from array import array
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence

import torch

from hal.sync import errors
from hal.sync.plan.needs import View, WorkerNeeds, box_text
from hal.sync.plan.shards import Share, ShardPlan
from hal.sync.spec import TensorSpec


class Piece(NamedTuple):
    """One box of one tensor on one link: `need` (an index into the worker's needs) cut by
    `share` (an index into the sender's shares). `MxNPlan.source` says where it is in the
    share, `MxNPlan.destination` where it lands. A named tuple: a plan makes hundreds of thousands."""

    tensor: int  # index into MxNPlan.specs
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    share: int
    need: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, slots=True)
class _Table:
    """The plan's pieces as columns, sorted by sender, then worker and need (each worker's
    needs are in checkpoint order), then the need's shares (by first row)."""

    sender: torch.Tensor
    worker: torch.Tensor
    tensor: torch.Tensor
    share: torch.Tensor
    need: torch.Tensor
    offsets: torch.Tensor  # [pieces, dims], dims past a tensor's own: 0
    sizes: torch.Tensor  # [pieces, dims], dims past a tensor's own: 1
    nbytes: torch.Tensor
    ndim: torch.Tensor  # the tensor's own number of dimensions


@dataclass(frozen=True, eq=False)
class Link:
    """Sender `sender`'s pieces for worker `worker`: `count` of them (rows `start`.. of the
    plan's table), `nbytes` at the wire dtypes."""

    sender: int
    worker: int
    nbytes: int
    count: int
    table: _Table
    start: int

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """The link's pieces, in the order of the worker's needs (checkpoint order), a need's
        pieces by their first row (made on each call: keep the result)."""
        rows = slice(self.start, self.start + self.count)
        t = self.table
        with no_collection():
            return tuple(
                Piece(tensor, tuple(o[:d]), tuple(s[:d]), share, need)
                for tensor, o, s, share, need, d in zip(
                    t.tensor[rows].tolist(), t.offsets[rows].tolist(), t.sizes[rows].tolist(),
                    t.share[rows].tolist(), t.need[rows].tolist(), t.ndim[rows].tolist(),
                )
            )


@dataclass(frozen=True, eq=False)
class MxNPlan:
    """Every sender's links to every worker, and what crosses each."""

    specs: tuple[TensorSpec, ...]  # the checkpoint's tensors (wire dtypes), as the workers recorded them
    holdings: ShardPlan
    needs: tuple[WorkerNeeds, ...]
    links: tuple[tuple[Link, ...], ...]  # [sender][worker]
    bytes_in: tuple[int, ...]  # per worker
    bytes_out: tuple[int, ...]  # per sender
    dropped: tuple[str, ...]  # declared by the trainer, needed by no worker
    digest: int
    table: _Table

    @property
    def largest_link(self) -> Link:
        return max((link for row in self.links for link in row), key=lambda link: link.nbytes)

    @property
    def pieces(self) -> int:
        return int(self.table.tensor.numel())

    @property
    def model_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def source(self, sender: int, piece: Piece) -> tuple[Share, tuple[slice, ...]]:
        """The share `piece` is cut from (the sender's wire tensor of it, as a trainer rank
        reads it today: hal.sync.send.sharded) and where in it: `share_tensor[index]`."""
        share = self.holdings.shares[sender][piece.share]
        return share, tuple(slice(o - s, o - s + n) for o, s, n in zip(piece.offsets, share.offsets, piece.sizes))

    def destination(self, worker: int, piece: Piece) -> tuple[int, View]:
        """Where `piece` lands on worker `worker`: the index of its target in the worker's
        `WorkerNeeds.targets`, and the region `target.as_strided(shape, strides, offset)`
        that takes the piece as it travels (checkpoint order, contiguous on the wire)."""
        need = self.needs[worker].needs[piece.need]
        return need.target, need.destination(piece.offsets, piece.sizes)


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """No cyclic garbage collection for the block (nested blocks leave it to the outermost):
    a plan makes hundreds of thousands of small acyclic objects, and the collector's passes
    over them cost more than making them (8x for a link's pieces of a 91k-tensor model)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def build_mxn_plan(holdings: ShardPlan, needs: Sequence[WorkerNeeds]) -> MxNPlan:
    """The plan of `holdings` (per trainer rank, what it sends) into `needs` (per worker,
    index = the worker), or `SpecMismatchError` naming what does not fit."""
    with no_collection():
        return _build(holdings, tuple(needs))


def _build(holdings: ShardPlan, needs: tuple[WorkerNeeds, ...]) -> MxNPlan:
    if not needs:
        raise ValueError("build_mxn_plan: no engine worker's needs")
    specs = needs[0].specs
    for w, record in enumerate(needs):
        if record.worker != w:
            raise ValueError(f"build_mxn_plan: the needs of engine worker {record.worker} are at index {w} (index = the worker)")
        if w and record.specs != specs:
            other = next((f"{a} vs {b}" for a, b in zip(specs, record.specs) if a != b), f"{len(specs)} vs {len(record.specs)} tensors")
            raise errors.SpecMismatchError(f"engine workers 0 and {w} recorded their needs against different checkpoints: {other}")
    index = {s.name: i for i, s in enumerate(specs)}
    senders, workers = len(holdings.shares), len(needs)
    problems = _shape_problems(holdings, specs, index)
    errors.refuse_specs(problems, "the trainer's tensors do not fit the engine's checkpoint: ")
    dims = max([len(s.shape) for s in specs] + [1])

    s_tensor, s_rank, s_index, s_lo, s_size = _share_columns(holdings, index, dims)
    n_tensor, n_worker, n_index, n_lo, n_size = _need_columns(needs, dims)

    # join on the tensor: each need meets the shares of its tensor that start before it ends
    # (dim 0); shares sorted by (tensor, first row), the rows ranked among their distinct
    # values so that the key cannot overflow whatever the sizes
    values0, rank = torch.unique(s_lo[:, 0], return_inverse=True)
    key = s_tensor * (len(values0) + 1) + rank
    key, order = torch.sort(key, stable=True)
    s_tensor, s_rank, s_index, s_lo, s_size = s_tensor[order], s_rank[order], s_index[order], s_lo[order], s_size[order]
    first = torch.searchsorted(s_tensor, n_tensor)
    upper = torch.searchsorted(key, n_tensor * (len(values0) + 1) + torch.searchsorted(values0, n_lo[:, 0] + n_size[:, 0]))
    count = (upper - first).clamp(min=0)
    pair_need = torch.repeat_interleave(torch.arange(len(n_tensor)), count)
    within = torch.arange(len(pair_need)) - torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
    pair_share = first[pair_need] + within
    lo = torch.maximum(n_lo[pair_need], s_lo[pair_share])
    hi = torch.minimum(n_lo[pair_need] + n_size[pair_need], s_lo[pair_share] + s_size[pair_share])
    keep = (hi > lo).all(dim=1)
    pair_need, pair_share, lo, size = pair_need[keep], pair_share[keep], lo[keep], (hi - lo)[keep]

    volume = size.prod(dim=1)
    covered = torch.zeros(len(n_tensor), dtype=torch.int64).scatter_add_(0, pair_need, volume)
    wanted = n_size.prod(dim=1)
    short = (covered != wanted).nonzero().flatten()
    if len(short):
        errors.refuse_specs(_uncovered(short.tolist(), n_tensor, n_worker, n_lo, n_size, covered, holdings, specs),
                            "what the engine's workers need is not sent exactly once by the trainer's ranks: ")

    itemsize = torch.tensor([s.dtype.itemsize for s in specs] or [1], dtype=torch.int64)
    ndim = torch.tensor([len(s.shape) for s in specs] or [0], dtype=torch.int64)
    tensor = n_tensor[pair_need]
    table = _sorted_table(s_rank[pair_share], n_worker[pair_need], tensor, s_index[pair_share], n_index[pair_need],
                          lo, size, volume * itemsize[tensor], ndim[tensor])
    link_id = table.sender * workers + table.worker
    counts = torch.bincount(link_id, minlength=senders * workers)
    nbytes = torch.zeros(senders * workers, dtype=torch.int64).scatter_add_(0, link_id, table.nbytes)
    starts = (torch.cumsum(counts, 0) - counts).tolist()
    counts_l, nbytes_l = counts.tolist(), nbytes.tolist()
    links = tuple(
        tuple(Link(r, w, nbytes_l[r * workers + w], counts_l[r * workers + w], table, starts[r * workers + w]) for w in range(workers))
        for r in range(senders)
    )
    needed = torch.zeros(len(specs) + 1, dtype=torch.bool)
    needed[n_tensor] = True
    flags = needed.tolist()
    dropped = tuple(s.name for s in holdings.specs if not flags[index.get(s.name, len(specs))])
    return MxNPlan(
        specs=specs, holdings=holdings, needs=needs, links=links,
        bytes_in=tuple(sum(links[r][w].nbytes for r in range(senders)) for w in range(workers)),
        bytes_out=tuple(sum(link.nbytes for link in links[r]) for r in range(senders)),
        dropped=dropped, digest=_digest(holdings, needs, s_tensor, s_rank, s_lo, s_size), table=table,
    )


def _shape_problems(holdings: ShardPlan, specs: tuple[TensorSpec, ...], index: dict[str, int]) -> list[str]:
    return [
        f"parameter {s.name!r}: the trainer ranks declare shape {s.shape}, the engine's checkpoint has {specs[index[s.name]].shape}"
        for s in holdings.specs if s.name in index and s.shape != specs[index[s.name]].shape
    ]


class _Columns:
    """Rows of (tensor, owner, index in the owner's list, box) gathered into int64 columns;
    boxes padded to `dims` dimensions (offset 0, size 1): C arrays, not Python lists."""

    def __init__(self, dims: int) -> None:
        self.dims = dims
        self.ints, self.lo, self.size = array("q"), array("q"), array("q")
        self.zeros = [(0,) * k for k in range(dims + 1)]
        self.ones = [(1,) * k for k in range(dims + 1)]

    def add(self, tensor: int, owner: int, which: int, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
        pad = self.dims - len(sizes)
        self.ints.extend((tensor, owner, which))
        self.lo.extend(offsets + self.zeros[pad])
        self.size.extend(sizes + self.ones[pad])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        ints = _int64(self.ints).reshape(-1, 3)
        return ints[:, 0].contiguous(), ints[:, 1].contiguous(), ints[:, 2].contiguous(), _int64(self.lo).reshape(-1, self.dims), _int64(self.size).reshape(-1, self.dims)


def _int64(values: array) -> torch.Tensor:
    return torch.frombuffer(values, dtype=torch.int64).clone() if len(values) else torch.zeros(0, dtype=torch.int64)


def _share_columns(holdings: ShardPlan, index: dict[str, int], dims: int) -> tuple[torch.Tensor, ...]:
    columns = _Columns(dims)
    ints, lo, size, zeros, ones, get = columns.ints.extend, columns.lo.extend, columns.size.extend, columns.zeros, columns.ones, index.get
    for r, shares in enumerate(holdings.shares):  # the one loop over every share of every rank: kept lean
        for j, share in enumerate(shares):
            t, wire = get(share.spec.name), share.wire
            if t is not None and wire.numel:  # else a tensor the engine does not load (dropped), or an empty one
                pad = dims - len(wire.shape)
                ints((t, r, j))
                lo(share.offsets + zeros[pad])
                size(wire.shape + ones[pad])
    return columns.tensors()


def _need_columns(needs: tuple[WorkerNeeds, ...], dims: int) -> tuple[torch.Tensor, ...]:
    columns = _Columns(dims)
    for w, record in enumerate(needs):
        for k, need in enumerate(record.needs):
            if need.numel:
                columns.add(need.tensor, w, k, need.offsets, need.sizes)
    return columns.tensors()


def _sorted_table(*columns: torch.Tensor) -> _Table:
    """The pairs come in (worker, need, share) order: one stable sort puts the sender first."""
    order = torch.sort(columns[0], stable=True).indices
    return _Table(*(column[order] for column in columns))


def _uncovered(short: list[int], n_tensor, n_worker, n_lo, n_size, covered, holdings: ShardPlan, specs) -> list[str]:
    """One line per needed box the shares do not cover exactly once (the workers that need
    it together): the box, how much is missing or sent twice, and which trainer ranks send
    which part of it, or declare the tensor at all."""
    boxes: dict[tuple[int, tuple[int, ...], tuple[int, ...]], tuple[list[int], int]] = {}
    for i in short:
        t = int(n_tensor[i])
        d = len(specs[t].shape)
        key = (t, tuple(n_lo[i, :d].tolist()), tuple(n_size[i, :d].tolist()))
        boxes.setdefault(key, ([], int(covered[i])))[0].append(int(n_worker[i]))
    lines = []
    for (t, lo, size), (workers, got) in list(boxes.items())[: errors.MAX_REPORTED + 1]:
        spec, want = specs[t], math.prod(size)
        holders, parts = set(), []
        for r, shares in enumerate(holdings.shares):
            for share in shares:
                if share.spec.name == spec.name:
                    holders.add(r)
                    if all(o < l + n and l < o + m for o, m, l, n in zip(share.offsets, share.wire.shape, lo, size)):
                        parts.append(f"rank {r} {box_text(share.offsets, share.wire.shape)}")
        how = f"{want - got} of its {want} elements are sent by no trainer rank" if got < want else "parts of it are sent twice"
        sent = f"sent: {', '.join(parts[:4])}{' ...' if len(parts) > 4 else ''}" if parts else (
            f"trainer rank(s) {sorted(holders)} declare it, none sends any of this box" if holders else "no trainer rank declares it")
        who = f"engine worker {workers[0]} needs" if len(workers) == 1 else f"engine workers {workers} need"
        lines.append(f"parameter {spec.name!r}: {who} {box_text(lo, size)}; {how} ({sent})")
    return lines


def _digest(holdings: ShardPlan, needs: tuple[WorkerNeeds, ...], *columns: torch.Tensor) -> int:
    """Of the needs' digests and the shares' columns (the holdings, also when built without digests)."""
    h = hashlib.sha256(repr((holdings.digests, [n.digest for n in needs])).encode())
    for column in columns:
        column = column.contiguous()
        h.update(ctypes.string_at(column.data_ptr(), column.nbytes) if column.numel() else b"")  # int64 bytes, no numpy
    return int.from_bytes(h.digest()[:8], "little") >> 1
