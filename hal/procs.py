"""Spawn a few rank processes, collect what each reports, and leave none behind.

Used by `hal bench` and by the test suite's multi-process runner. Each child runs
`target(rank, out, *args)` and must put exactly one `(rank, "ok" | "error", value)` on
`out`, a pipe of its own (`RankReport`): a multiprocessing Queue would create named
semaphores in /dev/shm, left there when the parent is killed before it frees the queue. A
child still running at the deadline is killed, and so are the others.

Ranks are forked from a fork server that has imported torch and hal once (multiprocessing's
"forkserver"): a rank starts in tens of milliseconds instead of the seconds a fresh
interpreter spends importing torch, and the test suite starts hundreds. The server only
imports, so no thread pool exists when it forks (what makes a plain fork unsafe after torch
has run). Each rank gets the caller's environment as it is at the call, as a spawned one
would (the server itself was started with the environment of its first use).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import socket
from multiprocessing.connection import Connection, wait
import time
from typing import Any, Callable, Iterable


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for a rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# What the fork server imports before it forks any rank.
PRELOAD = ("torch", "torch.distributed", "hal", "hal.sync")


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # no effect once the server runs: it has them
    return ctx


def _with_environ(environ: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(environ)
    _thread_lock_for_progress_bars()
    target(*args)


def _thread_lock_for_progress_bars() -> None:
    """tqdm (transformers' and vLLM's progress bars) takes a multiprocessing lock at its first
    bar: in a forked-from-server rank that is a named semaphore in /dev/shm, which a rank
    killed part-way (os._exit, SIGKILL) leaves behind until the server exits. A rank's bars
    need no lock across processes: a thread lock instead, before any bar is made."""
    try:
        import threading

        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def run_gloo_rank(out: Any, rank: int, world_size: int, port: int, timeout_s: float, body: Callable[[], Any], *, init: bool = True) -> None:
    """A rank's whole life under `spawn_ranks`: join the gloo group of `world_size` on
    127.0.0.1:`port` (every collective bounded by `timeout_s`; skipped without `init`),
    run `body()`, and put its value, or the traceback of whatever it raised, on `out`.
    The group is destroyed whatever happened."""
    import datetime
    import traceback

    import torch.distributed as dist

    try:
        if init:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        out.put((rank, "ok", body()))
    except BaseException:  # noqa: BLE001 - reported to the parent whatever it is
        out.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


class RankReport:
    """Where a rank puts its one report: the sending end of a pipe to its parent."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def put(self, report: tuple[int, str, Any]) -> None:
        self.connection.send(report)


class RankFailed(RuntimeError):
    """A rank raised or died; `rank` says which, the message carries its traceback."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def spawn_ranks(
    target: Callable[..., None],
    world_size: int,
    *,
    args: tuple = (),
    timeout_s: float,
    label: str = "rank",
    on_failure: Callable[[int, str], Any] | None = None,
) -> list[Any]:
    """Run `target` in `world_size` processes (forked from the fork server); each rank's value, in rank order.

    A rank that reports an error, or dies without reporting, raises `RankFailed` unless
    `on_failure(rank, text)` is given, whose return value then stands for that rank.
    Past `timeout_s` raises TimeoutError. Every child is joined or killed before return.
    """
    ctx = _context()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_with_environ, args=(environ, target, rank, RankReport(pipes[rank][1]), *args), daemon=True, name=f"{label}{rank}")
        for rank in range(world_size)
    ]
    results: dict[int, Any] = {}

    def failed(rank: int, text: str) -> None:
        if on_failure is None:
            raise RankFailed(rank, text)
        results[rank] = on_failure(rank, text)

    try:
        for p in procs:
            p.start()
        for _, sending in pipes:
            sending.close()  # the child's end: a child that dies closes the pipe for good
        waiting = {receiving: rank for rank, (receiving, _) in enumerate(pipes)}
        deadline = time.monotonic() + timeout_s
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(waiting.values())
                raise TimeoutError(f"{label}s {missing} did not finish within {timeout_s:g} s")
            for receiving in wait(list(waiting), timeout=remaining):
                rank = waiting.pop(receiving)
                try:
                    _, status, value = receiving.recv()
                except EOFError:  # it ended without a report
                    procs[rank].join(timeout=5)
                    failed(rank, f"{label} {rank} died with exit code {procs[rank].exitcode}")
                    continue
                if status == "error":
                    failed(rank, value)
                else:
                    results[rank] = value
    finally:
        for p in procs:
            if p.pid is not None:
                p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for receiving, sending in pipes:
            receiving.close()
            sending.close()
        # what a rank's device runtime left in /dev/shm: a killed rank runs no exit code
        remove_ended_process_files(p.pid for p in procs if p.pid is not None and not p.is_alive())
    return [results[r] for r in range(world_size)]


@functools.cache
def _declared_formats() -> tuple[str, ...]:
    """torch's counters and every backend's `process_files`, read once per process (the
    backends' entry points are scanned to list them: about 20 ms)."""
    from hal.backends.process_files import TORCH_COUNTERS
    from hal.device import backend_class, backend_names

    formats = {TORCH_COUNTERS}
    for name in backend_names():
        with contextlib.suppress(Exception):  # a backend that cannot load declares nothing
            formats.update(getattr(backend_class(name), "process_files", ()))
    return tuple(sorted(formats))


def remove_ended_process_files(pids: Iterable[int]) -> list[str]:
    """Unlink what processes that have ended left in /dev/shm (hal.backends.process_files):
    torch's reference counters and every backend's declared `process_files`."""
    from hal.backends.process_files import remove_process_files

    removed = []
    for pid in pids:
        removed += remove_process_files(pid, _declared_formats())
    return removed
