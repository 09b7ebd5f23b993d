"""What each trainer rank holds, and how the ranks agree their plan from it.

`declare` reads each tensor's metadata (a DTensor's `Shard(d)` / `Replicate()`, a `Block` a
source hands over for a tensor-parallel shard no DTensor describes, a plain tensor) into a
`Declared` per tensor; a dtype that cannot travel is refused here, on every rank, by name.
`ShardPlanExchange` agrees the plan over the trainer group: a digest of each rank's
declaration every sync (one small all-reduce), the declarations themselves (JSON, never
pickled) only when a digest changed; every rank then builds the same `ShardPlan`
(hal.sync.plan.shards).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from hal.sync import errors
from hal.sync.wire.header_json import WIRE_DTYPES, dtype_from_name, dtype_name
from hal.sync.wire.channel import GroupChannel
from hal.sync.plan.shards import BLOCK, Declared, KINDS, SHARD0, ShardPlan, WHOLE, build_shard_plan, chunk_rows

_TRAVELS = frozenset(WIRE_DTYPES.values())


@dataclass(frozen=True, slots=True)
class Block:
    """A tensor this rank holds as a block of a larger one: `tensor` (its local values, of
    the block's shape) sits at `offsets` (one per dimension) in a tensor of `shape`. What a
    source hands a sharded sync for a tensor-parallel shard that no DTensor describes (a
    Megatron rank's column block of `o_proj`, its rows of `q_proj` cut out of a fused
    `linear_qkv`). Checked here: same dimensions, inside the tensor."""

    tensor: torch.Tensor
    shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        shape, offsets = tuple(int(d) for d in self.shape), tuple(int(o) for o in self.offsets)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "offsets", offsets)
        if not isinstance(self.tensor, torch.Tensor):
            raise TypeError(f"Block: a {type(self.tensor).__name__}, not a tensor")
        local = tuple(self.tensor.shape)
        if len(shape) != len(local) or len(offsets) != len(local) or any(
            o < 0 or o + n > d for o, n, d in zip(offsets, local, shape)
        ):
            raise ValueError(f"Block: a block of shape {local} at offsets {offsets} does not fit in a tensor of shape {shape}")

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype


def declare(named: Iterable[tuple[str, Any]], rank: int, world_size: int) -> list[Declared]:
    """What this rank holds, from each tensor's metadata (a DTensor's placements, a `Block`)."""
    out: list[Declared] = []
    dtensor = _dtensor_types()
    for name, tensor in named:
        if isinstance(tensor, Block):
            out.append(_travels(Declared(name, tensor.shape, tensor.dtype, BLOCK, tensor.offsets, tuple(tensor.tensor.shape))))
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"parameter {name!r}: a {type(tensor).__name__}, not a tensor")
        if dtensor is not None and isinstance(tensor, dtensor[0]):
            declared = _dtensor_declared(name, tensor, rank, world_size, dtensor)
        else:
            declared = Declared(name, tuple(tensor.shape), tensor.dtype, WHOLE)
        out.append(_travels(declared))
    return out


def _travels(declared: Declared) -> Declared:
    """`declared`, if its dtype can travel; refused here, on every rank, by name."""
    if declared.dtype not in _TRAVELS:
        raise ValueError(f"parameter {declared.name!r}: dtype {declared.dtype} cannot travel in a sync; supported: {', '.join(WIRE_DTYPES)}")
    return declared


def _dtensor_types() -> tuple[type, type, type] | None:
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # a torch without distributed tensors: only plain tensors exist
        return None
    return DTensor, Shard, Replicate


def _dtensor_declared(name: str, tensor: Any, rank: int, world_size: int, types: tuple[type, type, type]) -> Declared:
    _, shard, replicate = types
    placements = tuple(tensor.placements)
    mesh = tensor.device_mesh
    if len(placements) != 1:
        raise ValueError(
            f"parameter {name!r}: placements {placements} over a {mesh.ndim}-d mesh; a sharded sync takes a 1-d mesh "
            "of the trainer group (FSDP2's fully_shard over that group)"
        )
    placement = placements[0]
    shape = tuple(tensor.shape)
    if isinstance(placement, replicate):
        return Declared(name, shape, tensor.dtype, WHOLE)
    if type(placement) is not shard or not 0 <= placement.dim < len(shape):
        raise ValueError(f"parameter {name!r}: placement {placement!r} is not supported: a sharded sync takes Shard(d) or Replicate()")
    if mesh.size() != world_size or mesh.get_local_rank() != rank:
        raise ValueError(
            f"parameter {name!r}: sharded over a mesh of {mesh.size()} ranks where this is rank {mesh.get_local_rank()}, "
            f"but the trainer group has {world_size} ranks and this is rank {rank}: shard it over the trainer group"
        )
    if placement.dim == 0:
        return Declared(name, shape, tensor.dtype, SHARD0)
    # Shard(d), d > 0: the block torch.chunk gives this rank along d (columns of a matrix)
    lo, hi = chunk_rows(shape[placement.dim], world_size, rank)
    offsets = tuple(lo if i == placement.dim else 0 for i in range(len(shape)))
    block = tuple(hi - lo if i == placement.dim else n for i, n in enumerate(shape))
    return Declared(name, shape, tensor.dtype, BLOCK, offsets, block)


def encode_declared(declared: list[Declared]) -> bytes:
    rows = [
        [d.name, list(d.shape), dtype_name(d.dtype), d.kind] + ([list(d.offsets), list(d.block)] if d.kind == BLOCK else [])
        for d in declared
    ]
    return json.dumps(rows, separators=(",", ":")).encode()


def decode_declared(payload: bytes, rank: int) -> list[Declared]:
    """Another trainer rank's declaration (JSON, never pickled)."""
    try:
        rows = json.loads(payload)
        out = []
        for row in rows:
            name, shape, dtype, kind, *where = row
            if kind not in KINDS or len(where) != (2 if kind == BLOCK else 0):
                raise ValueError(f"kind {kind!r} or {len(where)} more fields")
            offsets, block = (tuple(int(d) for d in w) for w in where) if where else ((), ())
            out.append(Declared(str(name), tuple(int(d) for d in shape), dtype_from_name(dtype), kind, offsets, block))
        return out
    except (ValueError, TypeError, AttributeError) as exc:
        raise errors.HeaderError(f"trainer rank {rank}'s declaration of its tensors is unreadable: {exc}") from None


def declared_digest(declared: list[Declared]) -> int:
    return int.from_bytes(hashlib.sha256(encode_declared(declared)).digest()[:8], "little") >> 1


class ShardPlanExchange:
    """Agrees the `ShardPlan` over the trainer group: a digest per rank every sync (one
    small all-reduce), the declarations only when some digest changed."""

    def __init__(self, channel: GroupChannel) -> None:
        self.channel = channel
        self.plan: ShardPlan | None = None
        self.builds = 0
        self._digest_of: tuple[Any, int] = (None, 0)  # (a declaration, its digest)

    def agree(self, declared: list[Declared] | BaseException) -> ShardPlan:
        """The plan every rank builds. `declared` an exception: this rank could not declare
        its tensors; then every rank raises the same `SpecMismatchError` naming each such
        rank and its error, at once rather than at the timeout."""
        channel = self.channel
        digests = torch.zeros(channel.world_size, dtype=torch.int64, device=channel.control_device)
        undeclared = isinstance(declared, BaseException)
        if not undeclared and declared is not self._digest_of[0]:  # the same declaration: the same digest (hal.sync.plan.steady)
            self._digest_of = (declared, declared_digest(declared))
        digests[channel.rank] = _UNDECLARED if undeclared else self._digest_of[1]
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
