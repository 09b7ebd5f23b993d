"""Every trainer rank sends: two FSDP2 ranks, each sending only its shard, into two receivers.

Four spawned processes on gloo: trainer ranks 0 and 1 hold `fully_shard` shards of one
model; each has a sync group of its own with engine workers 2 and 3 (groups [0, 2, 3]
and [1, 2, 3]). Three syncs with an Adam step between them; every receiver must hold the
trainer's full weights bit for bit after each, and each trainer rank must have sent
exactly the bytes of its own rows (the plan's share, half the model here).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from hal.sync import BroadcastTransport, HierarchicalTransport, IpcTransport, ModuleSource, SyncConfig, SyncError, TensorSpec, copy_into
from hal.sync.receive import ShardedReceiver
from hal.sync.send import ShardedSender
from tests.multiproc import run_group
from tests.sync.send.test_gather import digest, make_model, sharded_model, train_step

pytestmark = pytest.mark.multiprocess

# Healthy syncs and failures every rank sees at once never wait for a timeout: it only has
# to outlast a starved machine (a 10 s one ran out beside a full suite at low priority).
TIMEOUT_S = 30.0
# A lost peer is waited for: the bound the tests hold the other ranks to.
LOST_PEER_TIMEOUT_S = 10.0
# Where a test tells "at once" from "after a timeout", the timeout is long enough that a
# loaded 2-core machine's slow start (9.3 s seen) is never mistaken for it.
LONG_TIMEOUT_S = 60.0
SCENARIO_TIMEOUT_S = {"undeclarable": LONG_TIMEOUT_S, "receiver_dies": LOST_PEER_TIMEOUT_S, "sender_dies": LOST_PEER_TIMEOUT_S}
BUCKET = 32 * 1024


def engine_specs(dtype: torch.dtype | None = None) -> list[TensorSpec]:
    return [TensorSpec.of(n, p.detach() if dtype is None else p.detach().to(dtype)) for n, p in make_model().named_parameters()]


def model_bytes(dtype: torch.dtype | None = None) -> int:
    return sum(s.nbytes for s in engine_specs(dtype))


def groups(rank: int, timeout_s: float = TIMEOUT_S) -> tuple[object, list[object]]:
    """(trainer group of ranks 0-1, the sync group of each trainer rank with ranks 2 and 3)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    trainer = dist.new_group([0, 1], timeout=timeout)
    syncs = [dist.new_group([0, 2, 3], timeout=timeout), dist.new_group([1, 2, 3], timeout=timeout)]
    return trainer, syncs


def sharded_worker(rank, world, scenario, backend="cpu"):
    import hal

    with hal.use(backend):
        return _sharded_worker(rank, world, scenario)


def _sharded_worker(rank, world, scenario):

    from hal.sync import DeltaConfig

    timeout_s = SCENARIO_TIMEOUT_S.get(scenario, TIMEOUT_S)
    trainer_group, sync_groups = groups(rank, timeout_s)
    config = SyncConfig(bucket_bytes=BUCKET, segment_bytes=8192, timeout_s=timeout_s, verify=scenario == "verify")
    wire = None
    if scenario in ("delta", "base_lost"):
        wire = torch.bfloat16
        config = dataclasses.replace(config, wire_dtype=wire, delta=DeltaConfig(anchor_every=100, choose="bytes"))
    syncs = 3 if scenario in ("ok", "delta", "verify", "hierarchical", "ipc", "base_lost") else 2 if scenario == "subset" else 1
    token = "trainer-secret" if scenario == "token" else None

    def transport(group, src=0):
        if scenario == "ipc":  # one node: every sender's buckets in shared memory its receivers map
            return IpcTransport(group, src=src)
        if scenario != "hierarchical":
            return BroadcastTransport(group, src=src)
        # trainer ranks on nodes a and b, both engine workers on node c: rank 2 leads c
        # and receives from both senders over the network, rank 3 reads rank 2's buffers
        return HierarchicalTransport(group, src=src, node="abcc"[rank], timeout_s=timeout_s)
    if rank in (0, 1):
        model = sharded_model(trainer_group)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4 if wire is not None else 1e-2)
        sender = ShardedSender(transport(sync_groups[rank]), config=config, trainer_group=trainer_group, token=token)
        results = []
        for version in (1, 2, 3)[:syncs]:
            train_step(model, optimizer, rank, version)
            source = ModuleSource(model)
            if scenario == "subset" and version == 2:  # only the first Linear (as a LoRA sync sends only adapters)
                source = ModuleSource(model, rename=lambda n: n if n.startswith("1.") else None)
            if scenario == "undeclarable" and rank == 1:
                source = [("0.weight", "not a tensor")]
            if scenario == "mismatch" and rank == 1:
                source = ModuleSource(model, rename=lambda n: None if n == "3.weight" else n)
            if scenario == "source_fails" and rank == 1:
                from hal.sync.send import sharded

                real = sharded._Shares.__iter__

                def failing(self, real=real):
                    for i, item in enumerate(real(self)):
                        if i == 3:
                            raise RuntimeError("the trainer's weights are gone")
                        yield item

                sharded._Shares.__iter__ = failing
            if scenario == "sender_dies" and rank == 1:
                from hal.sync.send import sharded

                real = sharded._Shares.__iter__

                def dying(self, real=real):
                    for i, item in enumerate(real(self)):
                        if i == 2:
                            os._exit(9)  # a trainer rank lost mid-sync, after its first shares went
                        yield item

                sharded._Shares.__iter__ = dying
            start = time.monotonic()
            try:
                metrics = sender.sync(source, version=version)
                assert metrics.sending == "all"
                outcome = ("ok", metrics.bytes, metrics.model_bytes, metrics.senders, metrics.delta)
            except SyncError as exc:
                outcome = (type(exc).__name__, str(exc)[:400])
            seconds = time.monotonic() - start
            full = {n: p.full_tensor() for n, p in model.named_parameters()} if outcome[0] != "PeerError" else {}
            if wire is not None:
                full = {n: t.to(wire) for n, t in full.items()}
            results.append((outcome, digest(full), seconds))
        return results
    transports = [transport(g) for g in sync_groups]
    theirs = None if token is None else (token if rank == 2 else "another-secret")  # rank 3 was started with another
    receiver = ShardedReceiver(transports, engine_specs(wire), timeout_s=timeout_s, token=theirs, version=5 if scenario == "stale" else None)
    weights = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in engine_specs(wire)}
    results = []
    for step in range(syncs):
        start = time.monotonic()
        if scenario == "base_lost" and rank == 3 and step == 1:  # an engine worker restarted: no delta base
            receiver = ShardedReceiver(transports, engine_specs(wire), timeout_s=timeout_s, token=theirs)
        sink = copy_into(weights)
        if scenario == "receiver_dies" and rank == 3:
            real_apply = sink.apply

            def die(pairs, real_apply=real_apply):
                real_apply(pairs)
                os._exit(7)  # an engine worker lost mid-sync

            sink.apply = die
        try:
            metrics = receiver.receive(sink)
            outcome = ("ok", receiver.version, metrics.bytes)
            if scenario == "ok":  # the hand-over of whole tensors to the engine's sink is timed
                outcome += (0 < (metrics.apply_s or 0) <= metrics.total_s,)
            if scenario == "hierarchical":
                outcome += ([t.leader for t in transports],)
        except SyncError as exc:
            outcome = (type(exc).__name__, str(exc)[:400], receiver.consistent)
        results.append((outcome, digest(weights), time.monotonic() - start))
    return results


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_two_fsdp2_ranks_each_send_their_shard_bit_exact_into_two_receivers(backend):
    trainer0, trainer1, engine2, engine3 = run_group(sharded_worker, 4, args=("ok", backend), timeout=240, collective_timeout=TIMEOUT_S)
    total = model_bytes()
    for step in range(3):
        (ok0, sent0, whole0, senders0, _), full, _ = trainer0[step]
        (ok1, sent1, whole1, senders1, _), full1, _ = trainer1[step]
        assert ok0 == ok1 == "ok" and senders0 == senders1 == 2 and whole0 == whole1 == total
        # every row of this model splits evenly: each rank sent exactly half, and no more
        assert sent0 == sent1 == total // 2, (sent0, sent1, total)
        assert full1 == full
        for engine in (engine2, engine3):
            assert engine[step][0] == ("ok", step + 1, total, True)
            assert engine[step][1] == full, f"sync {step + 1}: the engine does not hold the trainer's weights"
    assert trainer0[0][1] != trainer0[1][1] != trainer0[2][1]  # the optimizer moved the weights each step


def test_a_node_leader_receives_from_both_senders_and_serves_its_follower():
    trainer0, trainer1, engine2, engine3 = run_group(sharded_worker, 4, args=("hierarchical",), timeout=240, collective_timeout=TIMEOUT_S)
    total = model_bytes()
    for step in range(3):
        assert trainer0[step][0][:2] == ("ok", total // 2) and trainer1[step][0][:2] == ("ok", total // 2)
        for engine in (engine2, engine3):
            ok, version, received, leaders = engine[step][0]
            assert (ok, version, received) == ("ok", step + 1, total)
            assert leaders == [1, 1]  # group rank 1 (world rank 2) leads node c in both senders' groups
            assert engine[step][1] == trainer0[step][1]


@pytest.mark.parametrize("scenario", ["verify", "ipc"])
def test_two_sending_ranks_with_verify_or_over_shared_memory(scenario):
    trainer0, trainer1, engine2, engine3 = run_group(sharded_worker, 4, args=(scenario,), timeout=240, collective_timeout=TIMEOUT_S)
    for step in range(3):
        assert trainer0[step][0][0] == trainer1[step][0][0] == "ok"
        for engine in (engine2, engine3):
            assert engine[step][0][0] == "ok" and engine[step][1] == trainer0[step][1]


def test_two_sending_ranks_delta_each_against_their_own_baseline():
    trainer0, trainer1, engine2, engine3 = run_group(sharded_worker, 4, args=("delta",), timeout=240, collective_timeout=TIMEOUT_S)
    for step in range(3):
        for trainer in (trainer0, trainer1):
            (ok, sent, whole, _, delta), _, _ = trainer[step]
            assert ok == "ok" and delta == (step > 0) and sent == whole // 2
        for engine in (engine2, engine3):
            assert engine[step][0][0] == "ok"
            assert engine[step][1] == trainer0[step][1], f"sync {step + 1}: the engine does not hold the trainer's bf16 weights"


def test_a_sync_of_some_tensors_leaves_the_others_as_they_were():
    trainer0, trainer1, engine2, engine3 = run_group(sharded_worker, 4, args=("subset",), timeout=240, collective_timeout=TIMEOUT_S)
    first, second = trainer0[0][1], trainer0[1][1]
    sent = {n for n in first if n.startswith("1.")}
    assert trainer0[1][0][:2] == ("ok", sum(s.nbytes for s in engine_specs() if s.name in sent) // 2)
    for engine in (engine2, engine3):
        assert engine[1][0][0] == "ok"
        held = engine[1][1]
        assert {n: held[n] for n in sent} == {n: second[n] for n in sent}  # the synced tensors: new
        assert {n: held[n] for n in first if n not in sent} == {n: first[n] for n in first if n not in sent}  # the rest: as before


def test_a_receiver_with_another_token_refuses_every_sender_and_nothing_is_applied():
    results = run_group(sharded_worker, 4, args=("token",), timeout=240, collective_timeout=TIMEOUT_S)
    for rank_results in results:
        (kind, message, *_), _, _ = rank_results[0]
        assert kind == "AuthError", message
    zeros = digest({s.name: torch.zeros(s.shape) for s in engine_specs()})
    assert results[2][0][1] == results[3][0][1] == zeros


def test_a_receiver_without_the_delta_base_gets_that_sync_whole_from_every_sender():
    trainer0, trainer1, engine2, engine3 = run_group(sharded_worker, 4, args=("base_lost",), timeout=240, collective_timeout=TIMEOUT_S)
    for step, expect_delta in ((0, False), (1, False), (2, True)):  # sync 2 went whole: rank 3 had lost the base
        for trainer in (trainer0, trainer1):
            assert trainer[step][0][0] == "ok" and trainer[step][0][4] is expect_delta, trainer[step][0]
        for engine in (engine2, engine3):
            assert engine[step][0][0] == "ok" and engine[step][1] == trainer0[step][1]


def test_an_older_version_is_refused_by_every_rank_with_one_plain_message():
    results = run_group(sharded_worker, 4, args=("stale",), timeout=240, collective_timeout=TIMEOUT_S)
    for rank_results in results:
        (kind, message, *_), _, _ = rank_results[0]
        assert kind == "StaleVersionError", message
        assert "receiver holds weight version 5; refusing older version 1" in message
        assert message.count("failed:") == 1, message  # the cause, not an agreement's text about it again
    assert results[2][0][0][2] is True  # nothing applied: still consistent


def test_a_rank_that_cannot_declare_its_tensors_fails_every_rank_at_once():
    results = run_group(sharded_worker, 4, args=("undeclarable",), timeout=240, collective_timeout=LONG_TIMEOUT_S)
    for rank_results in results:
        (kind, message, *_), _, seconds = rank_results[0]
        assert kind == "SpecMismatchError", message
        assert seconds < LONG_TIMEOUT_S / 2, f"{seconds:.1f} s: waited for a timeout"
    assert "'0.weight' is a str, not a tensor" in results[1][0][0][1]
    assert "trainer rank(s) [1] could not declare" in results[0][0][0][1]


def test_mismatched_layouts_are_refused_by_name_on_every_rank():
    results = run_group(sharded_worker, 4, args=("mismatch",), timeout=240, collective_timeout=TIMEOUT_S)
    for rank_results in results:
        (kind, message, *_), _, _ = rank_results[0]
        assert kind == "SpecMismatchError", message
        assert "'3.weight'" in message and "trainer rank(s) [1]" in message, message
    zeros = set(digest({s.name: torch.zeros(s.shape) for s in engine_specs()}).values())
    for engine in results[2:]:
        assert set(engine[0][1].values()) == zeros  # nothing applied


def test_a_senders_source_failing_part_way_fails_every_rank_with_old_or_new_tensors():
    trainer0, trainer1, engine2, engine3 = run_group(sharded_worker, 4, args=("source_fails",), timeout=240, collective_timeout=TIMEOUT_S)
    new = trainer0[0][1]
    assert trainer1[0][0][0] == "SourceError" and "the trainer's weights are gone" in trainer1[0][0][1]
    assert trainer0[0][0][0] == "SourceError", trainer0[0][0]
    old = digest({s.name: torch.zeros(s.shape) for s in engine_specs()})
    for engine in (engine2, engine3):
        (kind, message, consistent), held, _ = engine[0]
        assert kind == "SourceError", message
        assert all(held[n] in (old[n], new[n]) for n in held), "a tensor holds neither its old nor its new bytes"
        assert held != new  # the failure came before the end
        assert consistent == (held == old)  # touched weights make the receiver say so


def test_a_receiver_lost_mid_sync_fails_every_rank_within_the_timeout():
    results = run_group(sharded_worker, 4, args=("receiver_dies",), timeout=240, collective_timeout=LOST_PEER_TIMEOUT_S, allow_failure=True)
    trainer0, trainer1, engine2, engine3 = results
    assert "exit code 7" in engine3 or "died" in engine3, engine3
    for name, rank_results in (("sender 0", trainer0), ("sender 1", trainer1), ("other receiver", engine2)):
        (kind, message, *_), _, seconds = rank_results[0]
        assert kind == "PeerError", f"{name}: {kind}: {message}"
        assert seconds < 4 * LOST_PEER_TIMEOUT_S, f"{name} took {seconds:.1f} s"


def test_a_sender_lost_mid_sync_fails_every_rank_within_the_timeout_with_old_bytes():
    results = run_group(sharded_worker, 4, args=("sender_dies",), timeout=240, collective_timeout=LOST_PEER_TIMEOUT_S, allow_failure=True)
    trainer0, trainer1, engine2, engine3 = results
    assert "exit code 9" in trainer1 or "died" in trainer1, trainer1
    (kind, message), _, seconds = trainer0[0]
    assert kind in ("PeerError", "SyncError"), message
    assert seconds < 4 * LOST_PEER_TIMEOUT_S, f"the other sender took {seconds:.1f} s"
    zeros = digest({s.name: torch.zeros(s.shape) for s in engine_specs()})
    for engine in (engine2, engine3):
        (kind, message, consistent), held, seconds = engine[0]
        assert kind == "PeerError", message
        assert seconds < 3 * LOST_PEER_TIMEOUT_S
        # every tensor has a share from the lost rank: none may have reached the engine
        assert held == zeros and consistent
