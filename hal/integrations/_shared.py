"""Small helpers the integrations share. Imports no host project (vLLM, verl, Ray) at import time."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from hal.sync.metrics import SyncMetrics


def in_daemon_thread(name: str, fn: Callable[[], Any]) -> "concurrent.futures.Future[Any]":
    """Run `fn()` in a new daemon thread called `name`; a future of its result.

    Not a ThreadPoolExecutor: its worker threads are joined at interpreter exit, so a call
    that never returns (a dead engine or peer) would hang the caller's exit.
    """
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - surfaced by result()
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def result_within(future: "concurrent.futures.Future[Any]", what: str, timeout: float) -> Any:
    """`future.result(timeout)`; a PeerError naming `what` when it does not come in time."""
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        from hal.sync.errors import PeerError

        raise PeerError(f"{what} did not return within {timeout:.0f} s") from None


def release_of(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as "0.32.1+cpu", or None when it has none."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def import_ray() -> Any:
    """The `ray` module, or ImportError saying which extra installs it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(f"hal.integrations.ray needs Ray: pip install 'verl-hal[ray]' ({exc})") from None
    return ray


@dataclass(slots=True)
class SyncResult:
    """One sync into every engine."""

    version: int
    seconds: float
    """From the call until every engine reports the new version (finish + cache reset included)."""
    metrics: SyncMetrics
    """The sender's metrics (bytes, buckets, transfer and pack time)."""
    engine_versions: dict[str, str] = field(default_factory=dict)
    resent: bool = False
    """The first attempt failed on the trainer's side and this is the resend's result."""
    canary: Any = None
    """The canary's check of this sync (`hal.canary.report.CanaryReport`), None when it did not run."""

    @property
    def gib_per_s(self) -> float:
        return self.metrics.bytes / self.seconds / 2**30 if self.seconds > 0 else 0.0


@contextlib.contextmanager
def keep_stdout() -> Iterator[None]:
    """Restore file descriptor 1 if a gloo group set-up left it on /dev/null.

    vLLM's `init_gloo_process_group` silences fd 1 with a dup2 around the group's
    creation. When the engine's worker runs in this process (single-process mode), its
    set-up and ours run at the same time in two threads, and the second dup2 can save
    /dev/null as "the original": stdout would stay silenced for the rest of the process.
    """
    saved = os.dup(1)
    try:
        yield
    finally:
        try:
            devnull = os.stat(os.devnull)
            if os.path.samestat(os.fstat(1), devnull) and not os.path.samestat(os.fstat(saved), devnull):
                os.dup2(saved, 1)
        finally:
            os.close(saved)
