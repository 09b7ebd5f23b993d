"""The transfer benchmark's result table (`hal bench` prints it after a run)."""

from __future__ import annotations

from typing import Any

from hal.tools.bench.common import GIB, MIB
from hal.tools.bench.transfer_config import TOPOLOGY_METHODS


def _layout(report: dict[str, Any]) -> str:
    """ "scattered " when each tensor had its own allocation (--layout), else nothing."""
    return "scattered " if report["config"].get("layout", "flat") == "scattered" else ""


def format_table(report: dict[str, Any]) -> str:
    """The result table as text (with network bytes and per-rank columns once there are
    several receivers or nodes, or a topology method ran)."""
    if report.get("receivers", 1) > 1 or report.get("nodes", 1) > 1 or any(r["method"] in TOPOLOGY_METHODS for r in report["results"]):
        return _format_topology_table(report)
    lines = [
        f"preset {report['preset']}: {report['bytes'] / GIB:.3f} GiB in {report['tensors']} {_layout(report)}tensors; "
        f"bucket {report['config']['bucket_bytes'] / MIB:g} MiB; {report['timing']}; "
        f"{report['torch_threads_per_process']} torch thread(s) per process; hal syncs on {report['config'].get('sync_backend', 'cpu')}",
        f"{'method':<18} {'seconds':>8} {'best':>8} {'GiB/s':>7} {'x floor':>8} {'peak extra MiB':>15} "
        f"{'(send / recv)':>14} {'cpu s (send / recv)':>20} {'host us/tensor (send / recv)':>29}",
    ]
    for r in report["results"]:
        ratio = "-" if r["ratio_to_floor"] is None else f"{r['ratio_to_floor']:.2f}"

        def mib(v: int | None) -> str:
            return "n/a" if v is None else f"{v / MIB:.0f}"

        lines.append(
            f"{r['method']:<18} {r['seconds']:>8.3f} {r['best_seconds']:>8.3f} {r['gib_per_s']:>7.2f} {ratio:>8} "
            f"{mib(r['peak_extra_bytes']):>15} {'(' + mib(r['sender_peak_extra_bytes']) + ' / ' + mib(r['receiver_peak_extra_bytes']) + ')':>14} "
            f"{r['sender_cpu_s']:>9.3f} / {r['receiver_cpu_s']:<8.3f} {_host_per_tensor(r):>29}"
        )
    return "\n".join(lines)


def _host_per_tensor(result: dict[str, Any]) -> str:
    """A hal method's host time per tensor at the sender and the receiver (SyncMetrics.host_s
    over its tensors, medians); "-" for the methods that are not hal syncs."""
    send = (result.get("sender_metrics") or {}).get("host_us_per_tensor")
    recv = (result.get("receiver_metrics") or {}).get("host_us_per_tensor")
    if send is None and recv is None:
        return "-"
    return " / ".join("n/a" if v is None else f"{v:.1f}" for v in (send, recv))


def _format_topology_table(report: dict[str, Any]) -> str:
    def mib(v: int | None) -> str:
        return "n/a" if v is None else f"{v / MIB:.0f}"

    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    k, n = report.get("receivers", 1), report.get("nodes", 1)
    lines = [
        f"preset {report['preset']}: {report['bytes'] / GIB:.3f} GiB in {report['tensors']} {_layout(report)}tensors; "
        f"bucket {report['config']['bucket_bytes'] / MIB:g} MiB; {report['timing']}; "
        f"{report['torch_threads_per_process']} torch thread(s) per process",
        f"{k} receiver(s) on {n} node(s) {report.get('node_keys', [])[1:]} + the sender ({report.get('processes', k + 1)} processes); "
        f"leaders {report.get('node_leaders')}; one sync's segment bytes {report.get('segment_bytes_per_sync', 0) / GIB:.3f} GiB",
        f"{'method':<18} {'seconds':>8} {'best':>8} {'x floor':>8} {'x leaders':>9} {'net GiB':>8} {'models':>6} "
        f"{'peak MiB':>8}  {'per rank (send, recv...)':<24} {'cpu s per rank':<24} verified",
    ]
    for r in report["results"]:
        net = r.get("network_bytes_per_sync")
        per_rank = "/".join(mib(v) for v in r.get("peak_extra_bytes_per_rank", []))
        cpu = "/".join(f"{v:.2f}" for v in r.get("cpu_s_per_rank", []))
        net_gib = "n/a" if net is None else f"{net / GIB:.3f}"
        models = "n/a" if net is None else f"{net / report['bytes']:.2f}"
        lines.append(
            f"{r['method']:<18} {r['seconds']:>8.3f} {r['best_seconds']:>8.3f} {ratio(r['ratio_to_floor']):>8} "
            f"{ratio(r.get('ratio_to_floor_leaders')):>9} {net_gib:>8} "
            f"{models:>6} {mib(r['peak_extra_bytes']):>8}  {per_rank:<24} {cpu:<24} "
            f"{','.join(map(str, r.get('verified_ranks', []))) or '-'}"
        )
    return "\n".join(lines)
