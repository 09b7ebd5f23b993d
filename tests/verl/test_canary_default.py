"""The canary that runs by default in verl's checkpoint engine "hal" (no `canary` in
engine_kwargs["hal"]), through hal.integrations.verl.canary's exchange itself: two trainer
ranks and two rollout workers, each a thread, over in-memory groups (the all-gathers of
sync group 0 and of the trainer group). It never fails an update: a trainer without a
model, rollout workers without a way to answer (verl's own vLLM server adapter has none),
a worker whose answer is an error are said once, in trainer rank 0's log; when no rollout
worker can answer, no trainer rank runs the forward. The flow with Ray and verl's manager
is test_flow_canary.py's (a canary configured there).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.cpu]

pytest.importorskip("verl", reason="needs verl 0.9.1: make setup-verl, then run the verl lane (ci/verl.sh)")

from hal.integrations.verl.canary import answer_refusal, engine_answer, rollout_answer, trainer_check  # noqa: E402
from hal.integrations.verl.settings import canary_settings  # noqa: E402
from hal.canary import DEFAULT, Canary, CanaryConfig, Probe, module_logprobs  # noqa: E402
from tests.canary.test_canary import TinyLM  # noqa: E402

TIMEOUT_S = 30.0


class LocalGroup:
    """`size` ranks in one process, one thread each; `channel(rank)` has what the canary's
    exchange calls of a group channel (`rank`, `world_size`, `bounded`, `all_gather_bytes`)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=TIMEOUT_S)
        self.slots: list[bytes] = [b""] * size

    def channel(self, rank: int) -> "LocalChannel":
        return LocalChannel(self, rank)


class LocalChannel:
    def __init__(self, group: LocalGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.size

    @contextlib.contextmanager
    def bounded(self, timeout_s: float):
        yield

    def all_gather_bytes(self, data: bytes, what: str, limit: int | None = None) -> list[bytes]:
        self.group.slots[self.rank] = bytes(data)
        self.group.barrier.wait()
        rows = list(self.group.slots)
        self.group.barrier.wait()  # every rank read before the next gather writes
        return rows


_SEEDED = threading.Lock()


class CountingLM(TinyLM):
    """The trainer's model: the canary's forwards counted."""

    def __init__(self) -> None:
        with _SEEDED:  # the rollout workers' threads build theirs at once: one seeded draw at a time
            torch.manual_seed(0)
            super().__init__()
        self.forwards = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return super().forward(input_ids)


class Healthy:
    """A rollout worker's server adapter whose engine holds the trainer's weights."""

    def prompt_logprobs(self, sequences):
        return module_logprobs(CountingLM(), Probe.of(sequences))


class Broken:
    def prompt_logprobs(self, sequences):
        raise RuntimeError("the engine refused the probe")


def update(canaries: list[Canary], modules: list[Any], adapters: list[Any], *, version: int, settings: Any = DEFAULT) -> dict[str, Any]:
    """One update's canary on every worker at once (trainer ranks 0..T-1, rollout workers
    0..R-1): each trainer rank's `trainer_check` result or exception, each rollout worker's
    `rollout_answer` result."""
    rollouts, trainers = LocalGroup(1 + len(adapters)), LocalGroup(len(canaries))
    answers = canary_settings(settings)
    out: dict[str, Any] = {}

    def trainer(rank: int) -> None:
        try:
            out[f"trainer {rank}"] = trainer_check(
                canaries[rank], modules[rank], version, rollouts=rollouts.channel(0) if rank == 0 else None,
                trainers=trainers.channel(rank), timeout_s=TIMEOUT_S, missing="found no training engine",
            )
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[f"trainer {rank}"] = exc

    def rollout(i: int) -> None:
        adapter = adapters[i]
        out[f"rollout {i}"] = rollout_answer(
            rollouts.channel(1 + i), engine_answer(answers, adapter), timeout_s=TIMEOUT_S, refusal=answer_refusal(answers, adapter),
        )

    threads = [threading.Thread(target=trainer, args=(r,)) for r in range(len(canaries))]
    threads += [threading.Thread(target=rollout, args=(i,)) for i in range(len(adapters))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "the exchange hung"
    return out


def every_update() -> Canary:
    """The default canary due at every update, so that what it says once shows across updates."""
    canary = Canary.default()
    canary.config.every = 1
    return canary


def not_checked(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "is not checked" in r.getMessage()]


def test_no_rollout_worker_can_answer_so_no_trainer_rank_runs_the_forward_and_rank_0_says_so_once(caplog):
    caplog.set_level("WARNING", logger="hal.canary")
    canaries, modules = [every_update(), every_update()], [CountingLM(), CountingLM()]
    for version in (1, 2):
        out = update(canaries, modules, [object(), object()], version=version)  # verl's vLLM adapter: no prompt_logprobs
        assert out == {"trainer 0": None, "trainer 1": None, "rollout 0": True, "rollout 1": True}
    assert [m.forwards for m in modules] == [0, 0]
    (said,) = not_checked(caplog)
    assert "rollout worker 0, rollout worker 1 is not checked: the rollout worker's server adapter (object) has no prompt_logprobs" in said


def test_the_rollout_workers_that_answer_are_checked_and_an_error_is_set_aside_once(caplog):
    caplog.set_level("WARNING", logger="hal.canary")
    canaries, modules = [every_update(), every_update()], [CountingLM(), CountingLM()]
    for version in (1, 2):
        out = update(canaries, modules, [Healthy(), Broken()], version=version)
        report = out["trainer 0"]
        assert report is not None and report == out["trainer 1"], out
        assert set(report.engines) == {"rollout worker 0"} and not report.fired and report.version == version
    assert [m.forwards for m in modules] == [2, 2]  # every trainer rank in the forward (FSDP2's is a collective)
    (said,) = not_checked(caplog)
    assert "engine 'rollout worker 1' is not checked: it computed no log-probs on the probe: CanaryError: RuntimeError: the engine" in said
    # a canary of the user's fires on the same worker, on every trainer rank
    given = [Canary(CanaryConfig(mode="log")), Canary(CanaryConfig(mode="log"))]
    out = update(given, modules, [Healthy(), Broken()], version=3, settings={"mode": "log"})
    assert out["trainer 0"].fired and not out["trainer 0"].engines["rollout worker 1"].passed and out["trainer 1"] == out["trainer 0"]


def test_without_the_trainers_model_the_default_says_so_once_and_a_given_canary_raises(caplog):
    caplog.set_level("WARNING", logger="hal.canary")
    canaries = [every_update(), every_update()]
    for version in (1, 2):
        out = update(canaries, [None, None], [Healthy(), Healthy()], version=version)
        assert out == {"trainer 0": None, "trainer 1": None, "rollout 0": False, "rollout 1": False}  # told: not checked
    (said,) = not_checked(caplog)
    assert "the trainer's model is not checked: found no training engine" in said
    given = [Canary(CanaryConfig(mode="log")), Canary(CanaryConfig(mode="log"))]
    out = update(given, [None, None], [Healthy(), Healthy()], version=3, settings={"mode": "log"})
    for rank in (0, 1):
        assert isinstance(out[f"trainer {rank}"], ValueError) and "the canary needs the trainer's model" in str(out[f"trainer {rank}"])


def test_the_default_checks_the_first_update_and_not_the_second():
    canaries = [Canary.default(), Canary.default()]
    modules = [CountingLM(), CountingLM()]
    first = update(canaries, modules, [Healthy(), Healthy()], version=1)
    assert first["trainer 0"] is not None and not first["trainer 0"].fired and first["trainer 0"].mode == "log"
    second = update(canaries, modules, [Healthy(), Healthy()], version=2)
    assert second == {"trainer 0": None, "trainer 1": None, "rollout 0": False, "rollout 1": False}
    assert [m.forwards for m in modules] == [1, 1]
