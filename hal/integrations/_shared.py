"""Small helpers the integrations share. Imports no host project (vLLM, verl, Ray) at import time."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from hal.sync.metrics import SyncMetrics


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
