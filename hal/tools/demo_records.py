"""What `hal demo` records per step beside the reward: the delta sync's numbers, the
canary's, and how a table cell shows them."""

from __future__ import annotations

from typing import Any


DELTA_KEYS = ("delta", "changed_fraction", "wire_bytes", "dense_wire_bytes", "segments_by_encoding", "logprob_gap")
CANARY_KEYS = ("canary_max_abs", "canary_tolerance", "canary_fired")


def canary_record(report: Any) -> dict[str, Any]:
    """The canary fields of a step (None where the canary did not run at this sync)."""
    if report is None:
        return {"canary_max_abs": None, "canary_tolerance": None, "canary_fired": None}
    return {"canary_max_abs": report.max_abs, "canary_tolerance": report.tolerance, "canary_fired": report.fired}


def canary_cell(record: dict[str, Any]) -> str:
    """The canary column: the max |delta log-prob|, '-' where it did not run, '!' where it fired."""
    if record.get("canary_max_abs") is None:
        return "-" if record.get("canary_fired") is None else "failed!"
    return f"{record['canary_max_abs']:.1e}" + ("!" if record["canary_fired"] else "")


def delta_record(metrics: Any) -> dict[str, Any]:
    """The delta fields of a sync's `SyncMetrics` for the per-step record."""
    return {
        "delta": bool(metrics.delta),
        "changed_fraction": metrics.changed_fraction,
        "wire_bytes": metrics.wire_bytes,
        "dense_wire_bytes": metrics.dense_wire_bytes,
        "segments_by_encoding": dict(metrics.segments_by_encoding or {}),
    }


def median(values: list[float]) -> float:
    """The upper median, as the summary line has always printed it."""
    return sorted(values)[len(values) // 2]
