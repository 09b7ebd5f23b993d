"""The transfer benchmark's vocabulary: its method names, `TransferConfig`, the simulated
node layout, and which receivers a method fills (so they can be checked).

The methods themselves are in hal.tools.bench.transfer_methods; what they measure is
described in hal.tools.bench.transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

from hal.tools.bench.common import MIB, SENDER
from hal.tools.bench.presets import Param, get_preset

# Methods every run reports (the four), then the read-in-place variants.
CORE_METHODS = ("floor", "per_tensor", "hal_bucketed", "hal_shm")
# hal_bucketed_copy: an apply that copies every view (a load_weights-style target).
COPY_METHODS = ("hal_bucketed_copy",)
READ_METHODS = ("hal_bucketed_read", "hal_shm_read")
# The flat broadcast while each process copies a model-sized buffer: the best a bucketed
# sync (one pack copy, one apply copy) could do if its copies overlapped perfectly; and the
# same copies pipelined segment by segment around the wire, as a bucketed sync must.
BOUND_METHODS = ("floor_with_copy", "floor_pipelined")
# What a run with no --methods measures with one receiver on one node.
ALL_METHODS = CORE_METHODS + COPY_METHODS + READ_METHODS + BOUND_METHODS
# Several receivers / nodes: the hierarchical transport, and the network floor it is held to
# (one flat broadcast to one receiver per node). Added to the default when --receivers >= 2
# or --nodes >= 2; any run may ask for them.
TOPOLOGY_METHODS = ("hal_hier", "floor_leaders")
# Shared memory needs every rank on one node: not with simulated nodes (--nodes >= 2).
SHM_METHODS = ("hal_shm", "hal_shm_read")
METHODS = ALL_METHODS + TOPOLOGY_METHODS

SENDER_NODE = "trainer"
# Where each process keeps its tensors (TransferConfig.layout).
LAYOUTS = ("flat", "scattered")
# Methods whose run leaves every receiver's destinations filled (and so can be verified).
FILLS_DESTINATIONS = {"floor", "floor_with_copy", "floor_pipelined", "per_tensor", "hal_bucketed", "hal_shm", "hal_bucketed_copy", "hal_hier"}


def writes_tensors(method: str) -> bool:
    """Whether `method` moves the tensors themselves (else the flat buffer: the floors)."""
    return method == "per_tensor" or method.startswith("hal_")


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
    sync_backend: str = "cpu"
    """The backend hal's syncs run on ("cpu" or "sim"; the weights are in host memory either
    way). On sim the copies run on its streams' threads, so a sync's host time is its own
    Python."""
    layout: str = "flat"
    """Where each process keeps its tensors: "flat", views of one buffer in plan order (a
    flat parameter's or a parameter buffer's layout; the floors' own buffer), or
    "scattered", each tensor its own allocation (a model's parameters, an engine's
    weights), holding the same bytes. The floors move the flat buffer either way."""
    threads: int = 1
    """torch intra-op threads in each process. Two processes share this machine's cores;
    with more threads than free cores every parallel copy waits for a descheduled
    OpenMP thread (measured here: packing 0.92 GiB took 2.4-3.4 s with 2 threads on a
    loaded 2-core machine, 0.25 s with 1)."""

    def __post_init__(self) -> None:
        get_preset(self.preset)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: {self.layout!r}; choose one of {', '.join(LAYOUTS)}")
        if self.sync_backend not in ("cpu", "sim"):
            raise ValueError(f"sync_backend: {self.sync_backend!r} is not a host-memory backend; choose cpu or sim")
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


def fills(method: str, rank: int, config: TransferConfig) -> bool:
    """Whether `method` leaves every byte in `rank`'s destinations (then it is checked)."""
    if rank == SENDER:
        return False
    if method == "floor_leaders":
        return rank in node_leaders(config.receivers, config.nodes)
    return method in FILLS_DESTINATIONS
