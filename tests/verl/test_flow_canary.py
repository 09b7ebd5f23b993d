"""The canary in verl's checkpoint-engine flow: after each completed update, the trainer
ranks' log-probs of a fixed probe against each rollout worker's (hal.integrations.verl.canary).

The flow of test_flow.py (tests/verl/flow.py: 2 FSDP2 trainer ranks as verl
`TrainingWorker`s, rollout groups of verl's `CheckpointEngineWorker` with a
`MockServerAdapter`, verl's `CheckpointEngineManager`) with
`engine_kwargs["hal"]["canary"]` on. The rollout workers of the second group answer the
probe through their server adapter's `prompt_logprobs` (tests/verl/standins.py: the
checkpoint's model loaded with what the adapter received); the trainer ranks compute the
reference with the FSDP2 module, both ranks in the forward. Checked: healthy updates stay
quiet and report their numbers; a rollout worker whose engine keeps computing with stale
weights (it received the new ones, bit-exact) fails the update with `CanaryError` naming it
in "enforce" mode, and is only reported in "log" mode; the canary moves no weight and no
version.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.ray, pytest.mark.multiprocess, pytest.mark.timeout(600)]

verl = pytest.importorskip("verl", reason="needs verl 0.9.1: make setup-verl, then run the verl lane (ci/verl.sh)")

from tests.verl import flow  # noqa: E402

TIMEOUT_S = 20.0
TOLERANCE = 0.05
HAL_SETTINGS = {
    "bucket_bytes": 16384,
    "verify": True,
    "timeout_s": TIMEOUT_S,
    # both sides compute in fp32 (verl trains in fp32) with the same weights: a healthy |Δ| is fp32 noise
    "canary": {"mode": "enforce", "every": 1, "seed": 3, "sequences": 2, "length": 12, "tolerance": TOLERANCE},
}
# A training step's change large enough to move the probe's log-probs well past the tolerance
CHANGE = 8.0


@pytest.fixture(scope="module")
def verl_flow(tmp_path_factory, loopback_ray):
    with flow.running(tmp_path_factory.mktemp("verl-model"), hal_settings=HAL_SETTINGS) as started:
        yield started


def _canary(states):
    return [s["canary"] for s in states]


def test_healthy_updates_stay_quiet_and_report_their_numbers(verl_flow):
    for step in (1, 2):
        verl_flow.failing_manager.update_weights(global_steps=step)
        trainers = flow.states(verl_flow.trainers)
        reports = _canary(trainers)
        assert reports[0] == reports[1], "every trainer rank holds the same report"
        report = reports[0]
        assert report["version"] == step and not report["fired"], report
        assert set(report["engines"]) == {"rollout worker 0", "rollout worker 1"}
        assert report["max_abs"] <= TOLERANCE and report["tolerance"] == TOLERANCE
        assert all(e["tokens"] == 2 * 11 and e["passed"] for e in report["engines"].values())
        assert all(s["last_error"] is None for s in trainers)
        # verl drops finalize()'s result: update 1's check comes with update 2's metrics (what
        # send_weights returns; verl's test helper drops that too, so they are read from the state)
        metrics = trainers[0]["reported"]
        if step == 2:
            assert metrics["checkpoint_engine/hal/canary/version"] == 1 and metrics["checkpoint_engine/hal/canary/fired"] == 0.0
    assert verl_flow.failing.check_weights() == [[], []]


def test_an_engine_computing_with_stale_weights_fires_in_enforce_and_is_logged_in_log_mode(verl_flow):
    held = flow.states(verl_flow.trainers)[0]["version"]
    verl_flow.failing.go_stale(rank=1, stale=True)
    verl_flow.trainers.set_first_elements(CHANGE)
    with pytest.raises(Exception) as failure:
        verl_flow.failing_manager.update_weights(global_steps=held + 1)
    assert "CanaryError" in str(failure.value) and "engine 'rollout worker 1'" in str(failure.value), failure.value
    assert "rollout worker 0" not in str(failure.value).split("tolerance from", 1)[1]
    trainers = flow.states(verl_flow.trainers)
    assert all(s["last_error"].startswith("CanaryError: checkpoint engine 'hal': canary at version") for s in trainers)
    report = trainers[0]["canary"]
    assert report["fired"] and report["mode"] == "enforce"
    assert report["engines"]["rollout worker 1"]["max_abs"] > TOLERANCE and report["engines"]["rollout worker 0"]["passed"]
    # the canary changed nothing: every worker holds the new version, the bytes are the trainers'
    states = trainers + flow.states(verl_flow.failing)
    assert [s["version"] for s in states] == [held + 1] * 4
    assert verl_flow.failing.check_changed_weights(CHANGE) == [[], []]

    verl_flow.trainers.set_canary_mode("log")
    heard = len(verl_flow.trainers.canary_warnings()[0])  # rank 0 judges, and logs
    verl_flow.failing_manager.update_weights(global_steps=held + 2)  # returns: "log" only reports
    trainers = flow.states(verl_flow.trainers)
    assert trainers[0]["reported"]["checkpoint_engine/hal/canary/fired"] == 1.0  # the enforce check's numbers
    report = trainers[0]["canary"]
    assert report["fired"] and report["mode"] == "log" and report["version"] == held + 2
    assert not report["engines"]["rollout worker 1"]["passed"] and report["engines"]["rollout worker 0"]["passed"]
    assert all(s["last_error"] is None for s in trainers)
    logged = verl_flow.trainers.canary_warnings()[0][heard:]
    assert len(logged) == 1 and f"canary at version {held + 2}" in logged[0] and "engine 'rollout worker 1'" in logged[0], logged

    verl_flow.trainers.set_canary_mode("enforce")
    verl_flow.failing.go_stale(rank=1, stale=False)
    verl_flow.trainers.set_first_elements(None)
    verl_flow.failing_manager.update_weights(global_steps=held + 3)  # healthy again: quiet
    report = flow.states(verl_flow.trainers)[0]["canary"]
    assert not report["fired"] and report["version"] == held + 3
    assert verl_flow.failing.check_weights() == [[], []]
