"""Every trainer rank sends its own shard: verl's checkpoint-engine flow with `senders: "all"`.

The flow of test_flow.py (tests/verl/flow.py: 2 FSDP2 trainer ranks as verl
`TrainingWorker`s, verl's rollout group of 2 and a second rollout group of 2, on a Ray bound
to 127.0.0.1, verl's `CheckpointEngineManager` in verl's order: prepare, build_topology,
init_process_group, send_weights on every trainer rank, receive_weights on every rollout
worker, finalize) with `engine_kwargs["hal"]["senders"] = "all"`: each trainer rank has a
sync group of its own with every rollout worker and sends only its FSDP2 rows, and every
rollout worker still yields whole (name, tensor) pairs to verl's server adapter. Checked:
verl's own `check_weights` after each update; each trainer rank's bytes are exactly its
share of the model and verl's gathering generator ran no `full_tensor()`; weights changed
in both ranks' shards arrive bit-exact over several (delta) updates; a trainer rank whose
layout differs fails the update on every rank, by name, well within the timeout; a stale
version is refused; and the groups are kept between updates.
"""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.ray, pytest.mark.multiprocess, pytest.mark.timeout(600)]

verl = pytest.importorskip("verl", reason="needs verl 0.9.1: make setup-verl, then run the verl lane (ci/verl.sh)")

from tests.verl import flow  # noqa: E402

TIMEOUT_S = 20.0
# As test_flow.py (16 KiB verified buckets, delta chosen by bytes, transport auto: shared
# memory on one CPU node, here one set of buffers per trainer rank), with every trainer rank sending.
HAL_SETTINGS = {
    "senders": "all",
    "bucket_bytes": 16384,
    "verify": True,
    "timeout_s": TIMEOUT_S,
    "delta": {"anchor_every": 100, "choose": "bytes"},
    # the canary after every other update, with every trainer rank sending: the trainer ranks'
    # forward with the FSDP2 module, the answers over trainer rank 0's group ("log": verl's own
    # MockServerAdapter cannot answer, and is reported, not raised)
    "canary": {"mode": "log", "every": 2, "sequences": 1, "length": 6},
}
TRAINERS = 2


@pytest.fixture(scope="module")
def verl_flow(tmp_path_factory, loopback_ray):
    with flow.running(tmp_path_factory.mktemp("verl-model"), hal_settings=HAL_SETTINGS, num_trainer=TRAINERS) as started:
        yield started


@pytest.fixture(scope="module")
def shares(verl_flow) -> list[int]:
    """The elements each trainer rank holds of the model under FSDP2 `Shard(0)`, from the
    checkpoint's shapes: rank r holds the rows `torch.chunk` gives it."""
    import torch
    from transformers import AutoModelForCausalLM

    from hal.sync.plan.shards import chunk_rows

    weights = AutoModelForCausalLM.from_pretrained(verl_flow.model_path, dtype=torch.bfloat16).state_dict()
    held = [0] * TRAINERS
    for tensor in weights.values():
        assert tensor.dim() >= 1 and tensor.shape[0] >= TRAINERS  # every rank holds rows of every tensor
        for rank in range(TRAINERS):
            lo, hi = chunk_rows(tensor.shape[0], TRAINERS, rank)
            held[rank] += (hi - lo) * tensor[0].numel()
    assert sum(held) == sum(t.numel() for t in weights.values())
    return held


def test_every_trainer_rank_sends_its_own_shard_in_verls_flow(verl_flow, shares):
    """verl's manager and verl's rollout group, three updates, each checked by verl's
    `check_weights()`; every trainer rank sent exactly its rows and gathered nothing."""
    held = shares
    for step in (1, 2, 3):
        verl_flow.manager.update_weights(global_steps=step)
        verl_flow.rollouts.check_weights()  # verl's check; raises in the worker on any difference
        trainers, rollouts = flow.states(verl_flow.trainers), flow.states(verl_flow.rollouts)
        assert [s["version"] for s in trainers + rollouts] == [step] * 4
        assert [s["sync_rank"] for s in trainers] == [0, 0]  # each the sender of its own group
        assert [s["sync_rank"] for s in rollouts] == [1, 2]
        own = [s["group"] for s in trainers]
        assert all(len(g) == 1 for g in own) and own[0] != own[1]
        assert all(s["group"] == (own[0][0], own[1][0]) for s in rollouts)  # both groups, in trainer-rank order
        assert [s["transport"] for s in rollouts] == [("ipc", "ipc")] * 2
        # the trainers hold float32 (verl's FSDP default to train): 4 bytes an element
        itemsize, rest = divmod(trainers[0]["metrics"]["model_bytes"], sum(held))
        assert rest == 0 and itemsize == 4
        for rank, state in enumerate(trainers):
            sent = state["metrics"]
            assert sent["bytes"] == held[rank] * itemsize, (rank, sent["bytes"], held, itemsize)  # its share, no more
            assert (sent["senders"], sent["model_bytes"]) == (TRAINERS, sum(held) * itemsize)
            assert sent["delta_choice"] == ("anchor" if step == 1 else "delta")
        report = trainers[0]["canary"]
        assert report == trainers[1]["canary"] and report["version"] == (2 * ((step - 1) // 2) + 1)  # updates 1, 3 checked
        assert report["fired"] and set(report["engines"]) == {"rollout worker 0", "rollout worker 1"}
        assert all("has no prompt_logprobs(sequences) method" in e["error"] for e in report["engines"].values()), report
    assert verl_flow.trainers.gathers() == [0, 0], "verl's gathering generator was iterated"
    assert len({s["group"] for s in flow.states(verl_flow.rollouts)}) == 1, "the sync groups were rebuilt between updates"


def test_changes_in_both_ranks_shards_arrive_bit_exact(verl_flow):
    """The second rollout group (new groups with the same trainers): rank 0 changes element
    0 of every weight and rank 1 its last element, in their FSDP2 shards; each update is a
    delta of both senders' changes, and every rollout worker holds the trainers' weights bit
    for bit, also after they change back."""
    for step in (10, 11):
        verl_flow.failing_manager.update_weights(global_steps=step)
        assert verl_flow.failing.check_weights() == [[], []]
    for step, first, last in ((12, 0.375, -2.0), (13, -1.5, 0.25), (14, None, None)):
        assert verl_flow.trainers.set_first_elements(first)[1] == 0  # rank 0's shards start every weight
        assert verl_flow.trainers.set_last_elements(last)[0] == 0  # rank 1's end it
        verl_flow.failing_manager.update_weights(global_steps=step)
        for state in flow.states(verl_flow.trainers):
            sent = state["metrics"]
            assert sent["delta_choice"] == "delta" and 0 < sent["changed_fraction"] < 0.01, sent
        if first is None:
            assert verl_flow.failing.check_weights() == [[], []]  # bit for bit, then verl's own check
        else:
            assert verl_flow.failing.check_changed_weights(first, last) == [[], []]
    assert [s["version"] for s in flow.states(verl_flow.trainers) + flow.states(verl_flow.failing)] == [14] * 4
    assert verl_flow.trainers.gathers() == [0, 0]
    # the canary checked updates 11 and 13 (the trainers' 5th and 7th): the engines that
    # answer computed what the trainer ranks did, also with both ranks' changes in
    report = flow.states(verl_flow.trainers)[0]["canary"]
    assert report["version"] == 13 and not report["fired"] and report["max_abs"] <= report["tolerance"] == 1e-2, report


def test_a_trainer_rank_with_another_layout_fails_every_rank_by_name_in_time(verl_flow):
    """Trainer rank 1 leaves a weight out of its module's state dict: the trainer ranks'
    layouts disagree, and every trainer rank and rollout worker raises `SpecMismatchError`
    naming the weight and the rank before any byte moves; then a stale version is refused
    on every rank, and the next update goes through on the same groups."""
    held = flow.states(verl_flow.trainers)[0]["version"]
    verl_flow.trainers.hide_weight(1, "model.norm.weight")
    began = time.monotonic()
    try:
        with pytest.raises(Exception, match="SpecMismatchError"):
            verl_flow.failing_manager.update_weights(global_steps=held + 1)
        states, _ = flow.failed_everywhere(verl_flow.trainers, verl_flow.failing, limit_s=2 * TIMEOUT_S, kind="SpecMismatchError")
        elapsed = time.monotonic() - began
    finally:
        verl_flow.trainers.hide_weight(1, None)
    for state in states:
        error = state["last_error"] or ""
        assert error.startswith("SpecMismatchError"), states
        assert "'model.norm.weight'" in error and "trainer rank(s) [1]" in error, error
    assert elapsed < TIMEOUT_S, f"the ranks took {elapsed:.1f} s to fail"
    assert [s["version"] for s in states] == [held] * 4  # refused before any byte moved
    print(f"\nmismatched layout: every rank raised after {elapsed:.1f} s")

    from hal.sync import StaleVersionError

    with pytest.raises(Exception, match="refusing older version"):
        verl_flow.failing_manager.update_weights(global_steps=held - 1)
    states, _ = flow.failed_everywhere(verl_flow.trainers, verl_flow.failing, limit_s=2 * TIMEOUT_S, kind=StaleVersionError.__name__)
    assert all((s["last_error"] or "").startswith(StaleVersionError.__name__) for s in states), states

    verl_flow.failing_manager.update_weights(global_steps=held + 2)  # the groups were kept: it goes through
    assert verl_flow.failing.check_weights() == [[], []]
    assert [s["version"] for s in flow.states(verl_flow.trainers) + flow.states(verl_flow.failing)] == [held + 2] * 4
