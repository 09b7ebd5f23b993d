"""Run a function in a few spawned processes joined by a gloo group, with hard time limits.

    results = run_group(worker_fn, world_size=2, args=(x,), timeout=60)

`worker_fn(rank, world_size, *args)` runs in each child after `init_process_group`
(gloo, a free loopback port, the given timeout on every collective); its return value
comes back in `results[rank]`. A child that raises fails the call with its traceback; a
child still running at the deadline is killed, and so are all the others: no process
is ever left behind. `worker_fn` must be importable (a module-level function). Return plain data: a tensor
returned through the result queue lives in the child's shared memory and is gone once
the child exits (send `torch.save` bytes or lists instead).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from hal.procs import RankFailed, free_port, run_gloo_rank, spawn_ranks

__all__ = ["RankError", "free_port", "run_group"]


def _child(rank: int, out, fn: Callable, world_size: int, port: int, timeout: float, init: bool, args: tuple, env: dict) -> None:
    os.environ.update(env)
    run_gloo_rank(out, rank, world_size, port, timeout, lambda: fn(rank, world_size, *args), init=init)


def run_group(
    fn: Callable,
    world_size: int = 2,
    *,
    args: tuple = (),
    timeout: float = 120.0,
    collective_timeout: float = 30.0,
    init_process_group: bool = True,
    env: dict[str, str] | None = None,
    allow_failure: bool = False,
) -> list[Any]:
    """Run `fn` on `world_size` spawned ranks; returns each rank's result in rank order.

    With `allow_failure`, a rank that raised or died yields `RankError(text)` instead of
    failing the call (for tests of fault handling).
    """
    for attempt in (1, 2):
        port = free_port()
        try:
            results = spawn_ranks(
                _child,
                world_size,
                args=(fn, world_size, port, collective_timeout, init_process_group, args, dict(env or {})),
                timeout_s=timeout,
                on_failure=(lambda rank, text: RankError(text)) if allow_failure else None,
            )
        except RankFailed as exc:
            if attempt == 1 and _rendezvous_failed(str(exc)):
                continue
            raise RuntimeError(f"rank {exc.rank} failed:\n{exc}") from None
        if attempt == 1 and any(isinstance(r, RankError) and _rendezvous_failed(r) for r in results):
            continue
        return results
    raise AssertionError("unreachable")


def _rendezvous_failed(text: str) -> bool:
    """The group could not be set up inside init_process_group, before `fn` ran: gloo's own
    connection set-up (seen 2 times in 5 full-suite runs on 2 cores, "Connection closed by
    peer" at the same test, never alone), or the rendezvous port `free_port` found free was
    taken by another process before rank 0 listened on it (EADDRINUSE, seen once in a full
    run beside other test runs). The group is then made again once, on a fresh port; what the
    tests check starts only after it."""
    in_init = "init_process_group" in text
    return in_init and ("connectFullMesh failed" in text or "EADDRINUSE" in text)


class RankError(str):
    """The traceback text of a rank that raised (only with allow_failure=True)."""
