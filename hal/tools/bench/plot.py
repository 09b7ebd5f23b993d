"""A PNG bar chart of a `hal bench` report: seconds per method, floor marked, GiB/s labelled
(and, with several receivers or nodes, the models each sync put on the network)."""

from __future__ import annotations

from typing import Any


def plot_results(report: dict[str, Any], path: str) -> None:
    """Write `report["results"]` as a horizontal bar chart to `path` (PNG, matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    results = report["results"]
    methods = [r["method"] for r in results]
    seconds = [float(r["seconds"]) for r in results]
    floor = next((r["seconds"] for r in results if r["method"] == "floor"), None)
    topology = report.get("receivers", 1) > 1 or report.get("nodes", 1) > 1

    fig, ax = plt.subplots(figsize=(8, 0.55 * len(results) + 1.6))
    try:
        colors = ["#777777" if m.startswith("floor") else "#4c72b0" if m.startswith("hal_") else "#dd8452" for m in methods]
        bars = ax.barh(methods, seconds, color=colors)
        ax.invert_yaxis()
        for bar, r in zip(bars, results):
            label = f" {r['seconds']:.3f} s"
            if r.get("gib_per_s"):
                label += f", {r['gib_per_s']:.2f} GiB/s"
            if r.get("ratio_to_floor"):
                label += f", {r['ratio_to_floor']:.2f}x"
            if topology and r.get("network_bytes_per_sync") is not None and report.get("bytes"):
                label += f", {r['network_bytes_per_sync'] / report['bytes']:.2f} models on the network"
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, label, va="center", fontsize=8,
                    bbox=dict(facecolor="white", edgecolor="none", alpha=0.8, pad=1))
        if floor:
            ax.axvline(floor, color="#333333", linestyle="--", linewidth=1)
            ax.axvline(1.25 * floor, color="#c44e52", linestyle=":", linewidth=1, label="1.25x floor")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_xlim(0, max(seconds) * 1.6)
        ax.set_xlabel("seconds per sync (lower is better)")
        size = f"{report['bytes'] / 1024**3:.2f} GiB, " if "bytes" in report else ""
        where = f", {report['receivers']} receivers on {report['nodes']} node(s)" if topology else ""
        ax.set_title(f"hal bench: {report.get('preset', '?')} ({size}{report.get('timing', '')}{where})", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110, format="png")
    finally:
        plt.close(fig)
