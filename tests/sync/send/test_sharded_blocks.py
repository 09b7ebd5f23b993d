"""Column shares and general blocks, end to end: two trainer ranks send the blocks they hold,
bit for bit, into one engine worker, each sending exactly its blocks' bytes.

Three spawned processes on gloo: trainer ranks 0 and 1 (one trainer group), each with a
sync group of its own with engine worker 2. What the ranks hold, as a tensor-parallel
trainer holds it (no Megatron here: the plan and the wire know blocks, not Megatron):

- `col`: a DTensor `Shard(1)` over the trainer group, 5 columns (3 and 2);
- `o`: a plain `Block` of columns per rank (a row-parallel weight), 4 and 2 columns;
- `q`: a `Block` of rows per rank cut out of a fused local tensor (a `linear_qkv`'s);
- `box`: a 3-d block per rank split along its last dimension;
- `cols16`: a bf16 column block, a view (not contiguous) of a wider local tensor;
- `norm`: a plain tensor both hold whole (replicated: they split its rows).

Scenarios: two syncs with the weights changed between (the first into a receiver that knows
the engine's tensors and writes into them, the second into a fresh one that knows nothing:
the shapes come from the blocks); delta on (bf16 wire, each sender against its own
baseline); blocks that leave a gap (refused on every rank by name, nothing applied); a
sender whose source fails part-way (every tensor old or new on the engine).
"""

from __future__ import annotations

import dataclasses
import datetime

import pytest
import torch
import torch.distributed as dist

from hal.sync import BroadcastTransport, DeltaConfig, SyncConfig, SyncError, TensorSpec, copy_into
from hal.sync.plan import Block
from tests.multiproc import run_group
from tests.sync.send.test_gather import digest

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 10.0
ENGINE = 2
SHAPES = {"col": (6, 5), "o": (8, 6), "q": (8, 4), "box": (4, 4, 6), "cols16": (3, 8), "norm": (5,)}
DTYPES = {"cols16": torch.bfloat16}


def full_weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(s, generator=g).to(DTYPES.get(n, torch.float32)) for n, s in SHAPES.items()}


def rank_source(rank: int, step: int, mesh, gap: bool = False) -> list[tuple[str, object]]:
    """Rank `rank`'s tensors of the model at `step`, as the module doc says it holds them."""
    from torch.distributed.tensor import Shard, distribute_tensor

    full = full_weights(step)
    o_cols = ((0, 4), (5, 6) if gap else (4, 6))[rank]
    # the fused local tensor: per query group (one per rank here) [q0, q1, k, v], 2 rows each
    fused = torch.cat([full["q"][4 * rank : 4 * rank + 4], torch.zeros(4, 4)])
    q_local = fused.view(1, 4, 2, 4)[:, :2].reshape(4, 4)  # the sender de-interleaves its own shard
    wide = torch.cat([full["cols16"], full["cols16"]], dim=1)  # a local buffer whose half is the block
    return [
        ("col", distribute_tensor(full["col"], mesh, [Shard(1)])),
        ("o", Block(full["o"][:, o_cols[0] : o_cols[1]].clone(), SHAPES["o"], (0, o_cols[0]))),
        ("q", Block(q_local, SHAPES["q"], (4 * rank, 0))),
        ("box", Block(full["box"][:, :, 3 * rank : 3 * rank + 3].clone(), SHAPES["box"], (0, 0, 3 * rank))),
        ("cols16", Block(wide[:, 4 * rank : 4 * rank + 4], SHAPES["cols16"], (0, 4 * rank))),
        ("norm", full["norm"].clone()),
    ]


def expected_bytes(rank: int) -> int:
    """Each rank's blocks: col 3|2 columns, o 4|2, q 4 rows, box 3 of 6, cols16 4 of 8, norm 3|2 rows."""
    cols = (3, 2)[rank] * 6 + (4, 2)[rank] * 8
    return 4 * (cols + 4 * 4 + 4 * 4 * 3 + (3, 2)[rank]) + 2 * 3 * 4


def blocks_worker(rank: int, world: int, scenario: str) -> object:
    import hal

    with hal.use("cpu"):
        return _blocks_worker(rank, scenario)


def _blocks_worker(rank: int, scenario: str) -> object:
    from torch.distributed.device_mesh import DeviceMesh

    from hal.sync.receive import ShardedReceiver
    from hal.sync.send import ShardedSender

    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    trainer_group = dist.new_group([0, 1], timeout=timeout)
    sync_groups = [dist.new_group([r, ENGINE], timeout=timeout) for r in (0, 1)]
    config = SyncConfig(bucket_bytes=4096, segment_bytes=4096, timeout_s=TIMEOUT_S)
    wire = None
    if scenario == "delta":
        wire = torch.bfloat16
        config = dataclasses.replace(config, wire_dtype=wire, delta=DeltaConfig(anchor_every=100, choose="bytes"))
    steps = 3 if scenario == "delta" else 2 if scenario == "ok" else 1
    if rank < ENGINE:
        mesh = DeviceMesh.from_group(trainer_group, "cpu")
        sender = ShardedSender(BroadcastTransport(sync_groups[rank], src=0), config=config, trainer_group=trainer_group)
        out = []
        for step in range(steps):
            source = rank_source(rank, step, mesh, gap=scenario == "gap" and rank == 1)
            if scenario == "source_fails" and rank == 1:
                from hal.sync.send import sharded

                real = sharded._Shares.__iter__

                def failing(self, real=real):
                    for i, item in enumerate(real(self)):
                        if i == 3:
                            raise RuntimeError("the trainer's weights are gone")
                        yield item

                sharded._Shares.__iter__ = failing
            try:
                metrics = sender.sync(source, version=step + 1)
                out.append(("ok", metrics.bytes, metrics.model_bytes, [s.wire.name for s in sender.plan.shares[rank]]))
            except SyncError as exc:
                out.append((type(exc).__name__, str(exc)[:600]))
        return out
    transports = [BroadcastTransport(g, src=0) for g in sync_groups]
    dtype_of = lambda n: wire or DTYPES.get(n, torch.float32)  # noqa: E731
    specs = [TensorSpec(n, s, dtype_of(n)) for n, s in SHAPES.items()]
    weights = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs}
    out = []
    receiver = ShardedReceiver(transports, specs, timeout_s=TIMEOUT_S)
    for step in range(steps):
        if scenario == "ok" and step == 1:  # a fresh receiver that knows nothing: the shapes come from the blocks
            receiver, got = ShardedReceiver(transports, None, timeout_s=TIMEOUT_S), {}

            def sink(pairs, got=got):
                got.update((n, t.clone()) for n, t in pairs)
        else:
            sink, got = copy_into(weights), weights
        try:
            metrics = receiver.receive(sink)
            out.append(("ok", metrics.bytes, digest(got), {n: tuple(t.shape) for n, t in got.items()}))
        except SyncError as exc:
            out.append((type(exc).__name__, str(exc)[:600], digest(weights), receiver.consistent))
    return out


def test_blocks_and_column_shares_arrive_bit_exact_and_each_rank_sends_its_blocks():
    trainer0, trainer1, engine = run_group(blocks_worker, 3, args=("ok",), timeout=120, collective_timeout=TIMEOUT_S)
    total = sum(torch.Size(s).numel() * DTYPES.get(n, torch.float32).itemsize for n, s in SHAPES.items())
    assert expected_bytes(0) + expected_bytes(1) == total
    for step in range(2):
        for rank, trainer in enumerate((trainer0, trainer1)):
            ok, sent, whole, names = trainer[step]
            assert ok == "ok" and whole == total
            assert sent == expected_bytes(rank), f"sync {step + 1}: trainer rank {rank} sent {sent}, its blocks are {expected_bytes(rank)}"
        ok, received, held, shapes = engine[step]
        assert ok == "ok" and received == total
        assert held == digest(full_weights(step)), f"sync {step + 1}: the engine does not hold the trainer's tensors"
        assert shapes == SHAPES
    assert trainer1[0][3] == ["col@0:3", "o@0:4", "q@4", "box@0:0:3", "cols16@0:4", "norm@3"]


def test_blocks_with_delta_each_rank_against_its_own_baseline():
    trainer0, trainer1, engine = run_group(blocks_worker, 3, args=("delta",), timeout=120, collective_timeout=TIMEOUT_S)
    for step in range(3):
        assert trainer0[step][0] == trainer1[step][0] == "ok"
        assert engine[step][0] == "ok"
        expected = digest({n: t.to(torch.bfloat16) for n, t in full_weights(step).items()})
        assert engine[step][2] == expected, f"delta sync {step + 1}: the engine does not hold the trainer's bf16 tensors"


def test_blocks_that_leave_a_gap_are_refused_on_every_rank_and_nothing_is_applied():
    results = run_group(blocks_worker, 3, args=("gap",), timeout=120, collective_timeout=TIMEOUT_S)
    for rank_results in results:
        kind, message, *_ = rank_results[0]
        assert kind == "SpecMismatchError", message
        assert "parameter 'o': the blocks declared do not tile (8, 6) exactly once: 8 of 48 elements missing" in message, message
    zeros = digest({n: torch.zeros(s, dtype=DTYPES.get(n, torch.float32)) for n, s in SHAPES.items()})
    assert results[ENGINE][0][2] == zeros and results[ENGINE][0][3] is True


def test_a_senders_source_failing_part_way_leaves_every_tensor_old_or_new():
    trainer0, trainer1, engine = run_group(blocks_worker, 3, args=("source_fails",), timeout=120, collective_timeout=TIMEOUT_S)
    assert trainer1[0][0] == "SourceError" and "the trainer's weights are gone" in trainer1[0][1]
    assert trainer0[0][0] == "SourceError"
    kind, message, held, consistent = engine[0]
    assert kind == "SourceError", message
    old = digest({n: torch.zeros(s, dtype=DTYPES.get(n, torch.float32)) for n, s in SHAPES.items()})
    new = digest(full_weights(0))
    assert all(held[n] in (old[n], new[n]) for n in held), "a tensor holds neither its old nor its new bytes"
    assert held != new and consistent == (held == old)
