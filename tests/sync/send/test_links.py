"""Each engine worker receives only its own pieces: a trainer rank's N links under one header
exchange and one agreement (hal.sync.send.links), received by `LinkReceiver` into a
`LandingSink` over a fake engine whose layers are plain tensors (tests.sync.receive.fake_layers).

Spawned processes on gloo: trainer ranks 0..M-1, engine workers M and M+1 (a TP=2 engine);
each trainer rank r has its sync group [r, M, M+1]. Every rank builds the same M x N plan
(agreeing on it is the engine integration's). Here one trainer rank sends the whole model:
each worker must end with exactly its shard (every target as its loaders would leave it),
having received exactly its bytes; a checksum mismatch on one link and a worker lost
part-way fail every surviving rank alike, each worker's layers old or new.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch.distributed as dist

from hal.sync import SyncConfig, SyncError
from hal.sync.config import DeltaConfig
from tests.multiproc import run_group
from tests.sync.receive.fake_layers import FakeLayers, plan_of, rank_tensors
from tests.sync.transport.test_peer import FakeGroup

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 30.0  # healthy syncs never wait for it: it only has to outlast a starved machine
LOST_PEER_TIMEOUT_S = 10.0
WORKERS = 2


def links_worker(rank, world, scenario, timeout_s=TIMEOUT_S, backend="cpu"):
    """One rank of a sync of `world - 2` trainer ranks into 2 workers; per sync its outcome,
    and on a worker its layers' state ("new"/"old" per layer) and the layers it closed.
    `backend` "sim": streams that really run asynchronously (hal.backends.sim)."""
    import hal

    with hal.use(backend):
        return _links_worker(rank, world, scenario, timeout_s)


def _links_worker(rank, world, scenario, timeout_s):
    from hal.sync.receive import LandingSink, LinkReceiver
    from hal.sync.send import LinkSender
    from hal.sync.transport import PeerTransport, peer_links

    senders = world - WORKERS
    timeout = datetime.timedelta(seconds=timeout_s)
    groups = [dist.new_group([r, *range(senders, world)], timeout=timeout) for r in range(senders)]
    plan = plan_of(senders, WORKERS)
    # checksum: 1 ok, 2 a checksum mismatch on worker 1's link, 3 ok, 4 the sender's plan differs, 2 again (stale)
    versions = {"ok": (1, 2, 3), "checksum": (1, 2, 3, 4, 2)}.get(scenario, (1,))
    results = []
    if rank < senders:
        config = SyncConfig(bucket_bytes=8192, segment_bytes=4096, timeout_s=timeout_s, verify=scenario == "checksum")
        sender = LinkSender(peer_links(groups[rank]), rank=rank, config=config)
        if scenario == "sender_dies" and rank == 1:
            from hal.sync.send import links

            real = links._LinkSource.__iter__

            def dying(self, real=real):
                for i, item in enumerate(real(self)):
                    if self.wire.worker == 1 and i == 6:
                        os._exit(9)  # a trainer rank lost mid-sync, after some of its pieces went
                    yield item

            links._LinkSource.__iter__ = dying
        for step, version in enumerate(versions):
            start = time.monotonic()
            planned = plan_of(senders, WORKERS, vocab=96) if scenario == "checksum" and step == 3 else plan
            try:
                m = sender.send(planned, rank_tensors(planned, rank, version), version=version)
                outcome = ("ok", m.bytes, m.links, m.largest_link_bytes, m.model_bytes, m.senders, m.plan_reused)
            except SyncError as exc:
                outcome = (type(exc).__name__, str(exc)[:500])
            results.append((outcome, time.monotonic() - start))
        return results
    w = rank - senders
    receiver = LinkReceiver([PeerTransport(g, src=0) for g in groups], timeout_s=timeout_s)
    engine = FakeLayers(plan.needs[w], live=("lm_head.weight",) if w == 1 else (), die_at=3 if scenario == "worker_dies" and w == 1 else None)
    sink = LandingSink(plan.needs[w], engine)
    held = None  # the version the engine holds whole
    for step, version in enumerate(versions):
        if scenario == "checksum" and w == 1:
            corrupt(receiver.per_sender[0].transport, step == 1)
        start = time.monotonic()
        try:
            m = receiver.receive(sink, plan) if scenario == "checksum" else receiver.receive(sink)  # the plan, or the headers
            # apply: the engine's processing of the landed layers (close_layer, finish), within the sync's time
            outcome = ("ok", receiver.version, m.bytes, m.links, m.layers, receiver.consistent, 0 < (m.apply_s or 0) <= m.total_s)
        except SyncError as exc:
            outcome = (type(exc).__name__, str(exc)[:500], receiver.consistent, receiver.version)
        state = engine.state(version, before=held)
        if set(state.values()) == {"new"}:
            held = version
        results.append((outcome, state, list(engine.closed), list(engine.calls), time.monotonic() - start))
        engine.calls.clear()
    return results


def corrupt(transport, on: bool) -> None:
    """Flip a byte of the link's bucket 1 once it arrived (before it is checked), this sync."""
    real = type(transport).receive_segments

    def receive_segments(land, complete):
        def corrupting(k, j, landed, status):
            if on and k == 1 and j == 0:
                transport.buffer(1)[0] ^= 0xFF
            complete(k, j, landed, status)

        return real(transport, land, corrupting)

    transport.receive_segments = receive_segments


def test_one_sender_sends_each_worker_exactly_its_shard_and_a_checksum_mismatch_on_one_link_fails_every_rank():
    sender, worker0, worker1 = run_group(links_worker, 3, args=("checksum",), timeout=240, collective_timeout=TIMEOUT_S)
    plan = plan_of(1, WORKERS)
    layers = [len({t.layer for t in needs.targets}) for needs in plan.needs]
    for step in (0, 2):  # versions 1 and 3: healthy
        version = step + 1
        assert sender[step][0] == ("ok", plan.bytes_out[0], 2, max(plan.bytes_in), plan.model_bytes, 1, step > 0), sender[step]
        for w, worker in enumerate((worker0, worker1)):
            outcome, state, closed, calls, _ = worker[step]
            # bytes in == this worker's shard and its replicated tensors, exactly (the needs it recorded)
            assert outcome == ("ok", version, plan.needs[w].nbytes, 1, layers[w], True, True), outcome
            assert set(state.values()) == {"new"} and calls == ["begin", "finish"]
    assert plan.bytes_in[0] != plan.bytes_in[1] and sum(plan.bytes_in) < 2 * plan.model_bytes  # each its own, not the whole model
    kind, message = sender[1][0]
    assert kind == "ChecksumMismatchError" and "bucket 1" in message, message
    (kind, _, consistent, version), state, closed, calls, _ = worker1[1]
    assert kind == "ChecksumMismatchError" and version == 1 and calls == ["begin", "abort"]
    assert "torn" not in state.values() and {"old", "new"} == set(state.values()), state  # stopped at bucket 1
    assert {layer for layer, word in state.items() if word == "new"} == set(closed) and consistent is False
    (kind, _, consistent, version), state, closed, calls, _ = worker0[1]
    assert kind == "ChecksumMismatchError" and version == 1 and consistent is False  # its own link completed
    assert set(state.values()) == {"new"} and calls == ["begin", "finish", "abort"]
    # refused at the header by every rank, before any byte: a plan that differs, an older version
    for step, kind, words in ((3, "SpecMismatchError", "the two sides built different plans"), (4, "StaleVersionError", "holds weight version 3")):
        assert sender[step][0][0] == kind and words in sender[step][0][1], sender[step]
        for worker in (worker0, worker1):
            (got, message, consistent, version), state, _, calls, _ = worker[step]
            assert (got, consistent, version, calls) == (kind, True, 3, []) and words in message, message
            assert set(state.values()) == {"old"}  # still version 3's, every layer


def test_a_worker_lost_part_way_fails_every_other_rank_within_the_timeout_with_old_or_new_layers():
    results = run_group(links_worker, 3, args=("worker_dies", LOST_PEER_TIMEOUT_S), timeout=240,
                        collective_timeout=LOST_PEER_TIMEOUT_S, allow_failure=True)
    sender, worker0, worker1 = results
    assert "exit code 7" in worker1 or "died" in worker1, worker1
    (kind, message), seconds = sender[0]
    assert kind == "PeerError" and seconds < 3 * LOST_PEER_TIMEOUT_S, (message, seconds)
    (kind, message, consistent, version), state, closed, _, seconds = worker0[0]
    assert kind == "PeerError" and version is None and seconds < 3 * LOST_PEER_TIMEOUT_S, (message, seconds)
    assert "torn" not in state.values() and {layer for layer, word in state.items() if word == "new"} == set(closed)
    assert consistent is (not closed)


def test_a_link_sender_refuses_delta_and_links_of_other_channels():
    from hal.sync.send import LinkSender
    from hal.sync.transport import peer_links

    links = peer_links(FakeGroup(0, 3))
    with pytest.raises(ValueError, match="delta sync over point-to-point links is not supported"):
        LinkSender(links, rank=0, config=SyncConfig(delta=DeltaConfig()))
    with pytest.raises(ValueError, match="sharing its channel"):
        LinkSender([links[0], peer_links(FakeGroup(0, 3))[1]], rank=0)
