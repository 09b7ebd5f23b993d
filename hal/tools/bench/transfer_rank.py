"""One rank of the transfer benchmark: the process `run_transfer` spawns per rank.

It lays out the weights (the sender's filled with the byte pattern, the receivers'
destinations zeroed), sets up every method and runs its warm-up repetitions (memory
measured there), then the measured repetitions in interleaved rounds, checking the
receivers' bytes after each; it returns its timings, CPU times, memory peaks and metrics.
hal.tools.bench.transfer's docstring describes the timing, CPU and memory measurement.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hal.procs import run_gloo_rank
from hal.tools.bench.buffers import fill_pattern, first_mismatch, flat_layout, flat_views, matches_pattern
from hal.tools.bench.common import SENDER, PeakMemory
from hal.tools.bench.presets import get_preset
from hal.tools.bench.transfer_config import TransferConfig, fills, node_keys, writes_tensors
from hal.tools.bench.transfer_methods import SETUPS, RankContext


def rank_main(rank: int, out: Any, port: int, config: TransferConfig) -> None:
    # This process's simulated node, before any transport exists (HierarchicalTransport
    # reads it at construction; the other methods ignore it).
    os.environ["VERL_HAL_NODE"] = node_keys(config.receivers, config.nodes)[rank]
    torch.set_num_threads(config.threads)
    world_size = 1 + config.receivers
    run_gloo_rank(out, rank, world_size, port, config.collective_timeout_s, lambda: _rank_body(rank, config))


@dataclass(slots=True)
class _MethodState:
    ctx: RankContext
    run: Callable[[], None]
    teardown: Callable[[], None]
    peak_extra: int | None = None
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    verified: int = 0  # repetitions whose bytes this rank checked


def _rank_body(rank: int, config: TransferConfig) -> dict[str, Any]:
    import dataclasses

    import torch.distributed as dist

    began = time.perf_counter()
    params = get_preset(config.preset).params()
    offsets, total = flat_layout(params)
    flat = torch.empty(total, dtype=torch.uint8)
    if rank == SENDER:
        fill_pattern(flat)
    else:
        flat.zero_()  # touch every page now, so it is part of the baseline
    views = flat_views(flat, params, offsets)
    scattered = config.layout == "scattered"
    tensors = [v.clone() for v in views] if scattered else views  # scattered: each its own allocation, the same bytes
    base = RankContext(rank=rank, config=config, params=params, flat=flat, tensors=tensors)
    memory = PeakMemory()
    report: dict[str, Any] = {
        "rank": rank,
        "pid": os.getpid(),
        "node": os.environ.get("VERL_HAL_NODE"),
        "total_bytes": total,
        "tensors": len(params),
        "storages": len({t.untyped_storage().data_ptr() for t in tensors}),  # 1 flat, one a tensor scattered
        "methods": {},
    }
    report["setup_wall_s"] = time.perf_counter() - began

    def one(method: str, state: _MethodState, label: str) -> tuple[float, float, float]:
        # the bench's own garbage (its checks, the earlier methods') is collected outside
        # the timed region, as timeit does: a collection it set off would land in a sync
        gc.collect()
        dist.barrier()
        state.ctx.trace.clear()
        c0 = time.process_time()
        t0 = time.perf_counter()
        state.run()
        t1 = time.perf_counter()
        c1 = time.process_time()
        # Every rank out of the timed region before any checks or clears its bytes: with
        # several receivers, one that finished early would otherwise memcmp and zero
        # 0.9 GiB on the shared cores while the others still receive.
        dist.barrier()
        if rank != SENDER:
            gather = scattered and writes_tensors(method)
            if config.verify and fills(method, rank, config):
                if gather:  # checked where the pattern is laid out: the flat buffer
                    torch._foreach_copy_(views, tensors)
                if not matches_pattern(flat):
                    raise RuntimeError(
                        f"{method}: {label}: parameter {first_mismatch(flat, params, offsets)!r} arrived with wrong bytes at rank {rank}"
                    )
                state.verified += 1
            flat.zero_()  # the next repetition must write every byte again
            if gather:
                torch._foreach_zero_(tensors)
        return t0, t1, c1 - c0

    states: dict[str, _MethodState] = {}
    try:
        # Phase 1, one method at a time: create its objects and run its warm-up syncs, with
        # the RSS peak measured from just before the objects existed. Earlier methods'
        # objects stay alive; they are part of the baseline, not of this method's peak.
        for method in config.methods:
            dist.barrier()
            memory.reset()
            ctx = dataclasses.replace(base, metrics=[], trace=[])
            run, teardown = SETUPS[method](ctx)
            state = states[method] = _MethodState(ctx, run, teardown)
            peaks = []
            for i in range(max(1, config.warmup)):
                one(method, state, f"warm-up {i}")
                peaks.append(memory.extra())
                memory.restart_peak()  # the byte check's temporaries are not the sync's
            state.peak_extra = None if None in peaks else max(peaks)
            state.ctx.metrics.clear()
        # Phase 2, interleaved: round r runs every method once, starting at method r, so
        # the load of this shared machine falls on all methods alike.
        n = len(config.methods)
        for r in range(config.repeats):
            for method in config.methods[r % n :] + config.methods[: r % n]:
                state = states[method]
                t0, t1, cpu = one(method, state, f"round {r}")
                state.starts.append(t0)
                state.ends.append(t1)
                state.cpu.append(cpu)
    finally:
        for state in states.values():
            state.teardown()
    for method, state in states.items():
        report["methods"][method] = {
            "starts": state.starts,
            "ends": state.ends,
            "peak_extra_bytes": state.peak_extra,
            "cpu_s": state.cpu,
            "metrics": state.ctx.metrics,
            "verified": state.verified,
            "network_bytes": state.ctx.network,
        }
        if config.trace and state.ctx.trace:
            origin = state.starts[-1]
            report["methods"][method]["trace"] = [(nm, a, t0 - origin, t1 - origin) for nm, a, t0, t1 in state.ctx.trace]
    dist.barrier()
    return report
