"""How the engine workers' needs reach the trainer ranks, and whether a sync is received
whole or in shards (issue 41).

`receive` (`RECEIVE`) says how engine workers take a sync:

- "whole": every worker receives every tensor whole (a broadcast, or IPC) and its engine's
  loaders cut out what it holds: what every sync did before issue 41;
- "shard": each worker receives only its own pieces (hal.sync.send.links,
  hal.sync.receive.links), landed straight in its layers; refused at init, by name, when
  a worker's loaders could not be recorded;
- "auto": "shard" where every worker recorded its needs, "whole" otherwise (saying why once).

At init, with "shard" or "auto", each worker records its needs (hal.sync.plan.needs: for
vLLM, hal.integrations.vllm.recording), or the reason it cannot, and every rank of every
sync group gathers every worker's word (`exchange_needs`: JSON of ints, never pickled; the
same bytes in each trainer rank's group, so every trainer rank has all of them). Every
rank then decides alike (`choose_receive`). A trainer rank then builds the M x N plan of
each sync from what it sends and those needs (`LinkPlans`, kept per layout); a worker
needs only its own record (it reads its links from the headers:
hal.sync.plan.link_specs.links_from_headers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hal.sync import errors
from hal.sync.config import wire_dtype_for
from hal.sync.plan.declare import declared_digest
from hal.sync.plan.mxn import MxNPlan, build_mxn_plan
from hal.sync.plan.needs import UnexpressibleLoad, WorkerNeeds, decode_needs, encode_needs
from hal.sync.plan.shards import WHOLE, Declared, ShardPlan, build_shard_plan
from hal.sync.spec import TensorSpec

AUTO, SHARD, WHOLE_TENSORS = "auto", "shard", "whole"
RECEIVE = (AUTO, SHARD, WHOLE_TENSORS)
"""How engine workers take a sync (the module doc)."""

MAX_NEEDS_BYTES = 1 << 28  # one worker's record: DeepSeek-V3's 91k tensors take a few MB
_RECORDED, _REFUSED = b"N", b"R"


def check_receive(receive: str, where: str) -> str:
    if receive not in RECEIVE:
        raise ValueError(f"{where} must be one of {', '.join(repr(r) for r in RECEIVE)}, got {receive!r}")
    return receive


def needs_payload(record: WorkerNeeds | str) -> bytes:
    """What a worker tells every trainer rank at init: its recorded needs, or why it has none."""
    if isinstance(record, WorkerNeeds):
        return _RECORDED + encode_needs(record)
    return _REFUSED + str(record).encode()


def read_payloads(payloads: Sequence[bytes]) -> list[WorkerNeeds | str]:
    """Every worker's word (index = the worker): its needs, or the reason it has none.
    `HeaderError` naming a worker whose bytes cannot be read, or who claims another index."""
    out: list[WorkerNeeds | str] = []
    known: tuple[TensorSpec, ...] | None = None
    for w, payload in enumerate(payloads):
        tag, body = payload[:1], payload[1:]
        if tag == _REFUSED:
            out.append(body.decode(errors="replace"))
            continue
        if tag != _RECORDED:
            raise errors.HeaderError(f"engine worker {w}: its word on its needs is unreadable ({len(payload)} bytes, tag {tag!r})")
        record = decode_needs(body, known)
        if record.worker != w:
            raise errors.HeaderError(f"engine worker {w} sent the needs of engine worker {record.worker}")
        known = record.specs
        out.append(record)
    return out


def exchange_needs(channel: object, payload: bytes, *, workers_from: int = 1) -> list[bytes]:
    """Every rank of one sync group gathers every worker's word (`channel`: a
    `GroupChannel` of the group, its sender at rank 0 giving `b""`); the words of ranks
    `workers_from`.. in rank order. Bounded by the caller (`channel.bounded`)."""
    gathered = channel.all_gather_bytes(payload, "engine workers' needs", limit=MAX_NEEDS_BYTES)  # type: ignore[attr-defined]
    return gathered[workers_from:]


@dataclass(frozen=True, slots=True)
class ReceiveChoice:
    """What every rank decided at init: shard receive with these needs, or whole and why."""

    shard: bool
    needs: tuple[WorkerNeeds, ...] = ()
    why: str = ""


def choose_receive(receive: str, words: Sequence[WorkerNeeds | str]) -> ReceiveChoice:
    """The same decision on every rank from every worker's word (`read_payloads`):
    "shard" refuses (`UnexpressibleLoad`, naming each worker's reason) when a worker has
    no record; "auto" then receives whole."""
    check_receive(receive, "receive")
    if receive == WHOLE_TENSORS:
        return ReceiveChoice(False, why="receive='whole'")
    refused = [f"engine worker {w}: {word}" for w, word in enumerate(words) if isinstance(word, str)]
    if refused:
        why = "; ".join(refused[: errors.MAX_REPORTED]) + (f" (+{len(refused) - errors.MAX_REPORTED} more)" if len(refused) > errors.MAX_REPORTED else "")
        if receive == SHARD:
            raise UnexpressibleLoad(f"receive='shard': {why}")
        return ReceiveChoice(False, why=why)
    if not words:
        return ReceiveChoice(False, why="no engine worker")
    specs = words[0].specs
    other = next((w for w, word in enumerate(words) if word.specs != specs), None)
    if other is not None:
        raise errors.SpecMismatchError(f"engine workers 0 and {other} recorded their needs against different checkpoints")
    return ReceiveChoice(True, tuple(words))  # type: ignore[arg-type]


def whole_holdings(specs: Sequence[TensorSpec]) -> ShardPlan:
    """The holdings of one trainer rank that sends every tensor whole ("one", "gather")."""
    declared = [Declared(s.name, tuple(s.shape), s.dtype, WHOLE) for s in specs]
    return build_shard_plan([declared], (declared_digest(declared),))


class LinkPlans:
    """A trainer rank's M x N plans into the workers of `needs`, the last one kept while the
    holdings are the same (by their digests, or the same `ShardPlan` object), and after a
    plan that could not be built (a refusal is announced on the last plan's links)."""

    def __init__(self, needs: Sequence[WorkerNeeds], wire_dtype: torch.dtype | None = None) -> None:
        self.needs = tuple(needs)
        self.wire_dtype = wire_dtype
        self.builds = 0
        self._kept: tuple[object, MxNPlan] | None = None

    @property
    def last(self) -> MxNPlan | None:
        """The plan built last (None before the first)."""
        return None if self._kept is None else self._kept[1]

    def plan(self, holdings: ShardPlan) -> MxNPlan:
        """The plan of `holdings` into the workers; `SpecMismatchError` naming each tensor
        whose dtype on the wire (the trainer's, cast by `wire_dtype`) is not the one the
        workers recorded, or which does not fit (`build_mxn_plan`)."""
        key: object = holdings.digests if holdings.digests else id(holdings)
        if self._kept is not None and (self._kept[0] == key or self._kept[1].holdings is holdings):
            return self._kept[1]
        want = {s.name: s.dtype for s in self.needs[0].specs}
        problems = [
            f"parameter {s.name!r}: the trainer sends it as {wire_dtype_for(s.dtype, self.wire_dtype)} "
            f"({s.dtype}, SyncConfig.wire_dtype {self.wire_dtype}), the engine's workers receive {want[s.name]}"
            for s in holdings.specs if s.name in want and wire_dtype_for(s.dtype, self.wire_dtype) != want[s.name]
        ]
        errors.refuse_specs(problems)
        plan = build_mxn_plan(holdings, self.needs)
        self._kept, self.builds = (key, plan), self.builds + 1
        return plan
