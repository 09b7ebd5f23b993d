"""hal.procs' ranks leave nothing in /dev/shm when killed part-way (a rank's progress bar
would otherwise hold a named semaphore there until the fork server exits)."""

from __future__ import annotations

import os

import pytest

from tests.multiproc import run_group

pytestmark = pytest.mark.multiprocess


def bar_then_killed(rank: int, world: int) -> None:
    from tqdm import tqdm
    from tqdm.std import TqdmDefaultWriteLock

    for _ in tqdm(range(2), disable=False):  # transformers' "Loading weights", vLLM's shards
        pass
    # the lock tqdm took: a multiprocessing one is a sem.mp-* file, unlinked only at a clean exit
    made = getattr(TqdmDefaultWriteLock, "mp_lock", None)
    print(f"rank {rank}: progress bars' multiprocessing lock {made!r}", flush=True)
    if made is not None:
        raise AssertionError(f"a progress bar made a multiprocessing lock in a rank: {made!r}")
    os._exit(9)


def test_a_rank_killed_after_a_progress_bar_leaves_no_semaphore():
    pytest.importorskip("tqdm")
    ranks = run_group(bar_then_killed, 1, init_process_group=False, allow_failure=True, timeout=60)
    assert "exit code 9" in str(ranks[0]), ranks  # killed, after the bar and the check
