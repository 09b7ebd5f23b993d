"""Which engines a failed sync leaves marked (hal.integrations.vllm.engine_calls), without an
engine running: those whose workers reported holding part of it, and every engine when no
agreement was reached because a peer was lost (what each applied is not known); and the
marking call on an engine that never answers is bounded."""

from __future__ import annotations

import threading
import time

import pytest

from hal.integrations.vllm import engine_calls
from hal.integrations.vllm.engine_calls import INCONSISTENT_PREFIX, EngineCalls, Settings
from hal.sync import SyncConfig, SyncError
from hal.sync.errors import PeerError, RankReport

pytestmark = [pytest.mark.cpu]


class Engine:
    def __init__(self, name: str, workers: int, *, hangs: bool = False) -> None:
        self.name, self.num_workers, self.hangs = name, workers, hangs
        self.labels: list[str] = []

    def update_weight_version(self, weight_version: str) -> None:
        if self.hangs:  # vLLM's client on an engine that died: no answer, ever
            threading.Event().wait()
        self.labels.append(weight_version)


def calls(*engines: Engine, timeout_s: float = 5.0) -> EngineCalls:
    settings = Settings(config=SyncConfig(timeout_s=timeout_s), master_address="127.0.0.1", master_port=None, timeout_s=timeout_s,
                        transport="broadcast", token=None, trainer_group=None)
    return EngineCalls(list(engines), settings)


def test_engines_whose_workers_report_part_of_the_sync_are_marked():
    engines = calls(Engine("a", 2), Engine("b", 1))  # group ranks: trainer 0, a 1-2, b 3
    reports = {0: RankReport(error="source failed", sender=True), 1: RankReport(), 2: RankReport(inconsistent=True), 3: RankReport()}
    assert engines.holding_part_of(SyncError("failed", reports=reports)) == {"a"}
    assert engines.holding_part_of(SyncError("refused before anything landed", reports={r: RankReport() for r in range(4)})) == set()
    assert engines.holding_part_of(RuntimeError("not a sync's error")) == set()


def test_a_lost_peer_without_an_agreement_marks_every_engine():
    engines = calls(Engine("a", 2), Engine("b", 1))
    assert engines.holding_part_of(PeerError("rank 2 died part-way")) == {"a", "b"}
    # a peer error the ranks did agree on says who holds what
    assert engines.holding_part_of(PeerError("late", reports={r: RankReport() for r in range(4)})) == set()


def test_the_label_is_set_on_each_marked_engine_and_bounded_on_one_that_never_answers(monkeypatch):
    monkeypatch.setattr(engine_calls, "LATE_CALL_BOUND_S", 0.5)
    live, dead, other = Engine("live", 1), Engine("dead", 1, hangs=True), Engine("other", 1)
    engines = calls(live, dead, other)
    start = time.monotonic()
    engines.label_inconsistent({"live", "dead"}, 4)
    assert time.monotonic() - start < 5  # the dead engine's call gave up after its bound
    assert live.labels == [f"{INCONSISTENT_PREFIX}4"] and other.labels == []
