"""Several nodes: the network crossed once per node, shared memory within a node.

Nodes are simulated on this machine by giving ranks different `VERL_HAL_NODE` keys. The
sender counts the segment bytes it put on the network (`network_bytes`); with two remote
nodes of two workers each that must be exactly two models per sync, however many
workers, and every worker must hold every tensor bit for bit. A failing source must leave
every worker, leader or not, with only old or new bytes.
"""

from __future__ import annotations

import os

import pytest
import torch

from hal.sync import HierarchicalTransport, Receiver, Sender, SyncConfig, SyncError, TensorSource, build_plan, copy_into
from hal.sync.transport.hierarchical import NodeMap
from tests.multiproc import run_group
from tests.sync.test_failures import FailingSource, KeepCopies, classify, specs, weights

pytestmark = pytest.mark.multiprocess

BUCKET = 16 * 1024
MODEL_BYTES = sum(t.numel() * t.element_size() for _, t in weights(0))


def wire_bytes(segment_bytes, verify) -> int:
    plan = build_plan(specs(), BUCKET, verify=verify, segment_bytes=segment_bytes)
    return sum(seg.stop - seg.start for b in plan.buckets for seg in b.segments)


def layout_worker(rank, world, nodes, cases):
    """Every case: one good sync, one whose source fails part-way, one good again."""
    os.environ["VERL_HAL_NODE"] = nodes[rank]
    transport = HierarchicalTransport(None, src=0)
    out = {"leader": transport.leader, "serves": transport.serves}
    results = []
    for segment_bytes, verify, sink_kind in cases:
        config = SyncConfig(bucket_bytes=BUCKET, segment_bytes=segment_bytes, verify=verify, timeout_s=20.0)
        if rank == 0:
            sender = Sender(transport, config)
            before = transport.network_bytes
            sender.send(TensorSource(weights(1)), version=1)
            one_sync = transport.network_bytes - before
            try:
                sender.send(FailingSource(weights(2), "layers.1.b"), version=2)
                failed = "sent"
            except SyncError as exc:
                failed = type(exc).__name__
            sender.send(TensorSource(weights(2)), version=2)
            results.append((one_sync, failed))
            continue
        held = {n: torch.zeros_like(t) for n, t in weights(0)}
        sink = copy_into(held) if sink_kind == "dest" else KeepCopies(held)
        receiver = Receiver(transport, specs())
        receiver.receive(sink)
        first = set(classify(held).values())
        try:
            receiver.receive(sink)
            failed = "received"
        except SyncError as exc:
            failed = type(exc).__name__
        during, consistent = classify(held), receiver.consistent
        receiver.receive(sink)
        results.append((first, failed, during, consistent, set(classify(held).values()), receiver.version))
    out["results"] = results
    transport.close()
    return out


CASES = [(4096, False, "dest"), (None, True, "copies"), (4096, False, "copies")]


@pytest.mark.parametrize(
    "nodes,remote_nodes",
    [
        (["trainer", "a", "a", "b", "b"], 2),  # the trainer on its own node: two nodes of two workers
        (["a", "a", "b", "b"], 1),  # colocated: the sender serves its own node through shared memory
    ],
    ids=["separate-2x2", "colocated"],
)
def test_each_node_gets_the_bytes_once_and_every_worker_every_byte(nodes, remote_nodes):
    results = run_group(layout_worker, len(nodes), args=(nodes, CASES), timeout=240)
    sender = results[0]
    for (segment_bytes, verify, _), (one_sync, failed) in zip(CASES, sender["results"]):
        # the network carries one model per remote node (its segments: the tensors' bytes, the
        # alignment gaps inside packed segments, and the checksums when verifying)
        assert one_sync == remote_nodes * wire_bytes(segment_bytes, verify)
        assert MODEL_BYTES <= wire_bytes(segment_bytes, verify) < 1.02 * MODEL_BYTES
        assert failed == "SourceError"
    leaders = {r: res["leader"] for r, res in enumerate(results)}
    for rank, res in enumerate(results[1:], start=1):
        assert leaders[rank] == NodeMap(tuple(nodes), 0).leader_of(rank)
        for first, failed, during, consistent, after, version in res["results"]:
            assert first == {"old"}, first  # the first sync carried weights(1), which classify() calls "old"
            assert failed == "SourceError"
            assert "OTHER" not in during.values(), (rank, during)
            assert all(during[n] == "old" for n in ("layers.1.b", "layers.2.w", "layers.2.scale", "step")), (rank, during)
            assert consistent is ("new" not in during.values())
            assert after == {"new"} and version == 2


def test_node_layout_picks_leaders_and_who_they_serve():
    layout = NodeMap(("t", "a", "a", "b", "b", "b"), 0)
    assert layout.remote_leaders == [1, 3]
    assert [layout.leader_of(r) for r in range(6)] == [0, 1, 1, 3, 3, 3]
    assert layout.served_by(1) == [2] and layout.served_by(3) == [4, 5] and layout.served_by(0) == []
    colocated = NodeMap(("a", "a", "b"), 0)
    assert colocated.remote_leaders == [2] and colocated.served_by(0) == [1]
