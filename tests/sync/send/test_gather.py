"""A sharded trainer: two FSDP2 ranks in lockstep, one sending, into two receivers.

Four spawned processes on gloo: trainer ranks 0 and 1 hold `fully_shard` shards of one
model (their own process group), rank 0 also sends to engine workers 2 and 3 over a
separate sync group. Three syncs with an Adam step between them; every receiver must
hold the trainer's full weights bit for bit after each. Failures: a receiver that dies
mid-sync, and a trainer rank whose source declares other tensors, fail every rank within
the timeout and leave no process behind.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import time

import pytest
import torch
import torch.distributed as dist

from hal.sync import BroadcastTransport, ModuleSource, Receiver, SyncConfig, SyncError, TensorSpec, copy_into
from hal.sync.send import TrainerSync
from tests.multiproc import run_group

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 10.0
BUCKET = 32 * 1024


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(300, 32),  # 38 KiB: larger than a bucket
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 32, bias=False),
    )


def sharded_model(trainer_group: object) -> torch.nn.Module:
    """`make_model()` under FSDP2 over `trainer_group`: each layer, then the whole."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    mesh = DeviceMesh.from_group(trainer_group, "cpu")
    for layer in (model[0], model[1], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def engine_specs(dtype: torch.dtype | None = None) -> list[TensorSpec]:
    return [TensorSpec.of(n, p.detach() if dtype is None else p.detach().to(dtype)) for n, p in make_model().named_parameters()]


def digest(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16] for n, t in tensors.items()}


def groups(rank: int) -> tuple[object, object]:
    """(trainer group of ranks 0-1, sync group of ranks 0, 2, 3); every rank creates both."""
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    trainer = dist.new_group([0, 1], timeout=timeout)
    sync = dist.new_group([0, 2, 3], timeout=timeout)
    return trainer, sync


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data, as data parallelism does
    ids = torch.randint(0, 300, (8, 5), generator=g)
    loss = model(ids).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def fsdp_worker(rank, world, scenario):

    from hal.sync import DeltaConfig

    trainer_group, sync_group = groups(rank)
    config = SyncConfig(bucket_bytes=BUCKET, segment_bytes=8192, timeout_s=TIMEOUT_S)
    wire = None
    if scenario == "delta":  # a bf16 engine, a small learning rate: most bf16 words stay the same
        wire = torch.bfloat16
        config = dataclasses.replace(config, wire_dtype=wire, delta=DeltaConfig(anchor_every=100, choose="bytes"))
    if rank in (0, 1):
        model = sharded_model(trainer_group)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4 if scenario == "delta" else 1e-2)
        trainer = TrainerSync(
            transport=BroadcastTransport(sync_group, src=0) if rank == 0 else None, config=config, trainer_group=trainer_group
        )
        results = []
        for version in (1, 2, 3):
            train_step(model, optimizer, rank, version)
            source = ModuleSource(model)
            if scenario == "mismatch" and rank == 1:
                source = ModuleSource(model, rename=lambda n: None if n == "3.weight" else n)  # one tensor fewer
            start = time.monotonic()
            try:
                metrics = trainer.sync(source, version=version)
                assert metrics.sending == "gather"  # on the sending rank and the others alike
                outcome = ("ok", metrics.tensors)
                if scenario == "delta" and rank == 0:
                    outcome += (metrics.delta, metrics.wire_bytes / metrics.dense_wire_bytes)
            except SyncError as exc:
                outcome = (type(exc).__name__, str(exc)[:300])
            full = {n: p.full_tensor() for n, p in model.named_parameters()}  # every trainer rank, in lockstep
            if wire is not None:
                full = {n: t.to(wire) for n, t in full.items()}
            results.append((outcome, digest(full), time.monotonic() - start))
            if scenario not in ("ok", "delta"):
                break
        return results
    # ranks 2 and 3: engine workers of the sync group, never in the trainer's group
    receiver = Receiver(BroadcastTransport(sync_group, src=0), engine_specs(wire), timeout_s=TIMEOUT_S)
    weights = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in engine_specs(wire)}
    results = []
    for _ in (1, 2, 3):
        start = time.monotonic()
        sink = copy_into(weights)
        if scenario == "receiver_dies" and rank == 3:
            real_apply = sink.apply

            def die(pairs, real_apply=real_apply):
                real_apply(pairs)
                os._exit(7)  # a worker lost mid-sync

            sink.apply = die
        try:
            receiver.receive(sink)
            outcome = ("ok", receiver.version)
        except SyncError as exc:
            outcome = (type(exc).__name__, str(exc)[:300])
        results.append((outcome, digest(weights), time.monotonic() - start))
        if scenario not in ("ok", "delta"):
            break
    return results


def test_fsdp2_trainer_in_lockstep_syncs_bit_exact_into_two_receivers():
    trainer0, trainer1, engine2, engine3 = run_group(fsdp_worker, 4, args=("ok",), timeout=240, collective_timeout=TIMEOUT_S)
    for step in range(3):
        (sent, tensors), full, _ = trainer0[step]
        assert sent == "ok" and tensors == len(engine_specs())
        assert trainer1[step][0] == ("ok", len(engine_specs()))  # the follower iterated the same tensors
        assert trainer1[step][1] == full  # both trainer ranks gathered the same full weights
        for engine in (engine2, engine3):
            assert engine[step][0] == ("ok", step + 1)
            assert engine[step][1] == full, f"sync {step + 1}: the engine does not hold the trainer's weights"
    assert trainer0[0][1] != trainer0[1][1] != trainer0[2][1]  # the optimizer moved the weights each step


def test_fsdp2_trainer_delta_syncs_bit_exact_into_two_bf16_receivers():
    """The same lockstep with delta sync: after the first (whole) sync the sending rank
    sends only the bf16 words that changed, the follower rank only gathers."""
    trainer0, trainer1, engine2, engine3 = run_group(fsdp_worker, 4, args=("delta",), timeout=240, collective_timeout=TIMEOUT_S)
    ratios = []
    for step in range(3):
        (sent, tensors, delta, ratio), full, _ = trainer0[step]
        assert sent == "ok" and tensors == len(engine_specs()) and delta == (step > 0)
        ratios.append(ratio)
        assert trainer1[step][0] == ("ok", len(engine_specs())) and trainer1[step][1] == full
        for engine in (engine2, engine3):
            assert engine[step][0] == ("ok", step + 1)
            assert engine[step][1] == full, f"sync {step + 1}: the engine does not hold the trainer's bf16 weights"
    assert ratios[0] == 1 and ratios[1] < 1 and ratios[2] < 1, ratios  # later syncs carried fewer bytes
    assert trainer0[0][1] != trainer0[1][1] != trainer0[2][1]  # the optimizer moved the weights each step


def test_a_receiver_lost_mid_sync_fails_every_rank_within_the_timeout():
    results = run_group(fsdp_worker, 4, args=("receiver_dies",), timeout=240, collective_timeout=TIMEOUT_S, allow_failure=True)
    trainer0, trainer1, engine2, engine3 = results
    assert "died" in engine3 or "exit code 7" in engine3, engine3  # the lost worker
    for name, rank_results in (("sender", trainer0), ("follower", trainer1), ("other receiver", engine2)):
        (kind, message), _, seconds = rank_results[0]
        assert kind == "PeerError", f"{name}: {kind}: {message}"
        assert seconds < 3 * TIMEOUT_S, f"{name} took {seconds:.1f} s"


def test_trainer_ranks_whose_sources_differ_are_refused_before_any_gather():
    trainer0, trainer1, engine2, engine3 = run_group(fsdp_worker, 4, args=("mismatch",), timeout=240, collective_timeout=TIMEOUT_S)
    for rank_results in (trainer0, trainer1, engine2, engine3):
        (kind, message), _, _ = rank_results[0]
        assert kind == "SpecMismatchError", message
    assert "trainer rank 1's source declares other tensors" in trainer0[0][0][1]
    for engine in (engine2, engine3):
        assert set(engine[0][1].values()) == set(digest({s.name: torch.zeros(s.shape) for s in engine_specs()}).values())


def test_a_trainer_without_a_sending_rank_is_refused_on_every_rank():
    results = run_group(_no_sender_worker, 2, timeout=60)
    assert all("exactly one trainer rank must hold the sync transport, found 0" in r for r in results), results


def _no_sender_worker(rank, world):
    try:
        TrainerSync(transport=None, config=SyncConfig(timeout_s=TIMEOUT_S))
    except ValueError as exc:
        return str(exc)
    return "accepted"


def resend_worker(rank, world):
    """Ranks 0-1 a trainer (plain tensors), rank 2 a receiver; the sender's first attempt
    fails part-way and it sends again; the other trainer rank follows without being told
    anything but what the agreement says."""
    from tests.sync.test_failures import FailingSource, weights

    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    trainer_group = dist.new_group([0, 1], timeout=timeout)
    sync_group = dist.new_group([0, 2], timeout=timeout)
    config = SyncConfig(bucket_bytes=16 * 1024, segment_bytes=4096, timeout_s=TIMEOUT_S)
    if rank in (0, 1):
        trainer = TrainerSync(transport=BroadcastTransport(sync_group, src=0) if rank == 0 else None, config=config, trainer_group=trainer_group)
        if rank == 1:
            source = TensorSourceCounting(weights(2))
            metrics = trainer.sync(source, version=2)  # iterates twice, returns once
            return metrics.tensors, source.passes
        source = FailingSource(weights(2), "layers.1.b")
        try:
            trainer.sync(source, version=2, resend=lambda exc: exc.trainer_side and bool(exc.inconsistent_ranks))
            return "no failure"
        except SyncError as exc:
            first = type(exc).__name__
        source.fail_at = None  # the cause went away: send again
        trainer.sync(source, version=2)
        return first
    from tests.sync.test_failures import classify, specs

    receiver = Receiver(BroadcastTransport(sync_group, src=0), specs(), timeout_s=TIMEOUT_S, version=1)
    held = {n: t.clone() for n, t in weights(1)}
    outcomes = []
    for _ in range(2):
        try:
            receiver.receive(copy_into(held))
            outcomes.append(("ok", receiver.consistent))
        except SyncError as exc:
            outcomes.append((type(exc).__name__, receiver.consistent))
    return outcomes, set(classify(held).values()), receiver.version


class TensorSourceCounting:
    """A source that counts its passes (the follower's view of a resend)."""

    def __init__(self, pairs):
        self.pairs = list(pairs)
        self.passes = 0

    def metadata(self):
        return [TensorSpec.of(n, t) for n, t in self.pairs]

    def __iter__(self):
        self.passes += 1
        return iter(self.pairs)


def test_a_resend_decided_by_the_sender_is_followed_by_the_other_trainer_ranks():
    sender, follower, (outcomes, held, version) = run_group(resend_worker, 3, timeout=120, collective_timeout=TIMEOUT_S)
    assert sender == "SourceError"
    assert follower == (8, 2)  # the follower's one call iterated for both attempts and returned once
    assert outcomes == [("SourceError", False), ("ok", True)]
    assert held == {"new"} and version == 2
