"""The transfer benchmark: one sender process, one receiver process, gloo between them.

Weights live in host memory and hal's sync runs on the `cpu` backend whatever
VERL_DEVICE says: this measures the same-node CPU path, where the floor is gloo over
loopback. (Device-to-device NCCL/HCCL runs are not covered here.)

Both processes are spawned fresh and joined by one gloo group that is created once and
reused by every method (as a trainer-engine group would be). The parent process only
waits, with a deadline: a rank that fails or outlives the deadline gets every rank
killed, so no process is left behind.

What each method must leave at the receiver is the same: every tensor's bytes in
receiver-owned memory (a preallocated destination tensor per parameter).

    floor          one broadcast of one flat tensor holding all the bytes; the weights
                   and the destinations are views into those flat tensors, so nothing
                   is packed or copied: the transport's floor.
    per_tensor     one broadcast per parameter, straight into its destination (what most
                   trainers do today).
    hal_bucketed   hal.sync's Sender/Receiver over BroadcastTransport into the receiver's
                   destinations through `copy_into` (hal's apply for preallocated
                   tensors): a tensor that travels in transfers of its own is sent
                   from the sender's tensor and received straight into its
                   destination; small tensors travel packed in buckets and are copied.
    hal_shm        the same over IpcTransport (same-node shared memory; every tensor is
                   copied out of the shared slot).
    hal_bucketed_copy
                   hal_bucketed with an apply callable that copies every view (a
                   load_weights-style target that names no destinations).
    floor_with_copy
                   the flat broadcast, started asynchronously, while each process copies
                   as many bytes as the model holds (through a 64 MiB scratch pair): where
                   a bucketed sync (one pack copy at the sender, one apply copy at the
                   receiver) would land if its copies overlapped the transfer perfectly.
    *_read         the hal methods again with an apply callable that reads every byte of
                   the views (a sum of their 8-byte words) and copies nothing: what a
                   consumer that uses the bucket in place would pay. NOT comparable to
                   floor: nothing is left in receiver-owned memory afterwards.

Timing: each repetition starts after a barrier; its time is the latest end minus the
earliest start over both processes (`time.perf_counter`, CLOCK_MONOTONIC, shared by the
processes of a node). First every method, one after the other, creates its objects and
runs its warm-up repetitions (at least one; memory is measured here, see below). Then
the measured repetitions run in interleaved rounds: round r runs every method once,
starting at method r, so a burst of load from other work on the machine hits all methods
alike. `seconds` is the median over rounds (the best is reported too); `ratio_to_floor`
is the median over rounds of the method's time over the floor's time in the same round. After every repetition the
receiver checks every byte of the destinations against the sender's (deterministic)
pattern and clears them, both outside the timed region.

CPU: `time.process_time()` around each repetition in each process (all its threads, user
and system, so gloo's socket copies count); the medians are reported as `sender_cpu_s` and
`receiver_cpu_s`. On a machine with fewer free cores than busy threads, their sum divided
by the cores bounds the time from below.

Memory: per process, the Linux resident-set high-water mark (VmHWM) is reset through
/proc/self/clear_refs just before a method's objects (transports, senders, receivers) are
created (the baseline), and again after each warm-up repetition's verification; the
largest `VmHWM - baseline` read right after a warm-up repetition is that process's peak
extra memory: everything the method allocated and touched beyond the weights, the
destinations (allocated and touched before any method runs) and the objects of the
methods set up before it (alive from their setup to the end of the run). `peak_extra_bytes` is the larger of the
two processes; both are reported. Pages of a shared-memory file count in the RSS of every
process that touches them.
"""

from __future__ import annotations

import datetime
import gc
import os
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from hal.bench.presets import Param, get_preset
from hal.procs import free_port, spawn_ranks

GIB = 1024**3
MIB = 1024**2

# Methods every run reports (the four), then the read-in-place variants.
CORE_METHODS = ("floor", "per_tensor", "hal_bucketed", "hal_shm")
# hal_bucketed_copy: an apply that copies every view (a load_weights-style target).
COPY_METHODS = ("hal_bucketed_copy",)
READ_METHODS = ("hal_bucketed_read", "hal_shm_read")
# The flat broadcast while each process copies a model-sized buffer: the best a bucketed
# sync (one pack copy, one apply copy) could do if its copies overlapped perfectly.
BOUND_METHODS = ("floor_with_copy",)
ALL_METHODS = CORE_METHODS + COPY_METHODS + READ_METHODS + BOUND_METHODS

SENDER, RECEIVER = 0, 1
_PATTERN_PERIOD = 1_048_573  # a prime number of bytes: a tensor at a wrong offset does not match by accident


@dataclass(kw_only=True, slots=True)
class TransferConfig:
    """What one `run_transfer` call measures."""

    preset: str
    """A name from hal.bench.presets.PRESETS."""
    methods: tuple[str, ...] = ALL_METHODS
    """Which methods, in the order they run."""
    repeats: int = 5
    """Measured repetitions per method; `seconds` is their median."""
    warmup: int = 1
    """Discarded repetitions per method before the measured ones."""
    bucket_bytes: int = 256 * MIB
    """Bucket size handed to hal's SyncConfig."""
    timeout_s: float = 300.0
    """Deadline for the whole run; past it every process is killed."""
    collective_timeout_s: float = 60.0
    """Timeout of the gloo group (and of hal's SyncConfig)."""
    verify: bool = True
    """Check every tensor's bytes at the receiver after every repetition (not timed)."""
    trace: bool = False
    """Record when each transport call and each apply began and ended, per bucket, in the
    last repetition of the hal methods (instance-level wrappers; hal.sync is unchanged)."""
    threads: int = 1
    """torch intra-op threads in each process. Two processes share this machine's cores;
    with more threads than free cores every parallel copy waits for a descheduled
    OpenMP thread (measured here: packing 0.92 GiB took 2.4-3.4 s with 2 threads on a
    loaded 2-core machine, 0.25 s with 1)."""

    def __post_init__(self) -> None:
        get_preset(self.preset)
        unknown = [m for m in self.methods if m not in ALL_METHODS]
        if unknown:
            raise ValueError(f"methods: unknown {unknown}; valid: {', '.join(ALL_METHODS)}")
        if not self.methods:
            raise ValueError("methods: at least one method is needed")
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {self.repeats}")
        if self.warmup < 0:
            raise ValueError(f"warmup must not be negative, got {self.warmup}")
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if self.timeout_s <= 0 or self.collective_timeout_s <= 0:
            raise ValueError("timeout_s and collective_timeout_s must be positive")


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

    def reset(self) -> None:
        """Take the current RSS as the baseline and start a new peak from it."""
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
# weights


def _layout(params: list[Param]) -> tuple[list[int], int]:
    """Byte offset of each parameter in a flat buffer (each aligned to its dtype), and the total."""
    offsets, cursor = [], 0
    for p in params:
        align = p.dtype.itemsize
        cursor = (cursor + align - 1) // align * align
        offsets.append(cursor)
        cursor += p.nbytes
    return offsets, cursor


def _views(flat: torch.Tensor, params: list[Param], offsets: list[int]) -> list[torch.Tensor]:
    return [flat[o : o + p.nbytes].view(p.dtype).view(p.shape) for p, o in zip(params, offsets)]


def _fill_pattern(flat: torch.Tensor, seed: int = 0) -> None:
    """Deterministic pseudo-random bytes at memcpy speed: a random block of a prime length, tiled.

    Byte i is `block[i % period]`, so `_matches_pattern` can check a buffer without a
    second copy of the weights, and a tensor landing at a wrong offset shows.
    """
    n = flat.numel()
    period = min(_PATTERN_PERIOD, n)
    flat[:period] = _pattern_block(period, seed)
    filled = period
    while filled < n:
        step = min(filled, n - filled)
        flat[filled : filled + step].copy_(flat[:step])
        filled += step


def _pattern_block(period: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (period,), dtype=torch.uint8, generator=gen)


def _matches_pattern(flat: torch.Tensor, seed: int = 0) -> bool:
    """Whether `flat` holds exactly what `_fill_pattern` writes: the first block, then every
    byte equal to the one a period earlier (memcmp speed; torch.equal is 20x slower here)."""
    n = flat.numel()
    period = min(_PATTERN_PERIOD, n)
    block = _pattern_block(period, seed)
    return _bytes_equal(flat[:period], block) and (n == period or _bytes_equal(flat[period:], flat[: n - period]))


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality of two contiguous uint8 CPU tensors of the same length, via libc memcmp."""
    global _memcmp
    if a.numel() != b.numel():
        return False
    if _memcmp is None:
        import ctypes

        fn = ctypes.CDLL(None).memcmp
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        _memcmp = fn
    return a.numel() == 0 or _memcmp(a.data_ptr(), b.data_ptr(), a.numel()) == 0


_memcmp: Any = None


def _first_mismatch(flat: torch.Tensor, params: list[Param], offsets: list[int], seed: int = 0) -> str:
    """The name of the first parameter whose bytes differ from the pattern (for the error message)."""
    n = flat.numel()
    period = min(_PATTERN_PERIOD, n)
    block = _pattern_block(period, seed)
    for p, o in zip(params, offsets):
        for start in range(o, o + p.nbytes, period):
            stop = min(start + period, o + p.nbytes)
            phase = start % period
            want = torch.cat([block[phase:], block[:phase]])[: stop - start]
            if not torch.equal(flat[start:stop], want):
                return p.name
    return "(none)"


# ---------------------------------------------------------------------------------------
# methods: each is a setup(ctx) that returns (run_once, teardown) for this rank


@dataclass(slots=True)
class RankContext:
    rank: int
    config: TransferConfig
    params: list[Param]
    flat: torch.Tensor  # the sender's weights or the receiver's destinations, all bytes
    tensors: list[torch.Tensor]  # views into `flat`, one per parameter
    step: int = 0
    metrics: list[dict[str, Any]] = field(default_factory=list)
    trace: list[tuple[str, Any, float, float]] = field(default_factory=list)

    @property
    def is_sender(self) -> bool:
        return self.rank == SENDER


def _setup_floor(ctx: RankContext) -> tuple[Callable[[], None], Callable[[], None]]:
    import torch.distributed as dist

    def run() -> None:
        dist.broadcast(ctx.flat, src=SENDER)

    return run, lambda: None


def _setup_per_tensor(ctx: RankContext) -> tuple[Callable[[], None], Callable[[], None]]:
    import torch.distributed as dist

    def run() -> None:
        for t in ctx.tensors:
            dist.broadcast(t, src=SENDER)

    return run, lambda: None


def _setup_floor_with_copy(ctx: RankContext) -> tuple[Callable[[], None], Callable[[], None]]:
    import torch.distributed as dist

    # While the flat broadcast runs, each process copies as many bytes as the model holds,
    # as a perfectly pipelined pack (sender) or apply (receiver) would. Through a 64 MiB
    # scratch pair (twice the L3 here, so the copies still go to memory), to keep its
    # memory small.
    chunk = min(64 * MIB, ctx.flat.numel())
    scratch_src = torch.ones(chunk, dtype=torch.uint8)
    scratch_dst = torch.zeros(chunk, dtype=torch.uint8)
    total = ctx.flat.numel()

    def run() -> None:
        work = dist.broadcast(ctx.flat, src=SENDER, async_op=True)
        done = 0
        while done < total:
            n = min(chunk, total - done)
            scratch_dst[:n].copy_(scratch_src[:n])
            done += n
        work.wait()

    return run, lambda: None


def _setup_hal(ctx: RankContext, transport_name: str, target: str) -> tuple[Callable[[], None], Callable[[], None]]:
    from hal.device import get_backend
    from hal.sync import Receiver, Sender, SyncConfig, TensorSource, TensorSpec, as_sink
    from hal.sync.rollout import copy_into
    from hal.sync import transport as transports

    backend = get_backend("cpu")  # host weights and gloo, whatever VERL_DEVICE says

    transport_cls = getattr(transports, transport_name)
    transport = transport_cls(group=None, src=SENDER)
    if ctx.config.trace:
        _trace_calls(transport, ctx.trace, ("prepare", "exchange_header", "agree", "send_segment", "send_failure", "wait_sent", "receive_segments", "finish"))
    sync_config = SyncConfig(bucket_bytes=ctx.config.bucket_bytes, timeout_s=ctx.config.collective_timeout_s)
    names = [p.name for p in ctx.params]

    if ctx.is_sender:
        sender = Sender(transport, sync_config, backend=backend)
        pairs = list(zip(names, ctx.tensors))
        if ctx.config.trace:
            _trace_calls(sender, ctx.trace, ("_pack",))  # private: profiling only, tolerated to vanish

        def run() -> None:
            ctx.step += 1
            metrics = sender.send(TensorSource(pairs), version=ctx.step)
            ctx.metrics.append(_metrics_dict(metrics))

        def teardown() -> None:
            _close(sender)
            _close(transport)

        return run, teardown

    specs = [TensorSpec(p.name, tuple(p.shape), p.dtype) for p in ctx.params]
    receiver = Receiver(transport, specs, timeout_s=ctx.config.collective_timeout_s, backend=backend)
    destination = dict(zip(names, ctx.tensors))
    apply: Any
    if target == "copy_into":
        apply = copy_into(destination)
    elif target == "copy":

        def apply(pairs: list[tuple[str, torch.Tensor]]) -> None:
            for name, view in pairs:
                destination[name].copy_(view)

    else:

        def apply(pairs: list[tuple[str, torch.Tensor]]) -> None:
            for _name, view in pairs:
                _read_all(view)

    if ctx.config.trace:
        untraced = as_sink(apply)

        class Traced:  # the same sink (destinations included), its apply timed: tracing does not change the path
            def destination(self, name: str) -> torch.Tensor | None:
                return untraced.destination(name)

            def apply(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
                t0 = time.perf_counter()
                try:
                    untraced.apply(pairs)
                finally:
                    ctx.trace.append(("apply", len(pairs), t0, time.perf_counter()))

            def abort(self) -> None:
                untraced.abort()

        apply = Traced()

    def run() -> None:
        metrics = receiver.receive(apply)
        ctx.metrics.append(_metrics_dict(metrics))

    def teardown() -> None:
        _close(receiver)
        _close(transport)

    return run, teardown


def _read_all(tensor: torch.Tensor) -> int:
    """Read every byte of `tensor` once (a wrapping sum of its words), allocating nothing large."""
    raw = tensor.reshape(-1).view(torch.uint8)
    words = raw.numel() // 8
    total = int(raw[: words * 8].view(torch.int64).sum()) if words else 0
    return total + int(raw[words * 8 :].sum())


def _trace_calls(obj: Any, log: list[tuple[str, Any, float, float]], names: tuple[str, ...]) -> None:
    """Shadow `obj`'s methods `names` with wrappers that append (name, first arg, start, end) to `log`."""
    for name in names:
        method = getattr(obj, name, None)
        if method is None:
            continue

        def wrapper(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                first = args[0] if args else None
                if not isinstance(first, int):  # a Bucket's index; never a tensor (or its methods)
                    first = getattr(first, "index", None)
                    first = first if isinstance(first, int) else None
                log.append((_name, first, t0, time.perf_counter()))

        setattr(obj, name, wrapper)


def _close(obj: Any) -> None:
    for name in ("close", "shutdown"):
        fn = getattr(obj, name, None)
        if callable(fn):
            fn()
            return


def _metrics_dict(metrics: Any) -> dict[str, Any]:
    if metrics is None:
        return {}
    if hasattr(metrics, "as_dict"):
        return dict(metrics.as_dict())
    return {}


SETUPS: dict[str, Callable[[RankContext], tuple[Callable[[], None], Callable[[], None]]]] = {
    "floor_with_copy": _setup_floor_with_copy,
    "floor": _setup_floor,
    "per_tensor": _setup_per_tensor,
    "hal_bucketed": lambda ctx: _setup_hal(ctx, "BroadcastTransport", "copy_into"),
    "hal_shm": lambda ctx: _setup_hal(ctx, "IpcTransport", "copy_into"),
    "hal_bucketed_copy": lambda ctx: _setup_hal(ctx, "BroadcastTransport", "copy"),
    "hal_bucketed_read": lambda ctx: _setup_hal(ctx, "BroadcastTransport", "read"),
    "hal_shm_read": lambda ctx: _setup_hal(ctx, "IpcTransport", "read"),
}

# Methods whose run leaves the receiver's destinations filled (and so can be verified).
_FILLS_DESTINATIONS = {"floor", "floor_with_copy", "per_tensor", "hal_bucketed", "hal_shm", "hal_bucketed_copy"}


# ---------------------------------------------------------------------------------------
# one rank


def _rank_main(rank: int, out: Any, port: int, config: TransferConfig) -> None:
    import torch.distributed as dist

    try:
        torch.set_num_threads(config.threads)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=config.collective_timeout_s),
        )
        out.put((rank, "ok", _rank_body(rank, config)))
    except BaseException:  # noqa: BLE001 - reported to the parent whatever it is
        out.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


@dataclass(slots=True)
class _MethodState:
    ctx: RankContext
    run: Callable[[], None]
    teardown: Callable[[], None]
    peak_extra: int | None = None
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def _rank_body(rank: int, config: TransferConfig) -> dict[str, Any]:
    import dataclasses

    import torch.distributed as dist

    began = time.perf_counter()
    params = get_preset(config.preset).params()
    offsets, total = _layout(params)
    flat = torch.empty(total, dtype=torch.uint8)
    if rank == SENDER:
        _fill_pattern(flat)
    else:
        flat.zero_()  # touch every page now, so it is part of the baseline
    tensors = _views(flat, params, offsets)
    base = RankContext(rank=rank, config=config, params=params, flat=flat, tensors=tensors)
    memory = PeakMemory()
    report: dict[str, Any] = {"rank": rank, "total_bytes": total, "tensors": len(params), "methods": {}}
    report["setup_wall_s"] = time.perf_counter() - began

    def one(method: str, state: _MethodState, label: str) -> tuple[float, float, float]:
        dist.barrier()
        state.ctx.trace.clear()
        c0 = time.process_time()
        t0 = time.perf_counter()
        state.run()
        t1 = time.perf_counter()
        c1 = time.process_time()
        if rank == RECEIVER:
            if config.verify and method in _FILLS_DESTINATIONS and not _matches_pattern(flat):
                raise RuntimeError(f"{method}: {label}: parameter {_first_mismatch(flat, params, offsets)!r} arrived with wrong bytes")
            flat.zero_()  # the next repetition must write every byte again
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
        }
        if config.trace and state.ctx.trace:
            origin = state.starts[-1]
            report["methods"][method]["trace"] = [(nm, a, t0 - origin, t1 - origin) for nm, a, t0, t1 in state.ctx.trace]
    dist.barrier()
    return report


# ---------------------------------------------------------------------------------------
# the parent


def _spawn_and_wait(config: TransferConfig) -> list[dict[str, Any]]:
    def role_failed(rank: int, text: str) -> None:
        role = "sender" if rank == SENDER else "receiver"
        raise RuntimeError(f"hal bench: the {role} (rank {rank}) failed:\n{text}")

    try:
        return spawn_ranks(
            _rank_main, 2, args=(free_port(), config), timeout_s=config.timeout_s, label="hal-bench-rank", on_failure=role_failed
        )
    except TimeoutError as exc:
        raise TimeoutError(f"hal bench: {exc}") from None


def _median_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return {k: float(statistics.median(r[k] for r in rows if k in r)) for k in keys}


def run_transfer(config: TransferConfig) -> dict[str, Any]:
    """Run the benchmark and return {"preset", "config", "results": [...]} (see module doc)."""
    began = time.perf_counter()
    reports = _spawn_and_wait(config)
    wall = time.perf_counter() - began
    total = reports[SENDER]["total_bytes"]
    results = []
    per_round: dict[str, list[float]] = {}
    for method in config.methods:
        per_rank = [r["methods"][method] for r in reports]
        times = [
            max(ends) - min(starts)
            for starts, ends in zip(zip(*(m["starts"] for m in per_rank)), zip(*(m["ends"] for m in per_rank)))
        ]
        extras = [m["peak_extra_bytes"] for m in per_rank]
        seconds = statistics.median(times)
        per_round[method] = times
        results.append(
            {
                "method": method,
                "seconds": seconds,
                "gib_per_s": total / seconds / GIB,
                "ratio_to_floor": None,
                "peak_extra_bytes": None if None in extras else max(extras),
                "best_seconds": min(times),
                "all_seconds": times,
                "sender_peak_extra_bytes": extras[SENDER],
                "receiver_peak_extra_bytes": extras[RECEIVER],
                "leaves_receiver_owned_copy": method in _FILLS_DESTINATIONS,
                "sender_cpu_s": statistics.median(per_rank[SENDER]["cpu_s"]),
                "receiver_cpu_s": statistics.median(per_rank[RECEIVER]["cpu_s"]),
                **({"trace": {"sender": per_rank[SENDER]["trace"], "receiver": per_rank[RECEIVER]["trace"]}} if "trace" in per_rank[SENDER] else {}),
                "sender_metrics": _median_metrics(per_rank[SENDER]["metrics"]),
                "receiver_metrics": _median_metrics(per_rank[RECEIVER]["metrics"]),
            }
        )
    floor = per_round.get("floor")
    for r in results:
        # The median of the per-round ratios: both times of a ratio come from the same round.
        r["ratio_to_floor"] = statistics.median(t / f for t, f in zip(per_round[r["method"]], floor)) if floor else None
    preset = get_preset(config.preset)
    return {
        "preset": config.preset,
        "bytes": total,
        "tensors": len(preset.params()),
        "config": {**{k: v for k, v in asdict(config).items() if k != "methods"}, "methods": list(config.methods)},
        "timing": f"median of {config.repeats} interleaved rounds after {max(1, config.warmup)} warm-up",
        "torch_threads_per_process": config.threads,
        "setup_wall_s": max(r["setup_wall_s"] for r in reports),
        "wall_s": wall,
        "results": results,
    }


def format_table(report: dict[str, Any]) -> str:
    """The result table as text."""
    lines = [
        f"preset {report['preset']}: {report['bytes'] / GIB:.3f} GiB in {report['tensors']} tensors; "
        f"bucket {report['config']['bucket_bytes'] / MIB:g} MiB; {report['timing']}; "
        f"{report['torch_threads_per_process']} torch thread(s) per process",
        f"{'method':<18} {'seconds':>8} {'best':>8} {'GiB/s':>7} {'x floor':>8} {'peak extra MiB':>15} "
        f"{'(send / recv)':>14} {'cpu s (send / recv)':>20}",
    ]
    for r in report["results"]:
        ratio = "-" if r["ratio_to_floor"] is None else f"{r['ratio_to_floor']:.2f}"

        def mib(v: int | None) -> str:
            return "n/a" if v is None else f"{v / MIB:.0f}"

        lines.append(
            f"{r['method']:<18} {r['seconds']:>8.3f} {r['best_seconds']:>8.3f} {r['gib_per_s']:>7.2f} {ratio:>8} "
            f"{mib(r['peak_extra_bytes']):>15} {'(' + mib(r['sender_peak_extra_bytes']) + ' / ' + mib(r['receiver_peak_extra_bytes']) + ')':>14} "
            f"{r['sender_cpu_s']:>9.3f} / {r['receiver_cpu_s']:<8.3f}"
        )
    return "\n".join(lines)
