"""`hal bench --delta`: delta sync under an RL-like update, against dense sync and the floor.

    hal bench --delta --preset qwen2.5-0.5b --lrs 1e-6,1e-5 --syncs 8 --json delta.json

One sender and one receiver process joined by gloo (the process setup of
hal.tools.bench.transfer). For each learning rate, from the same initial weights:

- The sender holds fp32 master weights shaped like the preset (matrices and biases
  N(0, `init_std`), norm weights 1.0) and a `torch.optim.Adam` at that learning rate.
- Before every sync but the first, one Adam step on random gradients (N(0, `grad_std`),
  fresh every step): an RL-like update between syncs. The optimizer steps one parameter
  at a time (Adam is elementwise, so this is the same update as one step over all of
  them, without holding every gradient at once). Not timed.
- Every sync then runs four methods, in an order that rotates from sync to sync:
    floor         one broadcast of one flat tensor holding the weights already cast to the
                  wire dtype (cast outside the timed region): the transport's floor.
    hal_bucketed  hal's dense sync: Sender(SyncConfig(wire_dtype=...)) of the fp32 master
                  weights (the cast happens in the pack) into the receiver's destinations
                  through `copy_into`.
    hal_delta_bytes  the same with `SyncConfig(delta=DeltaConfig(choose="bytes"))`: the
                  first sync is a whole one (the anchor), later ones send per segment only
                  the words that changed (by index or bitmask) when that is smaller.
    hal_delta_time   the same with `DeltaConfig(choose="time")` (the default): deltas only
                  while they make syncs faster (docs/delta.md, "Choosing by time").
  Each is timed from a barrier (taken after the untimed RSS reset and, at the first
  sync, the set-up): the latest end minus the earliest start over both ranks.
- Outside the timed region the receiver checks that the bytes `hal_bucketed` and both
  delta methods left in their destinations equal the bytes the floor delivered (libc
  memcmp), every sync; then it zeroes the dense destinations (the next dense sync must
  write them all again). The deltas' destinations are never cleared: a delta sync writes
  only what changed.

With `link_gb_per_s` (`--link-gbps`) every method's sends go over an emulated link of that
rate (`_Link` in hal.tools.bench.delta_rank: the bytes count as arrived at that rate, overlapping the work around them):
to see what each choice does where the wire costs more than loopback. An emulation.

Reported per learning rate, over the steady-state syncs (those where `hal_delta_bytes`
carried deltas; the anchor is reported on its own): for `hal_delta_bytes` the changed
fraction, wire bytes against dense, segments by encoding, the sender's encode time, the
receiver's apply time, its ratio to `hal_bucketed` and to `floor` (medians of same-sync
ratios, and the ratio of sums); for `hal_delta_time` (`by_time`) what it chose per sync,
its bytes and its ratios to `hal_bucketed`; every method's seconds, the baseline each
side keeps (`baseline_bytes`) and the resident memory each method added (RSS high-water
mark, as in hal.tools.bench.transfer: at set-up plus the anchor sync, and per steady sync). Then, for lr 1e-6 and 1e-5, the verdicts against
issue 11's targets (`TARGETS`), and for every lr a wire-bound projection
(`wire_bound_projection`: computed from the measured bytes and CPU times, not measured).

The code: hal.tools.bench.delta_config (the method names, `DeltaBenchConfig`),
hal.tools.bench.delta_rank (one rank: master weights, Adam, each method's objects, the
emulated link, the timed syncs and the byte check), hal.tools.bench.delta_report (the
summaries, `TARGETS` and their verdicts, the projection, the table); this module spawns
the two ranks and collects one summary per learning rate.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from hal.procs import free_port, spawn_ranks
from hal.tools.bench.common import RECEIVER, SENDER
from hal.tools.bench.delta_config import DeltaBenchConfig
from hal.tools.bench.delta_rank import rank_main
from hal.tools.bench.delta_report import summarize_lr
from hal.tools.bench.presets import get_preset


def run_delta(config: DeltaBenchConfig) -> dict[str, Any]:
    """Run the delta benchmark; returns {"preset", "config", "results": [per-lr summary]}."""
    began = time.perf_counter()

    def role_failed(rank: int, text: str) -> None:
        raise RuntimeError(f"hal bench --delta: the {'sender' if rank == SENDER else 'receiver'} (rank {rank}) failed:\n{text}")

    try:
        reports = spawn_ranks(rank_main, 2, args=(free_port(), config), timeout_s=config.timeout_s, label="hal-bench-delta-rank", on_failure=role_failed)
    except TimeoutError as exc:
        raise TimeoutError(f"hal bench --delta: {exc}") from None
    results = [summarize_lr(config, s, r) for s, r in zip(reports[SENDER]["lrs"], reports[RECEIVER]["lrs"])]
    params = get_preset(config.preset).params()
    cfg = asdict(config)
    cfg["wire_dtype"] = str(config.wire_dtype)
    cfg["lrs"] = list(config.lrs)
    return {
        "preset": config.preset,
        "mode": "delta",
        "tensors": len(params),
        "parameters": sum(_numel(p.shape) for p in params),
        "wire_bytes_total": reports[SENDER]["lrs"][0]["total_bytes"],
        "fused_adam": reports[SENDER]["lrs"][0]["fused_adam"],
        "config": cfg,
        "timing": f"median over the steady-state syncs of {config.syncs} per lr; anchor reported apart"
        + (f"; EMULATED link of {config.link_gb_per_s:g} GB/s" if config.link_gb_per_s else ""),
        "wall_s": time.perf_counter() - began,
        "pids": [r["pid"] for r in reports],
        "results": results,
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
