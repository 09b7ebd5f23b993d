"""Which collectives' works a channel keeps (hal.sync.wire.kept_works): the last few always,
and as many more as stay small, so that a run of tiny control collectives at a sync's end
is held whole while a staged transfer's large host copies are not."""

from __future__ import annotations

import sys
import time

import torch

from hal.sync.wire import kept_works
from hal.sync.wire.kept_works import KEEP_BYTES, KEEP_LAST, KEEP_WORKS, KeptWorks


class Work:
    """Stands in for a collective's work object."""


def test_tiny_works_are_kept_up_to_the_count():
    kept = KeptWorks()
    works = [Work() for _ in range(KEEP_WORKS + 10)]
    for w in works:
        kept.keep(w, torch.zeros(4, dtype=torch.int64))
    assert kept.works() == works[-KEEP_WORKS:]
    assert kept.nbytes == KEEP_WORKS * 32


def test_large_works_are_kept_within_the_bytes_but_the_last_few_always():
    kept = KeptWorks()
    big = torch.empty(KEEP_BYTES // 2 + 1, dtype=torch.uint8)
    works = [Work() for _ in range(KEEP_LAST + 3)]
    for w in works:
        kept.keep(w, big)
    assert kept.works() == works[-KEEP_LAST:]  # over the bytes, yet the last few stay
    small = Work()
    kept.keep(small, torch.zeros(1))
    assert kept.works() == works[-(KEEP_LAST - 1) :] + [small]


def test_bytes_are_counted_from_the_tensor_not_its_storage():
    kept = KeptWorks()
    storage = torch.zeros(1 << 20, dtype=torch.float32)
    kept.keep(Work(), storage[:16])
    assert kept.nbytes == 64


def test_the_exit_hook_holds_every_kept_work_and_pauses_only_after_a_recent_collective(monkeypatch):
    pauses: list[float] = []
    monkeypatch.setattr(kept_works.time, "sleep", pauses.append)
    monkeypatch.setattr(kept_works, "_EVERY", type(kept_works._EVERY)())
    kept = KeptWorks()
    works = [Work() for _ in range(3)]
    for w in works:
        kept.keep(w, torch.zeros(1))
    before = [sys.getrefcount(w) for w in works]
    kept_works.hold_past_exit()
    after = [sys.getrefcount(w) for w in works]
    assert [a - b for a, b in zip(after, before)] == [1, 1, 1]
    assert pauses == [kept_works.SETTLE_S]

    kept.last_kept_at = time.monotonic() - 2 * kept_works.RECENT_S
    kept_works.hold_past_exit()
    assert pauses == [kept_works.SETTLE_S]  # nothing ran lately: no pause
