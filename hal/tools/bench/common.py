"""What the benchmark processes share: units, rank numbers, their resident-memory peak,
and two small adapters to hal.sync's objects.

Used by hal.tools.bench.transfer, hal.tools.bench.delta and hal.tools.bench.device_transfer;
imports nothing of hal (hal.sync's objects are duck-typed here).
"""

from __future__ import annotations

import gc
import os
from typing import Any

GIB = 1024**3
MIB = 1024**2

SENDER, RECEIVER = 0, 1  # RECEIVER: the first receiver (ranks 1..K receive)


# ---------------------------------------------------------------------------------------
# memory accounting from /proc


def _status_kib() -> dict[str, int]:
    fields: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                fields[key] = int(parts[0]) * 1024
    return fields


class PeakMemory:
    """RSS high-water mark of this process since `reset()`, in bytes above the RSS at reset."""

    def __init__(self) -> None:
        self.available = os.path.exists("/proc/self/clear_refs")
        self.baseline = 0

    def reset(self, collect: bool = True) -> None:
        """Take the current RSS as the baseline and start a new peak from it (after a
        gc.collect() unless `collect` is False: the caller just ran one)."""
        if collect:
            gc.collect()
        self.restart_peak()
        self.baseline = _status_kib().get("VmRSS", 0)

    def restart_peak(self) -> None:
        """Reset the high-water mark to the current RSS, keeping the baseline."""
        if self.available:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # "5": reset the peak RSS (VmHWM) to the current RSS
            except OSError:
                self.available = False

    def extra(self) -> int | None:
        if not self.available:
            return None
        return max(0, _status_kib().get("VmHWM", 0) - self.baseline)


# ---------------------------------------------------------------------------------------
# hal.sync's objects


def close(obj: Any) -> None:
    """Close a sender, receiver or transport: its `close()`, else its `shutdown()`, if any."""
    for name in ("close", "shutdown"):
        fn = getattr(obj, name, None)
        if callable(fn):
            fn()
            return


def metrics_dict(metrics: Any) -> dict[str, Any]:
    """A sync's SyncMetrics as a plain dict (empty when there are none)."""
    if metrics is None:
        return {}
    if hasattr(metrics, "as_dict"):
        return dict(metrics.as_dict())
    return {}
