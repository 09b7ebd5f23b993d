"""What `hal bench --engine vllm` prints and reports of its runs: the summary table and
the canary's cost per probe shape."""

from __future__ import annotations

import statistics
from typing import Any


GIB = 1024**3
MIB = 1024**2


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def canary_summary(runs: list[Any], shape: tuple[int, int], sync_seconds: float | None, first: Any = None) -> dict[str, Any]:
    """The canary's cost from the measured rounds: medians, and its share of a sync's time;
    `first`: the first check of the run (a warm-up round's), whose time is `first_seconds`."""
    xs = [r.seconds for r in runs]
    engine_s = [s for s in (next(iter(r.engines.values())).seconds for r in runs) if s is not None]
    out: dict[str, Any] = {
        "probe": f"{shape[0]}x{shape[1]}",
        "probe_tokens": runs[0].probe_tokens if runs else None,
        "seconds": median(xs) if xs else None,
        "all_seconds": xs,
        "reference_seconds": median([r.reference_s for r in runs]) if runs else None,
        "engine_seconds": median(engine_s) if engine_s else None,
        "max_abs": max((r.max_abs for r in runs), default=None),
        "tolerance": runs[0].tolerance if runs else None,
        "fired": any(r.fired for r in runs),
        "first_seconds": first.seconds if first is not None else None,
    }
    if xs and sync_seconds:
        out["over_sync"] = out["seconds"] / sync_seconds
        out["every_10_over_sync"] = out["seconds"] / (10 * sync_seconds)
        out["every_100_over_sync"] = out["seconds"] / (100 * sync_seconds)
    return out


def bytes_line(r: dict[str, Any], receive: str) -> str:
    """Bytes into each engine worker, out of the trainer rank, over its largest link (MiB)."""
    workers = ", ".join("?" if b is None else f"{b / MIB:.3f}" for b in r["worker_bytes"])
    link = "none (whole tensors)" if r.get("largest_link_bytes") is None else f"{r['largest_link_bytes'] / MIB:.3f} MiB"
    return f"receive {receive}: into each engine worker [{workers}] MiB; out of the trainer {r['sender_bytes'] / MIB:.3f} MiB; largest link {link}"


def print_summary(report: dict[str, Any]) -> None:
    print(
        f"[bench vllm] {report['bytes'] / GIB:.3f} GiB in {report['tensors']} tensors; {report['timing']}; "
        f"'hal' = {report['transport']} transport, {report['bucket_bytes'] / MIB:g} MiB buckets; engine {'multi-process' if report['multiprocess_engine'] else 'in-process'}"
        f", tensor parallel {report.get('engine_tp', 1)}, receive {report.get('receive', 'whole')}; "
        f"load average {report['load_average'][0]:.1f}"
    )
    for r in report["results"]:
        print(f"  {r['method']:<12} {r['seconds']:>7.3f} s  ({r['gib_per_s']:.2f} GiB/s, best {r['min_seconds']:.3f} s)")
    for cfg, r in report["hal_by_config"].items():
        print(f"  {cfg:<18} {r['seconds']:>7.3f} s  ({r['buckets']} buckets; worker: apply {r['receiver_apply_seconds']:.3f} s "
              f"of {r['receiver_total_seconds']:.3f} s; sender waited {r['sender_transfer_seconds']:.3f} s on the transport)")
        if r.get("worker_bytes") is not None:
            print("  " + " " * 18 + f"          {bytes_line(r, report.get('receive', 'whole'))}")
    if report["apply_seconds"] is not None:
        print(f"  {'apply':<12} {report['apply_seconds']:>7.3f} s  (engine reload_weights from memory)")
    if report["floor_seconds"] is not None:
        print(f"  {'floor':<12} {report['floor_seconds']:>7.3f} s  (one flat broadcast trainer -> worker)")
    if report["memcpy_seconds"] is not None:
        print(f"  {'memcpy':<12} {report['memcpy_seconds']:>7.3f} s  (one copy of all bytes in the trainer: the ipc transport's floor)")
    targets = {"disk_reload_over_hal": ">= 2.5", "rpc_bytes_over_hal": ">= 10", "hal_over_max_floor_apply": "<= 1.3"}
    print("  " + ", ".join(f"{k} {v:.2f} (target {targets[k]})" for k, v in report["ratios"].items()), flush=True)
    for canary in report.get("canary") or ():
        if canary["seconds"] is None:
            continue
        share = (f"; {100 * canary['over_sync']:.0f}% of a sync at every sync, {100 * canary['every_10_over_sync']:.1f}% at every 10th, "
                 f"{100 * canary['every_100_over_sync']:.2f}% at every 100th (the default) "
                 "(targets: <= 0.1 s, <= 10% at every 10th)") if "over_sync" in canary else ""
        if canary.get("first_seconds") is not None:
            share += f"; the first check {canary['first_seconds']:.3f} s"
        print(f"  {'canary':<12} {canary['seconds']:>7.3f} s  ({canary['probe']} probe, {canary['probe_tokens']} log-probs; trainer "
              f"{canary['reference_seconds']:.3f} s, engine {canary['engine_seconds']:.3f} s, at once; max |delta| "
              f"{canary['max_abs']:.1e} within {canary['tolerance']:g}{', FIRED' if canary['fired'] else ''}){share}", flush=True)
