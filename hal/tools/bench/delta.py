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
rate (`_Link`: the bytes count as arrived at that rate, overlapping the work around them):
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
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from hal.tools.bench.presets import Param, get_preset
from hal.tools.bench.buffers import bytes_equal as _bytes_equal, flat_layout as _layout, flat_views as _views
from hal.tools.bench.common import GIB, MIB, RECEIVER, SENDER, PeakMemory, close as _close, metrics_dict as _metrics_dict
from hal.procs import free_port, run_gloo_rank, spawn_ranks

METHODS = ("floor", "hal_bucketed", "hal_delta_bytes", "hal_delta_time")
DELTA_METHODS = {"hal_delta_bytes": "bytes", "hal_delta_time": "time"}
"""The two delta methods and their `DeltaConfig.choose`."""
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# The issue's targets (issue 11, item 6), by learning rate: the steady-state median
# wire bytes and seconds of a delta method over dense hal_bucketed (same-sync ratios).
TARGETS: dict[float, dict[str, float]] = {
    1e-6: {"bytes_ratio_max": 0.12, "time_ratio_max": 0.6},
    1e-5: {"time_ratio_max": 1.05},
}


@dataclass(kw_only=True, slots=True)
class DeltaBenchConfig:
    """What one `run_delta` call measures."""

    preset: str = "qwen2.5-0.5b"
    """A name from hal.tools.bench.presets.PRESETS: the shapes of the fp32 master weights."""
    lrs: tuple[float, ...] = (1e-6, 1e-5)
    """Adam learning rates; each runs from the same initial weights with fresh objects."""
    syncs: int = 8
    """Syncs per learning rate after the first (the anchor), each after one Adam step."""
    wire_dtype: torch.dtype = torch.bfloat16
    """`SyncConfig.wire_dtype`: the fp32 master weights travel cast to it."""
    bucket_bytes: int = 256 * MIB
    """`SyncConfig.bucket_bytes` of both hal methods."""
    anchor_every: int = 16
    """`DeltaConfig.anchor_every`: a sync that lands on it is whole and is counted as an anchor."""
    baseline: str = "device"
    """`DeltaConfig.baseline`."""
    link_gb_per_s: float | None = None
    """Emulate a link of this many GB/s for every method (`_Link`); None: the transport as it is."""
    init_std: float = 0.02
    """Standard deviation of the initial matrices and biases (Qwen2's initializer_range)."""
    grad_std: float = 1.0
    """Standard deviation of the random gradients (Adam is invariant to it, up to its eps)."""
    seed: int = 0
    threads: int = 1
    """torch intra-op threads per process during the syncs (as hal.tools.bench.transfer)."""
    update_threads: int = 2
    """torch threads of the sender's (untimed) Adam step; the receiver waits meanwhile."""
    timeout_s: float = 1800.0
    """Deadline for the whole run; past it every process is killed."""
    collective_timeout_s: float = 300.0
    """Timeout of the gloo group and of hal's SyncConfig (a barrier spans an Adam step)."""
    verify: bool = True
    """Check the hal methods' bytes against the floor's after every sync (not timed)."""

    def __post_init__(self) -> None:
        get_preset(self.preset)
        if not self.lrs or any(not (isinstance(lr, float) and lr > 0) for lr in self.lrs):
            raise ValueError(f"lrs must be positive floats, got {self.lrs!r}")
        if not isinstance(self.syncs, int) or self.syncs < 1:
            raise ValueError(f"syncs must be an int of at least 1, got {self.syncs!r}")
        if self.wire_dtype not in WIRE_DTYPES.values():
            raise ValueError(f"wire_dtype must be one of {list(WIRE_DTYPES.values())}, got {self.wire_dtype!r}")
        if self.bucket_bytes < 4096:
            raise ValueError(f"bucket_bytes must be at least 4096, got {self.bucket_bytes}")
        if self.threads < 1 or self.update_threads < 1:
            raise ValueError("threads and update_threads must be at least 1")
        if not (self.init_std > 0 and self.grad_std > 0):
            raise ValueError("init_std and grad_std must be positive")
        if self.timeout_s <= 0 or self.collective_timeout_s <= 0:
            raise ValueError("timeout_s and collective_timeout_s must be positive")
        if self.link_gb_per_s is not None and not self.link_gb_per_s > 0:
            raise ValueError(f"link_gb_per_s must be positive or None, got {self.link_gb_per_s!r}")


# ---------------------------------------------------------------------------------------
# the trainer side: fp32 master weights and Adam


def master_weights(params: list[Param], config: DeltaBenchConfig) -> list[torch.Tensor]:
    """The fp32 master weights: norm weights 1.0, everything else N(0, init_std); seeded."""
    gen = torch.Generator().manual_seed(config.seed)
    out = []
    for p in params:
        t = torch.empty(p.shape, dtype=torch.float32)
        if len(p.shape) == 1 and "norm" in p.name:
            t.fill_(1.0)
        else:
            t.normal_(0.0, config.init_std, generator=gen)
        out.append(t)
    return out


class RandomGradientAdam:
    """`torch.optim.Adam` over `weights`, stepped on fresh N(0, grad_std) gradients.

    One parameter at a time: each gets its gradient, the optimizer steps (Adam skips
    parameters without one), the gradient is dropped. Adam is elementwise, so this is
    exactly one Adam step over all of them, holding one gradient instead of a model's.
    """

    def __init__(self, weights: list[torch.Tensor], lr: float, grad_std: float, seed: int) -> None:
        self.weights = weights
        self.grad_std = grad_std
        self.gen = torch.Generator().manual_seed(seed)
        try:
            self.optimizer = torch.optim.Adam(weights, lr=lr, fused=True)
            self.fused = True
        except (RuntimeError, ValueError):  # no fused Adam for this device / dtype
            self.optimizer = torch.optim.Adam(weights, lr=lr, foreach=False)
            self.fused = False

    def step(self) -> None:
        for w in self.weights:
            w.grad = torch.empty_like(w).normal_(0.0, self.grad_std, generator=self.gen)
            self.optimizer.step()
            w.grad = None


# ---------------------------------------------------------------------------------------
# one rank


@dataclass(slots=True)
class _Side:
    """One rank's objects for one learning rate."""

    rank: int
    config: DeltaBenchConfig
    names: list[str]
    flat: dict[str, torch.Tensor]  # per method: the wire-dtype bytes (floor, and receiver destinations)
    views: dict[str, list[torch.Tensor]]
    master: list[torch.Tensor] = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)
    runs: dict[str, Callable[[int], dict[str, Any]]] = field(default_factory=dict)

    @property
    def is_sender(self) -> bool:
        return self.rank == SENDER


class _Link:
    """An emulated link of `bytes_per_s` on the sending side: each send's bytes count as
    arrived only when a link of that rate, busy with the sends before it, would have
    carried them; the work around the sends (packing the next segment, the receiver's
    apply) overlaps it. The sync, or the floor's broadcast, ends no earlier than its last
    byte. An emulation, not a measurement of a link."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.busy_until = 0.0

    def carry(self, nbytes: int) -> None:
        self.busy_until = max(time.perf_counter(), self.busy_until) + nbytes / self.bytes_per_s

    def drain(self) -> None:
        delay = self.busy_until - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


def _paced_transport(link: _Link) -> Any:
    from hal.sync import BroadcastTransport

    class PacedBroadcast(BroadcastTransport):
        """BroadcastTransport whose sends go over the emulated `link`."""

        def send_segment(self, k: int, j: int, start: int, data: torch.Tensor, **kw: Any) -> None:
            link.carry(data.numel())
            super().send_segment(k, j, start, data, **kw)

        def finish(self) -> None:
            super().finish()
            link.drain()

    return PacedBroadcast(group=None, src=SENDER)


def _setup(side: _Side, method: str) -> None:
    """Create `method`'s objects on this rank and its run(version) -> metrics."""
    import torch.distributed as dist

    from hal.device import get_backend
    from hal.sync import BroadcastTransport, Receiver, Sender, SyncConfig, TensorSource, TensorSpec
    from hal.sync.config import DeltaConfig
    from hal.sync.rollout import copy_into

    config = side.config
    link = _Link(config.link_gb_per_s * 1e9) if config.link_gb_per_s and side.is_sender else None
    if method == "floor":
        flat = side.flat["floor"]

        def run_floor(version: int) -> dict[str, Any]:
            if link is not None:
                link.carry(flat.numel())
            dist.broadcast(flat, src=SENDER)
            if link is not None:
                link.drain()
            return {}

        side.runs[method] = run_floor
        return
    backend = get_backend("cpu")  # host weights and gloo, whatever VERL_DEVICE says
    transport = _paced_transport(link) if link is not None else BroadcastTransport(group=None, src=SENDER)
    delta = None
    if method in DELTA_METHODS:
        delta = DeltaConfig(anchor_every=config.anchor_every, baseline=config.baseline, choose=DELTA_METHODS[method])
    sync_config = SyncConfig(
        bucket_bytes=config.bucket_bytes, wire_dtype=config.wire_dtype, timeout_s=config.collective_timeout_s, delta=delta
    )
    if side.is_sender:
        sender = Sender(transport, sync_config, backend=backend)
        source = TensorSource(list(zip(side.names, side.master)))
        side.objects[method] = (sender, transport)

        def run_send(version: int) -> dict[str, Any]:
            return _metrics_dict(sender.send(source, version=version))

        side.runs[method] = run_send
        return
    specs = [TensorSpec(n, tuple(v.shape), v.dtype) for n, v in zip(side.names, side.views[method])]
    receiver = Receiver(transport, specs, timeout_s=config.collective_timeout_s, backend=backend)
    sink = copy_into(dict(zip(side.names, side.views[method])))
    side.objects[method] = (receiver, transport)

    def run_receive(version: int) -> dict[str, Any]:
        metrics = _metrics_dict(receiver.receive(sink))
        metrics["baseline_bytes"] = receiver.baseline_bytes
        return metrics

    side.runs[method] = run_receive


def _teardown(side: _Side) -> None:
    for endpoint, transport in side.objects.values():
        _close(endpoint)
        _close(transport)
    side.objects.clear()
    side.runs.clear()


def _first_mismatch(got: torch.Tensor, want: torch.Tensor, wire: list[Param], offsets: list[int]) -> str:
    """The first parameter whose bytes differ (for the error message)."""
    for p, offset in zip(wire, offsets):
        if not _bytes_equal(got[offset : offset + p.nbytes], want[offset : offset + p.nbytes]):
            return p.name
    return "(padding)"


def _run_lr(rank: int, config: DeltaBenchConfig, lr: float, lr_index: int, params: list[Param], memory: PeakMemory) -> dict[str, Any]:
    import torch.distributed as dist

    from hal.sync.config import wire_dtype_for

    wire = [Param(p.name, tuple(p.shape), wire_dtype_for(torch.float32, config.wire_dtype)) for p in params]
    offsets, total = _layout(wire)
    names = [p.name for p in params]
    flats = {"floor": torch.zeros(total, dtype=torch.uint8)}  # touched now: part of every baseline
    if rank != SENDER:
        for method in ("hal_bucketed", *DELTA_METHODS):
            flats[method] = torch.zeros(total, dtype=torch.uint8)
    views = {m: _views(f, wire, offsets) for m, f in flats.items()}
    side = _Side(rank=rank, config=config, names=names, flat=flats, views=views)
    optimizer: RandomGradientAdam | None = None
    if side.is_sender:
        torch.set_num_threads(config.update_threads)
        side.master = master_weights(params, config)
        optimizer = RandomGradientAdam(side.master, lr, config.grad_std, seed=config.seed + 1000 * (lr_index + 1))
        torch.set_num_threads(config.threads)

    syncs: list[dict[str, Any]] = []
    try:
        for s in range(config.syncs + 1):
            record: dict[str, Any] = {"sync": s, "methods": {}}
            dist.barrier()
            if side.is_sender:
                if s:
                    torch.set_num_threads(config.update_threads)
                    t0 = time.perf_counter()
                    optimizer.step()
                    record["update_s"] = time.perf_counter() - t0
                    torch.set_num_threads(config.threads)
                t0 = time.perf_counter()
                for view, w in zip(views["floor"], side.master):  # the floor's bytes: cast outside its timing
                    view.copy_(w)
                record["cast_s"] = time.perf_counter() - t0
            order = METHODS[s % len(METHODS) :] + METHODS[: s % len(METHODS)]
            gc.collect()  # once per sync (100-200 ms each here), not before every method
            for method in order:
                dist.barrier()
                memory.reset(collect=False)  # not timed
                if s == 0:  # objects created here: the anchor's peak includes them
                    _setup(side, method)
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                metrics = side.runs[method](s)
                t1, c1 = time.perf_counter(), time.process_time()
                peak = memory.extra()
                dist.barrier()
                record["methods"][method] = {"t0": t0, "t1": t1, "cpu_s": c1 - c0, "peak_extra_bytes": peak, "metrics": metrics}
            if rank != SENDER and config.verify:
                want = flats["floor"]
                for method in ("hal_bucketed", *DELTA_METHODS):
                    if not _bytes_equal(flats[method], want):
                        bad = _first_mismatch(flats[method], want, wire, offsets)
                        raise RuntimeError(f"lr {lr:g} sync {s}: {method} left parameter {bad!r} with other bytes than the floor delivered")
                record["verified"] = True
                flats["hal_bucketed"].zero_()  # the next dense sync must write every byte again
            syncs.append(record)
    finally:
        _teardown(side)
    return {"lr": lr, "total_bytes": total, "fused_adam": None if optimizer is None else optimizer.fused, "syncs": syncs}


def _rank_body(rank: int, config: DeltaBenchConfig) -> dict[str, Any]:
    params = get_preset(config.preset).params()
    memory = PeakMemory()
    report: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "lrs": []}
    for i, lr in enumerate(config.lrs):
        report["lrs"].append(_run_lr(rank, config, lr, i, params, memory))
        gc.collect()
    return report


def _rank_main(rank: int, out: Any, port: int, config: DeltaBenchConfig) -> None:
    torch.set_num_threads(config.threads)
    run_gloo_rank(out, rank, 2, port, config.collective_timeout_s, lambda: _rank_body(rank, config))


# ---------------------------------------------------------------------------------------
# the parent


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def _summarize_lr(config: DeltaBenchConfig, sender: dict[str, Any], receiver: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for ss, rs in zip(sender["syncs"], receiver["syncs"]):
        row: dict[str, Any] = {"sync": ss["sync"], "update_s": ss.get("update_s"), "cast_s": ss.get("cast_s"), "verified": rs.get("verified", False)}
        for method in METHODS:
            a, b = ss["methods"][method], rs["methods"][method]
            row[method] = {
                "seconds": max(a["t1"], b["t1"]) - min(a["t0"], b["t0"]),
                "sender_cpu_s": a["cpu_s"],
                "receiver_cpu_s": b["cpu_s"],
                "sender_peak_extra_bytes": a["peak_extra_bytes"],
                "receiver_peak_extra_bytes": b["peak_extra_bytes"],
                "sender_metrics": a["metrics"],
                "receiver_metrics": b["metrics"],
            }
        rows.append(row)
    # steady: the syncs where the delta chosen by bytes carried deltas (not the first, not
    # an anchor_every one); the delta chosen by time is measured over the same syncs
    steady = [r for r in rows if r["hal_delta_bytes"]["sender_metrics"].get("delta")]
    anchors = [r for r in rows if not r["hal_delta_bytes"]["sender_metrics"].get("delta")]

    def col(method: str, key: str, side: str = "sender_metrics", among: list[dict[str, Any]] = steady) -> list[Any]:
        return [r[method][side].get(key) for r in among]

    def ratio(num: str, den: str) -> float | None:
        return _median([r[num]["seconds"] / r[den]["seconds"] for r in steady])

    seconds = {m: _median([r[m]["seconds"] for r in steady]) for m in METHODS}
    wire = _median(col("hal_delta_bytes", "wire_bytes"))
    dense_wire = _median(col("hal_delta_bytes", "dense_wire_bytes"))
    encodings: dict[str, int] = {}
    for r in steady:
        for k, v in (r["hal_delta_bytes"]["sender_metrics"].get("segments_by_encoding") or {}).items():
            encodings[k] = encodings.get(k, 0) + v
    changed = [c for c in col("hal_delta_bytes", "changed_fraction") if c is not None]
    encode = _median(col("hal_delta_bytes", "encode_s"))
    apply_delta = _median(col("hal_delta_bytes", "apply_s", "receiver_metrics"))
    apply_dense = _median(col("hal_bucketed", "apply_s", "receiver_metrics"))
    first = rows[0]
    summary = {
        "lr": sender["lr"],
        "steady_syncs": len(steady),
        "anchor_syncs": [r["sync"] for r in anchors],
        "changed_fraction": _median(changed),
        "changed_fraction_min": min(changed) if changed else None,
        "changed_fraction_max": max(changed) if changed else None,
        "wire_bytes": wire,
        "dense_wire_bytes": dense_wire,
        "bytes_ratio": _median([w / d for w, d in zip(col("hal_delta_bytes", "wire_bytes"), col("hal_delta_bytes", "dense_wire_bytes")) if d]),
        "segments_by_encoding": encodings,
        "encode_s": encode,
        "apply_s": apply_delta,
        "dense_apply_s": apply_dense,
        "seconds": seconds,
        "best_seconds": {m: min((r[m]["seconds"] for r in steady), default=None) for m in METHODS},
        "ratio_to_dense": ratio("hal_delta_bytes", "hal_bucketed"),
        "mean_ratio_to_dense": _total_ratio(steady, "hal_delta_bytes", "hal_bucketed"),
        "ratio_to_floor": ratio("hal_delta_bytes", "floor"),
        "dense_ratio_to_floor": ratio("hal_bucketed", "floor"),
        "cpu_s": {
            m: {"sender": _median([r[m]["sender_cpu_s"] for r in steady]), "receiver": _median([r[m]["receiver_cpu_s"] for r in steady])}
            for m in METHODS
        },
        "update_s": _median([r["update_s"] for r in steady]),
        "cast_s": _median([r["cast_s"] for r in steady]),
        "anchor": {
            m: {"seconds": first[m]["seconds"], "wire_bytes": first[m]["sender_metrics"].get("wire_bytes")} for m in METHODS
        },
        "baseline_bytes": {
            "sender": first["hal_delta_bytes"]["sender_metrics"].get("baseline_bytes"),
            "receiver": first["hal_delta_bytes"]["receiver_metrics"].get("baseline_bytes"),
        },
        # RSS each method added at set-up plus its first (anchor) sync: the delta's baseline
        # shows as the difference to hal_bucketed
        "setup_peak_extra_bytes": {
            m: {"sender": first[m]["sender_peak_extra_bytes"], "receiver": first[m]["receiver_peak_extra_bytes"]} for m in METHODS
        },
        # transient RSS during a steady sync (the delta's encode temporaries, payloads)
        "sync_peak_extra_bytes": {
            m: {
                "sender": max((r[m]["sender_peak_extra_bytes"] or 0 for r in steady), default=None),
                "receiver": max((r[m]["receiver_peak_extra_bytes"] or 0 for r in steady), default=None),
            }
            for m in METHODS
        },
        "verified_syncs": sum(1 for r in rows if r["verified"]),
        "by_time": _by_time(steady),
        "syncs": rows,
    }
    summary["wire_bound"] = wire_bound_projection(summary)
    summary["targets"] = target_verdicts(summary)
    return summary


def _total_ratio(rows: list[dict[str, Any]], num: str, den: str) -> float | None:
    """Seconds of `num` over seconds of `den`, summed over `rows`: what a run of these syncs
    costs, probes and pauses included (a median hides a slow sync in ten)."""
    total = sum(r[den]["seconds"] for r in rows)
    return sum(r[num]["seconds"] for r in rows) / total if rows and total > 0 else None


def _by_time(steady: list[dict[str, Any]]) -> dict[str, Any]:
    """The delta chosen by time (`DeltaConfig.choose="time"`, the default) over the steady syncs."""
    metrics = [r["hal_delta_time"]["sender_metrics"] for r in steady]
    choices: dict[str, int] = {}
    for m in metrics:
        choices[m.get("delta_choice")] = choices.get(m.get("delta_choice"), 0) + 1
    return {
        "choices": choices,
        "per_sync": [m.get("delta_choice") for m in metrics],
        "seconds": _median([r["hal_delta_time"]["seconds"] for r in steady]),
        "ratio_to_dense": _median([r["hal_delta_time"]["seconds"] / r["hal_bucketed"]["seconds"] for r in steady]),
        "mean_ratio_to_dense": _total_ratio(steady, "hal_delta_time", "hal_bucketed"),
        "bytes_ratio": _median([m["wire_bytes"] / m["dense_wire_bytes"] for m in metrics if m.get("dense_wire_bytes")]),
        "encode_s": _median([m.get("encode_s") for m in metrics]),
    }


def wire_bound_projection(summary: dict[str, Any]) -> dict[str, Any] | None:
    """What a link slower than loopback would give, from this run's bytes and CPU times:
    a projection, not a measurement.

    Dense sync on a wire-bound link takes dense_bytes / B (its pack and apply overlap the
    wire). The delta is charged its measured work that dense sync does not do, without
    any overlap: encode_s at the sender and the receiver's extra apply time. It wins when
    wire_bytes / B + extra < dense_bytes / B, i.e. on links slower than
    (dense_bytes - wire_bytes) / extra; it reaches a time ratio r when
    B <= (r * dense_bytes - wire_bytes) / extra.
    """
    wire, dense, encode = summary.get("wire_bytes"), summary.get("dense_wire_bytes"), summary.get("encode_s")
    if wire is None or not dense or encode is None or wire >= dense:
        return None  # no steady syncs, or no bytes saved: no link where the delta wins
    extra = encode + max(0.0, (summary.get("apply_s") or 0.0) - (summary.get("dense_apply_s") or 0.0))
    if extra <= 0:
        return None

    def at_most(r: float) -> float | None:
        return (r * dense - wire) / extra / 1e9 if r * dense > wire else None

    return {
        "extra_s": extra,
        "break_even_gb_per_s": at_most(1.0),
        "ratio_0_6_gb_per_s": at_most(0.6),
        "note": "projection from measured bytes and CPU times, not a measurement",
    }


def target_verdicts(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 11's targets at this learning rate, for the delta chosen by bytes (the summary's
    own figures) and, when measured, by time (`by_time`; its time is also judged on the
    mean ratio, which counts its probes)."""
    out = []
    for lr, targets in TARGETS.items():
        if abs(summary["lr"] - lr) > 1e-12 * lr:
            continue
        for choose, figures in (("bytes", summary), ("time", summary.get("by_time"))):
            if figures is None:
                continue
            checks = []
            if "bytes_ratio_max" in targets:
                checks.append((f"wire bytes <= {targets['bytes_ratio_max']}x dense", figures["bytes_ratio"], targets["bytes_ratio_max"]))
            if "time_ratio_max" in targets:
                checks.append((f"seconds <= {targets['time_ratio_max']}x dense hal_bucketed", figures["ratio_to_dense"], targets["time_ratio_max"]))
                if choose == "time":
                    checks.append((f"mean seconds <= {targets['time_ratio_max']}x dense hal_bucketed", figures["mean_ratio_to_dense"], targets["time_ratio_max"]))
            for target, value, most in checks:
                out.append({"choose": choose, "target": target, "value": value, "met": value is not None and value <= most})
    return out


def run_delta(config: DeltaBenchConfig) -> dict[str, Any]:
    """Run the delta benchmark; returns {"preset", "config", "results": [per-lr summary]}."""
    began = time.perf_counter()

    def role_failed(rank: int, text: str) -> None:
        raise RuntimeError(f"hal bench --delta: the {'sender' if rank == SENDER else 'receiver'} (rank {rank}) failed:\n{text}")

    try:
        reports = spawn_ranks(_rank_main, 2, args=(free_port(), config), timeout_s=config.timeout_s, label="hal-bench-delta-rank", on_failure=role_failed)
    except TimeoutError as exc:
        raise TimeoutError(f"hal bench --delta: {exc}") from None
    results = [_summarize_lr(config, s, r) for s, r in zip(reports[SENDER]["lrs"], reports[RECEIVER]["lrs"])]
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


def format_table(report: dict[str, Any]) -> str:
    def mib(v: float | None) -> str:
        return "n/a" if v is None else f"{v / MIB:.1f}"

    def num(v: float | None, fmt: str = ".3f") -> str:
        return "n/a" if v is None else format(v, fmt)

    cfg = report["config"]
    lines = [
        f"preset {report['preset']}: {report['parameters'] / 1e6:.0f}M fp32 master parameters in {report['tensors']} tensors, "
        f"{report['wire_bytes_total'] / GIB:.3f} GiB on the wire as {cfg['wire_dtype']}; bucket {cfg['bucket_bytes'] / MIB:g} MiB; "
        f"{report['timing']}",
        f"{'lr':>7} {'changed':>15} {'wire MiB':>9} {'dense MiB':>9} {'x bytes':>7} {'segs d/i/b':>11} {'encode s':>8} "
        f"{'apply s':>13} {'floor s':>7} {'dense s':>7} {'delta s':>7} {'x dense':>7} {'x floor':>7} {'baseline MiB s/r':>17}",
    ]
    for r in report["results"]:
        seg = r["segments_by_encoding"]
        changed = f"{num(r['changed_fraction'], '.2%')} ({num(r['changed_fraction_min'], '.1%')}-{num(r['changed_fraction_max'], '.1%')})"
        lines.append(
            f"{r['lr']:>7.0e} {changed:>15} {mib(r['wire_bytes']):>9} {mib(r['dense_wire_bytes']):>9} {num(r['bytes_ratio']):>7} "
            f"{seg.get('dense', 0)}/{seg.get('indices', 0)}/{seg.get('bitmask', 0):<5} {num(r['encode_s']):>8} "
            f"{num(r['apply_s']) + ' / ' + num(r['dense_apply_s']):>13} {num(r['seconds']['floor']):>7} {num(r['seconds']['hal_bucketed']):>7} "
            f"{num(r['seconds']['hal_delta_bytes']):>7} {num(r['ratio_to_dense'], '.2f'):>7} {num(r['ratio_to_floor'], '.2f'):>7} "
            f"{mib(r['baseline_bytes']['sender']) + ' / ' + mib(r['baseline_bytes']['receiver']):>17}"
        )
    lines.append(
        "(delta chosen by bytes, DeltaConfig(choose=\"bytes\"); apply s: delta / hal_bucketed at the receiver; "
        "segs: dense/indices/bitmask over the steady syncs)"
    )
    for r in report["results"]:
        t = r["by_time"]
        lines.append(
            f"lr {r['lr']:g}, delta chosen by time (the default): {num(t['seconds'])} s, {num(t['ratio_to_dense'], '.2f')}x dense "
            f"(median), {num(t['mean_ratio_to_dense'], '.2f')}x (sum over the syncs), {num(t['bytes_ratio'])}x the bytes; "
            f"syncs: {' '.join(c or '-' for c in t['per_sync'])}"
        )
    for r in report["results"]:
        for t in r["targets"]:
            lines.append(f"lr {r['lr']:g}, by {t['choose']}: {t['target']}: {num(t['value'])} -> {'met' if t['met'] else 'MISSED'}")
        wb = r.get("wire_bound")
        if wb is None and r["steady_syncs"]:
            lines.append(f"lr {r['lr']:g}: the delta sent no fewer bytes than dense: no link where it is faster")
        if wb:
            lines.append(
                f"lr {r['lr']:g}: projection (not measured; this run's CPU encode and apply): delta work not in dense {wb['extra_s']:.3f} s; "
                f"delta faster than dense on links below {num(wb['break_even_gb_per_s'], '.2f')} GB/s, "
                f"within 0.6x below {num(wb['ratio_0_6_gb_per_s'], '.2f')} GB/s"
            )
    return "\n".join(lines)
