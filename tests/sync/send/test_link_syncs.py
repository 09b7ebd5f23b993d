"""The sending sides of a shard receive (hal.sync.send.link_syncs): one trainer rank sending
the whole model, and two trainer ranks splitting it (each holding it whole: they split every
tensor's rows), each engine worker receiving only its pieces (`LinkReceiver`, its links read
from the headers) into a fake engine (tests.sync.receive.fake_layers). Spawned processes on
gloo: trainer ranks 0..M-1, workers M and M+1. A source that lacks a tensor a worker needs is
refused on every trainer rank before anything moves, and told to the workers at the header."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from tests.multiproc import run_group
from tests.sync.receive.fake_layers import FakeLayers, checkpoint, tp_needs, values

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 30.0


def link_syncs_worker(rank, world):
    from hal.sync import SyncConfig, SyncError
    from hal.sync.receive import LandingSink, LinkReceiver
    from hal.sync.send import EveryRankLinks, OneRankLinks
    from hal.sync.transport import PeerTransport

    senders = world - 2
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    groups = [dist.new_group([r, *range(senders, world)], timeout=timeout) for r in range(senders)]
    trainer = dist.new_group(list(range(senders)), timeout=timeout)
    specs = checkpoint()
    needs = tp_needs(specs, 2)
    results = []
    if rank < senders:
        config = SyncConfig(bucket_bytes=8192, segment_bytes=4096, timeout_s=TIMEOUT_S)
        if senders == 1:
            sender = OneRankLinks(groups[0], needs, config=config)
        else:
            sender = EveryRankLinks(groups[rank], needs, config=config, trainer_group=trainer)
        for version in (1, 2, 3):
            source = values(specs, version)
            if version == 3:
                source.pop("model.layers.1.mlp.up_proj.weight")  # a tensor the workers need, left out
            try:
                m = sender.sync(source, version=version)
                results.append(("ok", m.bytes, m.worker_bytes, m.sending, sender.plan.bytes_out[rank], sender.plans.builds))
            except SyncError as exc:
                results.append((type(exc).__name__, str(exc)[:300]))
        return results
    w = rank - senders
    receiver = LinkReceiver([PeerTransport(g, src=0) for g in groups], timeout_s=TIMEOUT_S)
    engine = FakeLayers(needs[w])
    sink = LandingSink(needs[w], engine)
    for version in (1, 2, 3):
        try:
            m = receiver.receive(sink)
            outcome = ("ok", receiver.version, m.bytes)
        except SyncError as exc:
            outcome = (type(exc).__name__, str(exc)[:300], receiver.version)
        results.append((outcome, engine.state(version, before=version - 1 if version > 1 else None)))
    return results


@pytest.mark.parametrize("senders", [1, 2])
def test_each_worker_takes_its_shard_from_one_or_two_ranks_and_a_source_that_lacks_a_tensor_is_refused_everywhere(senders):
    results = run_group(link_syncs_worker, senders + 2, timeout=240, collective_timeout=TIMEOUT_S)
    needs = tp_needs(checkpoint(), 2)
    shards = tuple(n.nbytes for n in needs)
    for r in range(senders):
        for step in (0, 1):
            kind, sent, worker_bytes, sending, planned, builds = results[r][step]
            assert (kind, sent, worker_bytes, sending, builds) == ("ok", planned, shards, "one" if senders == 1 else "all", 1)
        assert sum(results[r][0][1] for r in range(senders)) == sum(shards)
        kind, message = results[r][2]
        assert kind == "SpecMismatchError" and "'model.layers.1.mlp.up_proj.weight'" in message, message
    for w in range(2):
        worker = results[senders + w]
        for step, version in ((0, 1), (1, 2)):
            outcome, state = worker[step]
            assert outcome == ("ok", version, shards[w]) and set(state.values()) == {"new"}, (outcome, state)
        (kind, message, version), state = worker[2]
        assert kind == "SpecMismatchError" and "up_proj" in message and version == 2, message
        assert set(state.values()) == {"old"}  # version 2's, every layer
