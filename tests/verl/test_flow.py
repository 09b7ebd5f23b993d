"""verl's checkpoint-engine correctness flow with backend "hal" on the CPU (tests/verl/flow.py).

2 FSDP trainer ranks and 2 rollout workers as Ray actors on a Ray instance bound to
127.0.0.1, a tiny bf16 model saved locally, three `CheckpointEngineManager.update_weights()`
each followed by verl's `check_weights()`. Then, with the same trainer processes and a
second rollout group that can die on request: bit-exact chunked and verified updates, a
stale `global_steps` refused on every rank, delta updates of weights the trainers changed,
a rollout worker killed mid-update, and verl's rollout group updated again after it. The
tests run in file order (one flow; one Ray for the lane, tests/verl/conftest.py).
"""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.ray, pytest.mark.multiprocess, pytest.mark.timeout(600)]

verl = pytest.importorskip("verl", reason="needs verl 0.9.1: make setup-verl, then run the verl lane (ci/verl.sh)")

from tests.verl import flow  # noqa: E402

# Every wait of a sync; a dead rollout worker must fail the update within this.
TIMEOUT_S = 20.0
# The checkpoint engine's settings (engine_kwargs["hal"]): 16 KiB buckets, so that every
# matrix travels in chunks over several buckets; checksums on; delta syncs chosen by bytes
# (the first update of a group whole, the later ones deltas: the trainers' weights do not
# change here, so they carry no words, and the rollout workers must rebuild every tensor
# from their image); transport "auto" (on one CPU node: shared memory).
HAL_SETTINGS = {
    "bucket_bytes": 16384, "verify": True, "timeout_s": TIMEOUT_S, "delta": {"anchor_every": 100, "choose": "bytes"},
}


@pytest.fixture(scope="module")
def verl_flow(tmp_path_factory, loopback_ray):
    """The model and the started flow on the lane's Ray (loopback, the workers' environment);
    at the end every actor and placement group is checked gone."""
    with flow.running(tmp_path_factory.mktemp("verl-model"), hal_settings=HAL_SETTINGS) as started:
        yield started


def test_verl_flow_three_updates_with_backend_hal(verl_flow):
    """verl's own classes end to end: `TrainingWorkerTest` (with the CPU stand-ins), verl's
    rollout group (`CheckpointEngineWorkerTest`, `MockServerAdapter`, `MockReplica`), and
    `CheckpointEngineManager.update_weights()` three times, each checked by verl's
    `check_weights()` (every weight received and allclose; here bit-exact, below). The
    canary runs by default (no `canary` in engine_kwargs["hal"]): verl's `MockServerAdapter`,
    as its vLLM server adapter, has no way to answer the probe, so update 1 is not checked,
    which trainer rank 0 says once, and the update goes on."""
    verl_flow.trainers.canary_warnings()  # start listening
    timings = []
    for step in (1, 2, 3):
        began = time.monotonic()
        verl_flow.manager.update_weights(global_steps=step)
        timings.append(time.monotonic() - began)
        verl_flow.rollouts.check_weights()  # verl's check; raises in the worker on any difference
        trainer_states, rollout_states = flow.states(verl_flow.trainers), flow.states(verl_flow.rollouts)
        assert [s["version"] for s in trainer_states + rollout_states] == [step] * 4
        assert [s["sync_rank"] for s in trainer_states] == [0, -1]
        assert [s["sync_rank"] for s in rollout_states] == [1, 2]
        assert {s["transport"] for s in rollout_states} == {"ipc"}
        assert trainer_states[0]["metrics"]["buckets"] > 10  # chunked over many 16 KiB buckets
        sent = trainer_states[0]["metrics"]
        assert sent["delta_choice"] == ("anchor" if step == 1 else "delta")
        if step > 1:  # nothing changed: only the segments' counts travel
            assert sent["changed_fraction"] == 0 and sent["wire_bytes"] < sent["dense_wire_bytes"] // 10
    assert len({s["group"] for s in flow.states(verl_flow.rollouts)}) == 1, "the sync group was rebuilt between updates"
    said = verl_flow.trainers.canary_warnings()
    assert said[1] == [] and len(said[0]) == 1, said  # trainer rank 0, once
    assert "rollout worker 0, rollout worker 1 is not checked: the rollout worker's server adapter (MockServerAdapter) has no" in said[0][0]
    assert all(s["canary"] is None for s in flow.states(verl_flow.trainers))
    print(f"\nverl flow: start {verl_flow.timings['start_s']:.1f} s, updates {', '.join(f'{t:.2f}' for t in timings)} s")


def test_updates_are_bit_exact(verl_flow):
    """The second rollout group (a new sync group with the same trainers) compares every
    received tensor with the checkpoint bit for bit, then runs verl's check too."""
    for step in (10, 11):
        verl_flow.failing_manager.update_weights(global_steps=step)
        assert verl_flow.failing.check_weights() == [[], []]
    states = flow.states(verl_flow.trainers) + flow.states(verl_flow.failing)
    assert [s["version"] for s in states] == [11] * 4


def test_stale_global_steps_is_refused_on_every_rank(verl_flow):
    from hal.sync import StaleVersionError

    with pytest.raises(Exception, match="refusing older version 5"):
        verl_flow.failing_manager.update_weights(global_steps=5)  # the rollout workers hold 11
    states, _ = flow.failed_everywhere(verl_flow.trainers, verl_flow.failing, limit_s=2 * TIMEOUT_S)
    assert all(s["last_error"] and s["last_error"].startswith(StaleVersionError.__name__) for s in states), states
    assert [s["version"] for s in states] == [11] * 4  # nothing moved
    verl_flow.failing_manager.update_weights(global_steps=12)  # the group is intact: a newer version goes through
    assert verl_flow.failing.check_weights() == [[], []]


def test_delta_updates_carry_the_trainers_changes_bit_exact(verl_flow):
    """The trainers change element 0 of every weight (a training step's change in its
    smallest form, in their FSDP2 shards): each next update is a delta that carries only
    those words, and every rollout worker then holds exactly the trainers' new weights;
    also when they change back to the checkpoint's."""
    held = flow.states(verl_flow.trainers)[0]["version"]
    for step, first in ((held + 1, 0.375), (held + 2, -1.5), (held + 3, None)):
        changed = verl_flow.trainers.set_first_elements(first)
        assert changed[0] > 10 and changed[1] == 0, changed  # rank 0's shards start every tensor
        verl_flow.failing_manager.update_weights(global_steps=step)
        sent = flow.states(verl_flow.trainers)[0]["metrics"]
        assert sent["delta_choice"] == "delta", sent
        assert 0 < sent["changed_fraction"] < 0.01 and sent["wire_bytes"] < sent["dense_wire_bytes"] // 10, sent
        if first is None:
            assert verl_flow.failing.check_weights() == [[], []]  # bit for bit, then verl's own check
        else:
            assert verl_flow.failing.check_changed_weights(first) == [[], []]
    assert [s["version"] for s in flow.states(verl_flow.trainers) + flow.states(verl_flow.failing)] == [held + 3] * 4


def test_a_rollout_worker_killed_mid_update_fails_every_trainer_rank_in_time(verl_flow):
    import ray

    held = flow.states(verl_flow.trainers)[0]["version"]
    verl_flow.failing.die_during_next_update(rank=1, after=3)
    began = time.monotonic()
    with pytest.raises(Exception) as failure:
        verl_flow.failing_manager.update_weights(global_steps=held + 1)
    # verl's manager raises as soon as one of its calls fails (here the dead worker's);
    # the trainer ranks' own send_weights must end too, with PeerError, within the timeout.
    assert "PeerError" in str(failure.value) or "died" in str(failure.value), failure.value
    limit = 2 * TIMEOUT_S + 15  # the sender's wait, then the trainer ranks' agreement
    trainer_states, _ = flow.failed_everywhere(verl_flow.trainers, limit_s=limit)
    elapsed = time.monotonic() - began
    assert all(s["last_error"] and s["last_error"].startswith("PeerError") for s in trainer_states), trainer_states
    assert elapsed < limit, f"the trainer ranks took {elapsed:.1f} s to fail"
    assert all(s["version"] == held for s in trainer_states)
    survivor = verl_flow.failing.workers[0]
    assert ray.get(survivor.execute_checkpoint_engine.remote(method="state"))["version"] == held
    print(f"\nkilled rollout worker: every trainer rank raised after {elapsed:.1f} s")

    # the trainers build a new group with verl's rollout group, which still holds version 3
    verl_flow.manager.update_weights(global_steps=held + 2)
    verl_flow.rollouts.check_weights()
    assert [s["version"] for s in flow.states(verl_flow.trainers) + flow.states(verl_flow.rollouts)] == [held + 2] * 4
    # the fixture's teardown (ActorScope) then checks that no actor, process or placement group is left
