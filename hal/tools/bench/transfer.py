"""The transfer benchmark: one sender process, K receiver processes (default 1), gloo between them.

Weights live in host memory and hal's sync runs on the `cpu` backend whatever
VERL_DEVICE says: this measures the same-node CPU path, where the floor is gloo over
loopback. (Device-to-device NCCL/HCCL runs are not covered here.)

All 1 + K processes are spawned fresh and joined by one gloo group that is created once
and reused by every method (as a trainer-engine group would be). The parent process only
waits, with a deadline: a rank that fails or outlives the deadline gets every rank
killed, so no process is left behind.

What each method must leave at every receiver is the same: every tensor's bytes in
receiver-owned memory (a preallocated destination tensor per parameter).

    floor          one broadcast of one flat tensor holding all the bytes, to all K
                   receivers; the weights and the destinations are views into those flat
                   tensors, so nothing is packed or copied: the transport's floor.
    per_tensor     one broadcast per parameter, straight into its destination (what most
                   trainers do today).
    hal_bucketed   hal.sync's Sender/Receiver over BroadcastTransport (send/recv pairs for
                   one receiver on gloo, broadcasts for two or more) into the receiver's
                   destinations through `copy_into` (hal's apply for preallocated
                   tensors): a tensor that travels in transfers of its own is sent
                   from the sender's tensor and received straight into its
                   destination; small tensors travel packed in buckets and are copied.
    hal_shm        the same over IpcTransport (same-node shared memory; every tensor is
                   copied out of the shared slot). Not with --nodes >= 2: shared memory
                   needs every rank on one node, which the simulated nodes deny.
    hal_hier       the same over HierarchicalTransport: ranks grouped by node key
                   (VERL_HAL_NODE, set per process: "trainer" for the sender, node<i> for
                   the receivers: all on node0 without --nodes, else spread over N nodes in
                   contiguous blocks). Per node one leader receives over the network, the
                   others read its shared buffer; the sender's `network_bytes` must grow
                   by exactly nodes x the sync's segment bytes per sync (checked).
    hal_bucketed_copy
                   hal_bucketed with an apply callable that copies every view (a
                   load_weights-style target that names no destinations).
    floor_with_copy
                   the flat broadcast, started asynchronously, while each process copies
                   as many bytes as the model holds (through a 64 MiB scratch pair): where
                   a bucketed sync (one pack copy at the sender, one apply copy at the
                   receiver) would land if its copies overlapped the transfer perfectly.
    floor_leaders  one flat broadcast to one receiver per node only (the hal_hier leaders,
                   over a subgroup of the sender and the leaders): the network floor of
                   the hierarchical path, run in the same rounds. With every receiver on
                   one node it is the 1-receiver floor. Only the leaders hold the bytes
                   (and are checked).
    *_read         the hal methods again with an apply callable that reads every byte of
                   the views (a sum of their 8-byte words) and copies nothing: what a
                   consumer that uses the bucket in place would pay. NOT comparable to
                   floor: nothing is left in receiver-owned memory afterwards.

Timing: each repetition starts after a garbage collection (of the bench's own objects,
outside the timed region, as `timeit` does) and a barrier; its time is the latest end minus the
earliest start over all processes (`time.perf_counter`, CLOCK_MONOTONIC, shared by the
processes of a node). First every method, one after the other, creates its objects and
runs its warm-up repetitions (at least one; memory is measured here, see below). Then
the measured repetitions run in interleaved rounds: round r runs every method once,
starting at method r, so a burst of load from other work on the machine hits all methods
alike. `seconds` is the median over rounds (the best is reported too); `ratio_to_floor`
is the median over rounds of the method's time over the floor's time in the same round. After every repetition the
receiver checks every byte of the destinations against the sender's (deterministic)
pattern and clears them, both outside the timed region (every receiver that a method
fills: `verified_ranks` in the JSON), and only once every rank has left it (a barrier),
so that no receiver checks or clears its bytes while another still receives.

Network bytes per sync (`network_bytes_per_sync`): what crossed the network (here gloo
over loopback) in one sync: K models for the flat broadcasts (every receiver gets its
bytes over a socket, however gloo routes them), K x the plan's segment bytes for
BroadcastTransport, the nodes' leaders' count x model (or segment) bytes for
floor_leaders, 0 for shared memory, and for hal_hier what the sender's
HierarchicalTransport counted (`network_bytes`). Control messages are not counted.

CPU: `time.process_time()` around each repetition in each process (all its threads, user
and system, so gloo's socket copies count); the medians are reported as `sender_cpu_s` and
`receiver_cpu_s` (the largest over the receivers), every rank's in `cpu_s_per_rank`. On
a machine with fewer free cores than busy threads, their sum divided by the cores bounds
the time from below.

Memory: per process, the Linux resident-set high-water mark (VmHWM) is reset through
/proc/self/clear_refs just before a method's objects (transports, senders, receivers) are
created (the baseline), and again after each warm-up repetition's verification; the
largest `VmHWM - baseline` read right after a warm-up repetition is that process's peak
extra memory: everything the method allocated and touched beyond the weights, the
destinations (allocated and touched before any method runs) and the objects of the
methods set up before it (alive from their setup to the end of the run).
`peak_extra_bytes` is the largest over the processes; every rank's is in
`peak_extra_bytes_per_rank`. Pages of a shared-memory file count in the RSS of every
process that touches them.
"""

from __future__ import annotations

import datetime
import gc
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from hal.tools.bench.presets import Param, get_preset
from hal.procs import free_port, run_gloo_rank, spawn_ranks

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
# What a run with no --methods measures with one receiver on one node (unchanged since session 1).
ALL_METHODS = CORE_METHODS + COPY_METHODS + READ_METHODS + BOUND_METHODS
# Several receivers / nodes: the hierarchical transport, and the network floor it is held to
# (one flat broadcast to one receiver per node). Added to the default when --receivers >= 2
# or --nodes >= 2; any run may ask for them.
TOPOLOGY_METHODS = ("hal_hier", "floor_leaders")
# Shared memory needs every rank on one node: not with simulated nodes (--nodes >= 2).
SHM_METHODS = ("hal_shm", "hal_shm_read")
METHODS = ALL_METHODS + TOPOLOGY_METHODS

SENDER, RECEIVER = 0, 1  # RECEIVER: the first receiver (ranks 1..K receive)
SENDER_NODE = "trainer"
_PATTERN_PERIOD = 1_048_573  # a prime number of bytes: a tensor at a wrong offset does not match by accident


@dataclass(kw_only=True, slots=True)
class TransferConfig:
    """What one `run_transfer` call measures."""

    preset: str
    """A name from hal.tools.bench.presets.PRESETS."""
    methods: tuple[str, ...] = ALL_METHODS
    """Which methods, in the order they run (`default_methods(receivers, nodes)` is what
    the CLI runs when none are named)."""
    receivers: int = 1
    """Receiver processes (ranks 1..K); the sender is rank 0."""
    nodes: int = 1
    """Simulated nodes the receivers are spread over (contiguous blocks, `node_keys`); the
    sender is on a node of its own. 1: every receiver on one node."""
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
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"methods: unknown {unknown}; valid: {', '.join(METHODS)}")
        if not self.methods:
            raise ValueError("methods: at least one method is needed")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods: listed twice: {list(self.methods)}")
        if not isinstance(self.receivers, int) or self.receivers < 1:
            raise ValueError(f"receivers must be at least 1, got {self.receivers!r}")
        if not isinstance(self.nodes, int) or not 1 <= self.nodes <= self.receivers:
            raise ValueError(f"nodes must be between 1 and receivers ({self.receivers}), got {self.nodes!r}")
        shm = [m for m in self.methods if m in SHM_METHODS]
        if self.nodes > 1 and shm:
            raise ValueError(f"methods {shm} need every rank on one node (shared memory); not with nodes={self.nodes}")
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


def default_methods(receivers: int = 1, nodes: int = 1) -> tuple[str, ...]:
    """What runs when no methods are named: ALL_METHODS for one receiver on one node (as
    always); with several receivers or nodes also TOPOLOGY_METHODS, and without the
    shared-memory methods when the receivers are on several (simulated) nodes."""
    if receivers == 1 and nodes == 1:
        return ALL_METHODS
    methods = ALL_METHODS + TOPOLOGY_METHODS
    return tuple(m for m in methods if m not in SHM_METHODS) if nodes > 1 else methods


def node_keys(receivers: int, nodes: int) -> list[str]:
    """The VERL_HAL_NODE of every rank: the sender on a node of its own, the receivers
    spread over `nodes` in contiguous blocks (4 receivers on 2 nodes: 2 and 2)."""
    return [SENDER_NODE] + [f"node{r * nodes // receivers}" for r in range(receivers)]


def node_leaders(receivers: int, nodes: int) -> list[int]:
    """The lowest rank of each receivers' node: who gets the bytes over the network in
    hal_hier (HierarchicalTransport's `leader_of`), and floor_leaders' receivers."""
    keys = node_keys(receivers, nodes)
    return sorted({min(r for r in range(1, len(keys)) if keys[r] == key) for key in keys[1:]})


def plan_segment_bytes(params: list[Param], bucket_bytes: int) -> int:
    """The bytes that travel in one hal sync of `params` (the sum of its plan's segments,
    as a Sender with SyncConfig(bucket_bytes=bucket_bytes) cuts it: data and the padding
    inside segments; no checksums)."""
    from hal.sync import SyncConfig, build_plan

    plan = build_plan(params, bucket_bytes, verify=False, segment_bytes=SyncConfig(bucket_bytes=bucket_bytes).segment_bytes)
    return sum(seg.stop - seg.start for b in plan.buckets for seg in b.segments)


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

    def reset(self, collect: bool = True) -> None:
        """Take the current RSS as the baseline and start a new peak from it (after a
        gc.collect() unless `collect` is False: the caller just ran one)."""
        if collect:
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
    network: list[int] = field(default_factory=list)  # hal_hier, sender: bytes over the network per sync

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


def _setup_floor_leaders(ctx: RankContext) -> tuple[Callable[[], None], Callable[[], None]]:
    import torch.distributed as dist

    # Every rank takes part in creating the subgroup (torch.distributed requires it);
    # only its members broadcast.
    members = [SENDER] + node_leaders(ctx.config.receivers, ctx.config.nodes)
    group = dist.new_group(ranks=members, backend="gloo", timeout=datetime.timedelta(seconds=ctx.config.collective_timeout_s))

    def run() -> None:
        if ctx.rank in members:
            dist.broadcast(ctx.flat, src=SENDER, group=group)

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
    from hal.sync import hierarchy, transport as transports

    backend = get_backend("cpu")  # host weights and gloo, whatever VERL_DEVICE says

    transport_cls = getattr(transports, transport_name, None) or getattr(hierarchy, transport_name)
    transport = transport_cls(group=None, src=SENDER)  # HierarchicalTransport reads VERL_HAL_NODE here
    hierarchical = isinstance(transport, hierarchy.HierarchicalTransport)
    if hierarchical:
        _check_layout(ctx, transport)
    if ctx.config.trace:
        _trace_calls(transport, ctx.trace, ("prepare", "exchange_header", "agree", "send_segment", "send_failure", "wait_sent", "receive_segments", "finish"))
    sync_config = SyncConfig(bucket_bytes=ctx.config.bucket_bytes, timeout_s=ctx.config.collective_timeout_s)
    names = [p.name for p in ctx.params]

    if ctx.is_sender:
        sender = Sender(transport, sync_config, backend=backend)
        pairs = list(zip(names, ctx.tensors))
        if ctx.config.trace:
            _trace_calls(sender, ctx.trace, ("_pack",))  # private: profiling only, tolerated to vanish

        # one model's segments per node: without --nodes every receiver is on one node
        expected_network = ctx.config.nodes * plan_segment_bytes(ctx.params, ctx.config.bucket_bytes) if hierarchical else 0

        def run() -> None:
            ctx.step += 1
            before = transport.network_bytes if hierarchical else 0
            metrics = sender.send(TensorSource(pairs), version=ctx.step)
            ctx.metrics.append(_metrics_dict(metrics))
            if hierarchical:
                sent = transport.network_bytes - before
                ctx.network.append(sent)
                if sent != expected_network:  # an int compare: nothing measurable inside the timed run
                    raise RuntimeError(
                        f"hal_hier: {sent} bytes crossed the network in sync {ctx.step}, expected nodes ({ctx.config.nodes}) "
                        f"x the sync's segment bytes = {expected_network}"
                    )

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
            policy = untraced.policy

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


def _check_layout(ctx: RankContext, transport: Any) -> None:
    """HierarchicalTransport saw the nodes this benchmark set up: every rank's key, the
    leaders, and (on the sender) one network peer per node."""
    keys = node_keys(ctx.config.receivers, ctx.config.nodes)
    leaders = node_leaders(ctx.config.receivers, ctx.config.nodes)
    problems = []
    if list(transport.layout.nodes) != keys:
        problems.append(f"node keys {list(transport.layout.nodes)}, expected {keys}")
    if ctx.is_sender and list(transport.remote_leaders) != leaders:
        problems.append(f"remote leaders {list(transport.remote_leaders)}, expected {leaders}")
    if not ctx.is_sender and transport.leader != min(r for r in range(1, len(keys)) if keys[r] == keys[ctx.rank]):
        problems.append(f"rank {ctx.rank}'s leader is {transport.leader}")
    if problems:
        raise RuntimeError("hal_hier: " + "; ".join(problems))


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
    "hal_hier": lambda ctx: _setup_hal(ctx, "HierarchicalTransport", "copy_into"),
    "floor_leaders": _setup_floor_leaders,
}

# Methods whose run leaves every receiver's destinations filled (and so can be verified).
_FILLS_DESTINATIONS = {"floor", "floor_with_copy", "per_tensor", "hal_bucketed", "hal_shm", "hal_bucketed_copy", "hal_hier"}


def fills(method: str, rank: int, config: TransferConfig) -> bool:
    """Whether `method` leaves every byte in `rank`'s destinations (then it is checked)."""
    if rank == SENDER:
        return False
    if method == "floor_leaders":
        return rank in node_leaders(config.receivers, config.nodes)
    return method in _FILLS_DESTINATIONS


# ---------------------------------------------------------------------------------------
# one rank


def _rank_main(rank: int, out: Any, port: int, config: TransferConfig) -> None:
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
    offsets, total = _layout(params)
    flat = torch.empty(total, dtype=torch.uint8)
    if rank == SENDER:
        _fill_pattern(flat)
    else:
        flat.zero_()  # touch every page now, so it is part of the baseline
    tensors = _views(flat, params, offsets)
    base = RankContext(rank=rank, config=config, params=params, flat=flat, tensors=tensors)
    memory = PeakMemory()
    report: dict[str, Any] = {
        "rank": rank,
        "pid": os.getpid(),
        "node": os.environ.get("VERL_HAL_NODE"),
        "total_bytes": total,
        "tensors": len(params),
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
            if config.verify and fills(method, rank, config):
                if not _matches_pattern(flat):
                    raise RuntimeError(
                        f"{method}: {label}: parameter {_first_mismatch(flat, params, offsets)!r} arrived with wrong bytes at rank {rank}"
                    )
                state.verified += 1
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
            "verified": state.verified,
            "network_bytes": state.ctx.network,
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
        role = "sender" if rank == SENDER else f"receiver {rank}" if config.receivers > 1 else "receiver"
        raise RuntimeError(f"hal bench: the {role} (rank {rank}) failed:\n{text}")

    try:
        return spawn_ranks(
            _rank_main, 1 + config.receivers, args=(free_port(), config), timeout_s=config.timeout_s, label="hal-bench-rank", on_failure=role_failed
        )
    except TimeoutError as exc:
        raise TimeoutError(f"hal bench: {exc}") from None


def _median_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return {k: float(statistics.median(r[k] for r in rows if k in r)) for k in keys}


def network_bytes(method: str, config: TransferConfig, total: int, segment_bytes: int, measured: list[int]) -> tuple[int | None, str]:
    """Bytes that crossed the network in one sync of `method`, and how they were counted
    (see the module doc). `measured`: the sender's per-sync counts (hal_hier only)."""
    k = config.receivers
    if method == "hal_hier":
        return (int(statistics.median(measured)) if measured else None), "measured: the sender's HierarchicalTransport.network_bytes"
    if method in SHM_METHODS:
        return 0, "0: shared memory (control messages only)"
    if method == "floor_leaders":
        return config.nodes * total, f"{config.nodes} leader(s) x model bytes"
    if method.startswith("hal_"):  # BroadcastTransport
        return k * segment_bytes, f"{k} receiver(s) x segment bytes"
    return k * total, f"{k} receiver(s) x model bytes"


def run_transfer(config: TransferConfig) -> dict[str, Any]:
    """Run the benchmark and return {"preset", "config", "results": [...]} (see module doc)."""
    began = time.perf_counter()
    reports = _spawn_and_wait(config)
    wall = time.perf_counter() - began
    total = reports[SENDER]["total_bytes"]
    params = get_preset(config.preset).params()
    segment_bytes = plan_segment_bytes(params, config.bucket_bytes)
    receivers = range(1, 1 + config.receivers)
    full = max(1, config.warmup) + config.repeats  # repetitions a verifying rank checks
    results = []
    per_round: dict[str, list[float]] = {}
    for method in config.methods:
        per_rank = [r["methods"][method] for r in reports]
        times = [
            max(ends) - min(starts)
            for starts, ends in zip(zip(*(m["starts"] for m in per_rank)), zip(*(m["ends"] for m in per_rank)))
        ]
        extras = [m["peak_extra_bytes"] for m in per_rank]
        receiver_extras = extras[1:]
        cpu = [statistics.median(m["cpu_s"]) for m in per_rank]
        seconds = statistics.median(times)
        per_round[method] = times
        net, net_how = network_bytes(method, config, total, segment_bytes, per_rank[SENDER].get("network_bytes") or [])
        trace: dict[str, Any] = {}
        if "trace" in per_rank[SENDER]:
            trace = {"trace": {"sender": per_rank[SENDER]["trace"], "receiver": per_rank[RECEIVER].get("trace", [])}}
            if config.receivers > 1:
                trace["trace"]["other_receivers"] = [per_rank[r].get("trace", []) for r in receivers if r != RECEIVER]
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
                "receiver_peak_extra_bytes": None if None in receiver_extras else max(receiver_extras),
                "leaves_receiver_owned_copy": method in _FILLS_DESTINATIONS,
                "sender_cpu_s": cpu[SENDER],
                "receiver_cpu_s": max(cpu[1:]),
                **trace,
                "sender_metrics": _median_metrics(per_rank[SENDER]["metrics"]),
                "receiver_metrics": _median_metrics(per_rank[RECEIVER]["metrics"]),
                # several receivers / nodes (also filled for one)
                "ratio_to_floor_leaders": None,
                "network_bytes_per_sync": net,
                "network_bytes_how": net_how,
                "network_bytes_all": per_rank[SENDER].get("network_bytes") or [],
                "peak_extra_bytes_per_rank": extras,
                "cpu_s_per_rank": cpu,
                "verified_ranks": [r for r in receivers if per_rank[r].get("verified", 0) == full and fills(method, r, config)],
                "receiver_metrics_per_rank": [_median_metrics(per_rank[r]["metrics"]) for r in receivers],
            }
        )
    floor, leaders = per_round.get("floor"), per_round.get("floor_leaders")
    for r in results:
        # The median of the per-round ratios: both times of a ratio come from the same round.
        r["ratio_to_floor"] = statistics.median(t / f for t, f in zip(per_round[r["method"]], floor)) if floor else None
        if leaders:
            r["ratio_to_floor_leaders"] = statistics.median(t / f for t, f in zip(per_round[r["method"]], leaders))
    keys = node_keys(config.receivers, config.nodes)
    return {
        "preset": config.preset,
        "bytes": total,
        "tensors": len(params),
        "config": {**{k: v for k, v in asdict(config).items() if k != "methods"}, "methods": list(config.methods)},
        "timing": f"median of {config.repeats} interleaved rounds after {max(1, config.warmup)} warm-up",
        "torch_threads_per_process": config.threads,
        "setup_wall_s": max(r["setup_wall_s"] for r in reports),
        "wall_s": wall,
        "results": results,
        "receivers": config.receivers,
        "nodes": config.nodes,
        "processes": len(reports),
        "pids": [r["pid"] for r in reports],
        "node_keys": keys,
        "node_leaders": node_leaders(config.receivers, config.nodes),
        "segment_bytes_per_sync": segment_bytes,
    }


def format_table(report: dict[str, Any]) -> str:
    """The result table as text (with network bytes and per-rank columns once there are
    several receivers or nodes, or a topology method ran)."""
    if report.get("receivers", 1) > 1 or report.get("nodes", 1) > 1 or any(r["method"] in TOPOLOGY_METHODS for r in report["results"]):
        return _format_topology_table(report)
    lines = [
        f"preset {report['preset']}: {report['bytes'] / GIB:.3f} GiB in {report['tensors']} tensors; "
        f"bucket {report['config']['bucket_bytes'] / MIB:g} MiB; {report['timing']}; "
        f"{report['torch_threads_per_process']} torch thread(s) per process",
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
        f"preset {report['preset']}: {report['bytes'] / GIB:.3f} GiB in {report['tensors']} tensors; "
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
