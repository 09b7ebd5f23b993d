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

import datetime
import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable, rank: int, world_size: int, port: int, timeout: float, init: bool, args: tuple, env: dict, out) -> None:
    os.environ.update(env)
    try:
        if init:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
        result = fn(rank, world_size, *args)
        out.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - reported to the parent whatever it is
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if init:
            try:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:
                pass


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
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, port, collective_timeout, init_process_group, args, dict(env or {}), out),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        import queue
        import time

        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout} s")
            try:
                rank, status, value = out.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and not p.is_alive() and p.exitcode not in (0, None)]
                if dead and not allow_failure:
                    raise RuntimeError(f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}")
                for r in dead:
                    results[r] = RankError(f"rank {r} died with exit code {procs[r].exitcode}")
                continue
            if status == "error":
                if not allow_failure:
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                value = RankError(value)
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results[r] for r in range(world_size)]


class RankError(str):
    """The traceback text of a rank that raised (only with allow_failure=True)."""
