"""The demo's PNG: reward and sync time per step (`write_plot`); with --delta also the
fraction of words changed and the bytes sent against a dense sync, anchors marked; with
--canary-every the canary's max |delta log-prob| at each sync it checked, against its
tolerance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hal.tools.demo_rl import LOGPROB_TOLERANCE


def write_plot(path: Path, steps: list[dict[str, Any]], model_name: str = "Llama") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if steps and "delta" in steps[0]:
        write_delta_plot(path, steps, model_name, plt)
        return
    xs = [s["step"] for s in steps]
    canary = bool(steps) and "canary_max_abs" in steps[0]
    fig, axes = plt.subplots(3 if canary else 2, 1, figsize=(7, 8.5 if canary else 6), sharex=True)
    ax1, ax2 = axes[0], axes[1]
    ax1.plot(xs, [s["reward"] for s in steps], marker="o")
    ax1.set_ylabel("reward (target-token fraction)")
    ax1.set_title(f"hal demo: RL on a tiny {model_name}, trainer -> live vLLM engine")
    ax1.grid(alpha=0.3)
    ax2.bar(xs, [s["sync_seconds"] * 1000 for s in steps], color="tab:orange")
    ax2.set_ylabel("sync (ms)")
    ax2.grid(alpha=0.3)
    if canary:
        canary_axis(axes[2], steps)
    axes[-1].set_xlabel("step (= weight version)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_delta_plot(path: Path, steps: list[dict[str, Any]], model_name: str, plt: Any) -> None:
    """Reward, fraction changed, bytes sent against dense, sync time: anchors marked."""
    from matplotlib.ticker import MaxNLocator

    xs = [s["step"] for s in steps]
    anchors = [s["step"] for s in steps if not s["delta"]]
    colors = ["tab:gray" if not s["delta"] else "tab:blue" for s in steps]
    canary = "canary_max_abs" in steps[0]
    fig, axes = plt.subplots(5 if canary else 4, 1, figsize=(7, 12.5 if canary else 10), sharex=True)
    ax1, ax2, ax3, ax4 = axes[:4]
    ax1.plot(xs, [s["reward"] for s in steps], color="tab:blue", zorder=1)
    outcomes = (
        (True, "o", "tab:green", f"engine = trainer (greedy tokens; log-probs within {LOGPROB_TOLERANCE:g})"),
        (False, "X", "tab:red", "engine DIFFERS from trainer"),
    )
    for matched, marker, color, label in outcomes:
        picked = [s for s in steps if (s["outputs_match"] and s["logprob_gap"] <= LOGPROB_TOLERANCE) is matched]
        if picked:
            ax1.scatter([s["step"] for s in picked], [s["reward"] for s in picked], marker=marker, color=color, label=label, zorder=2)
    ax1.legend(loc="upper left", fontsize=8)
    ax1.set_ylabel("reward (target-token fraction)")
    ax1.set_title(f"hal demo --delta: RL on a tiny {model_name}, trainer -> live vLLM engine")
    fractions = [s["changed_fraction"] for s in steps]
    ax2.bar([x for x, f in zip(xs, fractions) if f is not None], [100 * f for f in fractions if f is not None], color="tab:blue")
    ax2.set_ylabel("words changed (%)")
    ax2.set_ylim(0, 100)
    ax3.plot(xs, [s["dense_wire_bytes"] / 2**10 for s in steps], color="black", linestyle="--", label="dense sync")
    ax3.bar(xs, [s["wire_bytes"] / 2**10 for s in steps], color=colors, label="sent (gray: anchor)")
    ax3.set_ylabel("bytes sent (KiB)")
    ax3.set_ylim(bottom=0)
    ax3.legend(loc="lower right", fontsize=8)
    ax4.bar(xs, [s["sync_seconds"] * 1000 for s in steps], color=colors)
    ax4.set_ylabel("sync (ms)")
    if canary:
        canary_axis(axes[4], steps)
    axes[-1].set_xlabel("step (= weight version); gray bars and dotted lines: whole (anchor) syncs")
    ax4.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes:
        ax.grid(alpha=0.3)
        for a in anchors:
            ax.axvline(a, color="tab:gray", linestyle=":", linewidth=1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def canary_axis(ax: Any, steps: list[dict[str, Any]]) -> None:
    """The canary's max |delta log-prob| at each sync it checked (log scale; red where it
    fired), and its tolerance as a dashed line."""
    checked = [s for s in steps if s.get("canary_max_abs") is not None]
    floor = 1e-9  # a zero difference still shows on the log scale
    for fired, color, label in ((False, "tab:green", "canary quiet"), (True, "tab:red", "canary FIRED")):
        picked = [s for s in checked if bool(s["canary_fired"]) is fired]
        if picked:
            ax.scatter([s["step"] for s in picked], [max(s["canary_max_abs"], floor) for s in picked], color=color, label=label, zorder=2)
    tolerances = sorted({s["canary_tolerance"] for s in checked})
    for tolerance in tolerances:
        ax.axhline(tolerance, color="tab:gray", linestyle="--", linewidth=1, label=f"tolerance {tolerance:g}")
    ax.set_yscale("log")
    ax.set_ylabel("canary: max |Δ log-prob|")
    if checked:
        ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
