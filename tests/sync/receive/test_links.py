"""An engine worker receives only its own pieces from every trainer rank at once
(hal.sync.receive.links): two FSDP2 trainer ranks (rows, the norms replicated on both) into
a TP=2 engine of two workers, four spawned processes on gloo (the worker function:
tests.sync.send.test_links). Each worker must end with exactly its shard, having received
its shard and its replicated tensors and nothing more, from both ranks; a trainer rank lost
part-way fails every surviving rank alike, each worker's layers old or new."""

from __future__ import annotations

import pytest

from tests.multiproc import run_group
from tests.sync.receive.fake_layers import plan_of
from tests.sync.send.test_links import LOST_PEER_TIMEOUT_S, TIMEOUT_S, WORKERS, links_worker

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_two_fsdp2_ranks_send_each_worker_its_shard_and_the_replicated_norms_exactly(backend):
    rank0, rank1, worker0, worker1 = run_group(links_worker, 4, args=("ok", TIMEOUT_S, backend), timeout=240, collective_timeout=TIMEOUT_S)
    plan = plan_of(2, WORKERS)
    layers = [len({t.layer for t in needs.targets}) for needs in plan.needs]
    # each trainer rank sends its rows to the worker that needs them, and its rows of each norm to both
    assert plan.bytes_out[0] + plan.bytes_out[1] == plan.bytes_in[0] + plan.bytes_in[1] < 2 * plan.model_bytes
    norms = sum(s.nbytes for s in plan.specs if "norm" in s.name)
    assert all(plan.links[r][w].nbytes for r in range(2) for w in range(2))
    for step, version in enumerate((1, 2, 3)):
        for r, rank in enumerate((rank0, rank1)):
            links = max(plan.links[r][w].nbytes for w in range(WORKERS))
            assert rank[step][0] == ("ok", plan.bytes_out[r], WORKERS, links, plan.model_bytes, 2, step > 0), rank[step]
        for w, worker in enumerate((worker0, worker1)):
            outcome, state, closed, calls, _ = worker[step]
            assert outcome == ("ok", version, plan.needs[w].nbytes, 2, layers[w], True, True), outcome
            assert set(state.values()) == {"new"} and sorted(closed) == sorted(state) and calls == ["begin", "finish"]
    # bytes in: the worker's shard plus every norm, whole (replicated), and nothing more
    for w in range(WORKERS):
        shard = sum(n.numel * 4 for n in plan.needs[w].needs if "norm" not in plan.specs[n.tensor].name)
        assert plan.needs[w].nbytes == shard + norms


def test_a_trainer_rank_lost_part_way_fails_every_rank_within_the_timeout_with_old_or_new_layers():
    results = run_group(links_worker, 4, args=("sender_dies", LOST_PEER_TIMEOUT_S), timeout=240,
                        collective_timeout=LOST_PEER_TIMEOUT_S, allow_failure=True)
    rank0, rank1, worker0, worker1 = results
    assert "exit code 9" in rank1 or "died" in rank1, rank1
    (kind, message), seconds = rank0[0]
    assert kind == "PeerError" and seconds < 3 * LOST_PEER_TIMEOUT_S, (message, seconds)
    for worker in (worker0, worker1):
        (kind, message, consistent, version), state, closed, calls, seconds = worker[0]
        assert kind == "PeerError" and version is None and seconds < 3 * LOST_PEER_TIMEOUT_S, (message, seconds)
        assert "torn" not in state.values() and {layer for layer, word in state.items() if word == "new"} == set(closed), state
        finished = set(state.values()) == {"new"}  # every piece of it came before the rank was lost
        assert consistent is (not closed) and calls == (["begin", "finish", "abort"] if finished else ["begin", "abort"])
    # the lost rank's link to worker 1 stopped after its first pieces: some of worker 1's layers stay old
    assert "old" in worker1[0][1].values()
