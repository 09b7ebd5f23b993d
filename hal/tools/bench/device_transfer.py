"""`hal bench --device-transfer`: weights already on the device, into an engine's device memory.

    VERL_DEVICE=cuda hal bench --device-transfer --preset qwen2.5-0.5b --json d2d.json

The transfer benchmark (hal.tools.bench.transfer) keeps the weights in host memory. This one
runs on the current backend (VERL_DEVICE): the sender's weights and every receiver's
destinations live in device memory, receiver r on device r mod the device count (one
GPU holds them all; on a node of several, receivers sit on other GPUs as engines do).
The ranks share one gloo group for control, as a trainer and its engines on one node do.

    floor_ipc        each receiver maps the sender's flat weights once (device IPC) and
                     copies all bytes into its own flat destination: one device-to-device
                     copy, the floor of any same-node sync.
    hal_ipc          hal.sync Sender/Receiver over IpcTransport (device-memory IPC buckets,
                     SyncConfig defaults) into the destinations through `copy_into`.
    hal_ipc_verified the same with verify=True (checksums of every tensor).
    hal_ipc_staged   the same with bypass_cpu=False: every pack goes device -> pinned host
                     -> device, the hop bypass_cpu exists to remove.
    hal_gloo         BroadcastTransport over the gloo group: gloo moves device tensors
                     through host memory (what a trainer without NCCL/HCCL pays).

With `--profile` every rank runs each method's measured rounds under a cProfile of its own
and the report (and the table) carries, per rank and method, the top functions by their own
time and who called the costliest: one lent-machine call then says where a device sync's
host time goes, method by method.

Timing: a barrier, then each rank runs the method and synchronizes its device; a round's
time runs from the earliest start to the latest end (perf_counter: one clock per node),
and `seconds` is the median over interleaved rounds, `ratio_to_floor` the median of
same-round ratios to floor_ipc. After each round, untimed, every receiver checks every
byte on the device against the sender's pattern and zeroes its destinations.
The JSON holds {"mode": "device-transfer", "backend", "device_model", "results": [...]}.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from hal.tools.bench.presets import PRESETS, get_preset
from hal.tools.bench.buffers import PATTERN_PERIOD, fill_pattern, flat_layout, flat_views, pattern_block
from hal.tools.bench.common import GIB, SENDER
from hal.procs import free_port, run_gloo_rank, spawn_ranks

METHODS = ("floor_ipc", "hal_ipc", "hal_ipc_verified", "hal_ipc_staged", "hal_gloo")
DEFAULT_METHODS = METHODS


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceTransferConfig:
    preset: str = "qwen2.5-0.5b"
    methods: tuple[str, ...] = DEFAULT_METHODS
    receivers: int = 1
    repeats: int = 5
    warmup: int = 1
    bucket_bytes: int | None = None
    """None: what hal.sync picks on this device (default_bucket_bytes)."""
    timeout_s: float = 600.0
    collective_timeout_s: float = 120.0
    verify: bool = True
    backend: str | None = None
    """The backend's name; None: the one VERL_DEVICE resolves to."""
    profile: bool = False
    """cProfile each rank's measured rounds (not the warm-ups): where a sync's host time goes."""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"device transfer: unknown preset {self.preset!r}; choose from {', '.join(sorted(PRESETS))}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"device transfer: unknown method(s) {unknown or '(none given)'}; choose from {', '.join(METHODS)}")
        if "floor_ipc" not in self.methods:
            raise ValueError("device transfer: the methods must include floor_ipc (every ratio is to it)")
        for name in ("receivers", "repeats"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"device transfer: {name} must be a positive int, got {getattr(self, name)!r}")


# ---- one rank ----------------------------------------------------------------------------------
@dataclass(slots=True)
class _Rank:
    rank: int
    config: DeviceTransferConfig
    backend: Any
    flat: torch.Tensor  # the sender's weights (in IPC-shareable memory) or the receiver's destinations
    pairs: list[tuple[str, torch.Tensor]]
    step: int = 0

    @property
    def is_sender(self) -> bool:
        return self.rank == SENDER


def _matches(flat: torch.Tensor) -> bool:
    """Whether `flat` holds what `fill_pattern` writes, compared on its device (the
    transfer benchmark's check is libc memcmp, host memory only)."""
    n = flat.numel()
    period = min(PATTERN_PERIOD, n)
    block = pattern_block(period, 0).to(flat.device)
    return torch.equal(flat[:period], block) and (n == period or torch.equal(flat[period:], flat[: n - period]))


def _mismatch(flat: torch.Tensor, params: list[Any], offsets: list[int]) -> str:
    """What is wrong in `flat` (the failure path only): how many bytes, how many of them are
    zero (never written: destinations are zeroed between rounds), and which tensors."""
    expected = torch.empty_like(flat)
    fill_pattern(expected)
    wrong = flat != expected
    zeros = int((wrong & (flat == 0)).sum())
    bad = [(p.name, int(wrong[o : o + p.nbytes].sum()), p.nbytes) for p, o in zip(params, offsets) if bool(wrong[o : o + p.nbytes].any())]
    listed = ", ".join(f"{name} ({w} of {size} bytes)" for name, w, size in bad[:6])
    return (f"{int(wrong.sum())} of {flat.numel()} bytes wrong ({zeros} of them zero), in {len(bad)} of {len(params)} tensors: "
            f"{listed}{', ...' if len(bad) > 6 else ''}")


def _setup_floor_ipc(r: _Rank) -> Callable[[], None]:
    import torch.distributed as dist

    box = [json.dumps(r.backend.export_ipc(r.flat)) if r.is_sender else None]
    dist.broadcast_object_list(box, src=SENDER)
    if r.is_sender:
        return lambda: None  # its memory is read by the receivers' copies
    source = r.backend.import_ipc(json.loads(box[0]))
    return lambda: r.backend.copy_(r.flat, source)


def _setup_hal(r: _Rank, method: str) -> Callable[[], None]:
    from hal.sync import BroadcastTransport, IpcTransport, Receiver, Sender, SyncConfig, TensorSource, TensorSpec, copy_into

    transport = (BroadcastTransport if method == "hal_gloo" else IpcTransport)(None, src=SENDER)
    config = SyncConfig(
        bucket_bytes=r.config.bucket_bytes, verify=method == "hal_ipc_verified", bypass_cpu=method != "hal_ipc_staged",
        timeout_s=r.config.collective_timeout_s,
    )
    if r.is_sender:
        sender = Sender(transport, config, backend=r.backend)

        def send() -> None:
            r.step += 1
            sender.send(TensorSource(r.pairs), version=r.step)

        return send
    receiver = Receiver(transport, [TensorSpec.of(n, t) for n, t in r.pairs], backend=r.backend, timeout_s=r.config.collective_timeout_s)
    sink = copy_into(dict(r.pairs))
    return lambda: receiver.receive(sink)


def _rank_main(rank: int, out: Any, port: int, config: DeviceTransferConfig) -> None:
    run_gloo_rank(out, rank, 1 + config.receivers, port, config.collective_timeout_s, lambda: _rank_body(rank, config))


def _rank_body(rank: int, config: DeviceTransferConfig) -> dict[str, Any]:
    import torch.distributed as dist

    import hal

    backend = hal.get_backend(config.backend) if config.backend else hal.current()
    backend.set_device(rank % backend.device_count())
    params = get_preset(config.preset).params()
    offsets, total = flat_layout(params)
    if rank == SENDER:
        flat = backend.empty_shared(total) if backend.supports_ipc else backend.empty(total, torch.uint8)
        fill_pattern(flat)
    else:
        flat = backend.empty(total, torch.uint8)
        flat.zero_()
    backend.synchronize()
    state = _Rank(rank, config, backend, flat, list(zip((p.name for p in params), flat_views(flat, params, offsets))))
    runs = {m: (_setup_floor_ipc(state) if m == "floor_ipc" else _setup_hal(state, m)) for m in config.methods}
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in config.methods}
    verified = {m: 0 for m in config.methods}

    profilers: dict[str, cProfile.Profile] = {}  # per method, for the measured rounds with `profile`

    def one(method: str, when: str) -> tuple[float, float]:
        dist.barrier()
        profiler = profilers.get(method)
        if profiler is not None:
            profiler.enable()  # the sync alone: not the barriers, not the byte check
        t0 = time.perf_counter()
        runs[method]()
        backend.synchronize()
        t1 = time.perf_counter()
        if profiler is not None:
            profiler.disable()
        dist.barrier()
        if rank != SENDER:
            if config.verify:
                if not _matches(flat):
                    raise RuntimeError(f"{method}, {when}: receiver {rank} holds wrong bytes: {_mismatch(flat, params, offsets)}")
                verified[method] += 1
            flat.zero_()
            backend.synchronize()
        return t0, t1

    for method in config.methods:
        for w in range(max(1, config.warmup)):
            one(method, f"warm-up {w + 1}")
    n = len(config.methods)
    if config.profile:
        profilers = {m: cProfile.Profile() for m in config.methods}
    for r in range(config.repeats):
        for method in config.methods[r % n :] + config.methods[: r % n]:
            times[method].append(one(method, f"round {r + 1}"))
    dist.barrier()
    return {
        "rank": rank, "pid": os.getpid(), "device": str(flat.device), "total_bytes": total, "times": times,
        "verified": verified, "profile": {m: _top_functions(p) for m, p in profilers.items()} if config.profile else None,
    }


PROFILE_LINES = 25
PROFILE_CALLERS = 6


def _top_functions(profiler: cProfile.Profile) -> str:
    """The functions that took the most time of their own, as pstats prints them, then who
    called the costliest few (a helper's time says little without its callers)."""
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    stats.print_stats(PROFILE_LINES)
    stats.print_callers(PROFILE_CALLERS)
    return text.getvalue()


# ---- the parent --------------------------------------------------------------------------------
def run_device_transfer(config: DeviceTransferConfig) -> dict[str, Any]:
    import hal

    backend = hal.get_backend(config.backend) if config.backend else hal.current()
    config = DeviceTransferConfig(**{**asdict(config), "backend": backend.name})
    began = time.perf_counter()

    def failed(rank: int, text: str) -> None:
        raise RuntimeError(f"hal bench --device-transfer: rank {rank} failed:\n{text}")

    reports = spawn_ranks(
        _rank_main, 1 + config.receivers, args=(free_port(), config), timeout_s=config.timeout_s, label="hal-bench-device-rank", on_failure=failed
    )
    total = reports[SENDER]["total_bytes"]
    per_round = {
        m: [max(r["times"][m][i][1] for r in reports) - min(r["times"][m][i][0] for r in reports) for i in range(config.repeats)]
        for m in config.methods
    }
    floor = per_round["floor_ipc"]
    results = []
    for m in config.methods:
        seconds = statistics.median(per_round[m])
        results.append({
            "method": m,
            "seconds": seconds,
            "gib_per_s": total / seconds / GIB,
            "ratio_to_floor": statistics.median(t / f for t, f in zip(per_round[m], floor)),
            "best_seconds": min(per_round[m]),
            "all_seconds": per_round[m],
            "verified_receivers": [r["rank"] for r in reports[1:] if r["verified"][m] == max(1, config.warmup) + config.repeats],
        })
    return {
        "mode": "device-transfer",
        "backend": backend.name,
        "device_model": backend.device_model(),
        "devices": [r["device"] for r in reports],
        "preset": config.preset,
        "bytes": total,
        "tensors": len(get_preset(config.preset).params()),
        "config": {**asdict(config), "methods": list(config.methods)},
        "timing": f"median of {config.repeats} interleaved rounds after {max(1, config.warmup)} warm-up, each rank device-synchronized",
        "wall_s": time.perf_counter() - began,
        "results": results,
        **({"profiles": {str(r["rank"]): r["profile"] for r in reports}} if config.profile else {}),
    }


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"device transfer on {report['backend']} ({report['device_model'] or '?'}), {report['preset']}: "
        f"{report['bytes'] / GIB:.3f} GiB in {report['tensors']} tensors, ranks on {', '.join(report['devices'])}; {report['timing']}",
        f"{'method':<18}{'seconds':>10}{'GiB/s':>9}{'x floor':>9}{'best s':>9}  verified receivers",
    ]
    for r in report["results"]:
        lines.append(
            f"{r['method']:<18}{r['seconds']:>10.4f}{r['gib_per_s']:>9.1f}{r['ratio_to_floor']:>9.2f}{r['best_seconds']:>9.4f}  {r['verified_receivers']}"
        )
    for rank, methods in report.get("profiles", {}).items():
        for method, text in methods.items():
            lines.append(f"\nrank {rank} ({'sender' if rank == str(SENDER) else 'receiver'}), {method}, its measured rounds, by own time:{text}")
    return "\n".join(lines)
