"""Threads that never hold up a process's exit, and bounded waits for their results.

hal.sync's trainer side joins its sync group in one (hal.sync.endpoints.TrainerSide); the
integrations call engines in them (hal.integrations._shared re-exports both helpers).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable


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
