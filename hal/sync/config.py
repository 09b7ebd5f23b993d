"""Typed configuration of a weight sync."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hal.backends.interface import Backend

MIB = 1 << 20

ONE, GATHER, ALL = "one", "gather", "all"
SENDING = (ONE, GATHER, ALL)
"""Which trainer ranks send a sync, in the words every part of hal uses (`make_sender`,
`WeightSync(senders=)`, verl's `senders` setting, `SyncMetrics.sending`): "one", this
process alone holds the model and sends it; "gather", a sharded trainer's ranks gather in
lockstep and one of them sends; "all", every trainer rank sends its own rows."""


@dataclass(kw_only=True, slots=True, frozen=True)
class DeltaConfig:
    """Delta sync: send only what changed since the last complete sync (docs/delta.md)."""

    anchor_every: int = 16
    """A whole (dense) sync every this many syncs, whatever else happens: bounds how long a
    receiver that joins depends on history, and re-checks everything now and then."""

    baseline: str = "device"
    """Where the sender keeps the bytes it last sent (the baseline it compares against):
    "device" (fastest to compare) or "host" (pinned host memory, freeing device memory)."""

    choose: str = "time"
    """How a sync decides to send deltas. "time": only while they make syncs faster, by the
    sender's own measurements: a delta sync only while the compare is faster per byte than
    recent whole syncs (timed on small samples during whole ones), stopped partway when its
    encode falls behind, and paused for 2, 4, ... up to 64 syncs after each loss; whole
    syncs cost no more than without delta. "bytes": every segment in its smallest
    encoding, whatever the encode costs (metered or very slow links). docs/delta.md,
    "Choosing by time"."""

    def __post_init__(self) -> None:
        if isinstance(self.anchor_every, bool) or not isinstance(self.anchor_every, int) or self.anchor_every < 1:
            raise ValueError(f"DeltaConfig.anchor_every must be an int of at least 1, got {self.anchor_every!r}")
        if self.baseline not in ("device", "host"):
            raise ValueError(f"DeltaConfig.baseline must be 'device' or 'host', got {self.baseline!r}")
        if self.choose not in ("time", "bytes"):
            raise ValueError(f"DeltaConfig.choose must be 'time' or 'bytes', got {self.choose!r}")


@dataclass(frozen=True, slots=True)
class WaitBounds:
    """Every bound a sync's waits derive from one timeout setting, computed here and nowhere
    else (`SyncConfig.bounds` for a sender, a receiver's from its own `timeout_s`)."""

    timeout_s: float

    @property
    def step_s(self) -> float:
        """One wait for a peer: one transfer, one agreement."""
        return self.timeout_s

    @property
    def behind_s(self) -> float:
        """A wait for a peer that may itself be waiting out a step on another group first
        (a trainer rank while the sending rank waits on the sync group; a sender of several
        at its final agreement, while the receivers wait for the other senders' bytes)."""
        return 2 * self.timeout_s


@dataclass(kw_only=True, slots=True)
class SyncConfig:
    """How a sync moves weights: the sending side's settings.

    Only the `Sender` takes a `SyncConfig`. Every receiver learns the bucket and segment
    sizes and whether to verify from the header of each sync, so the two sides cannot
    disagree; a receiver's only setting of its own is how long it waits (`timeout_s` of
    `Receiver`).
    """

    bucket_bytes: int | None = None
    """Size of one bucket in bytes. None: derived from the device's free memory
    (see `default_bucket_bytes`). Two buckets are in use at a time on each side."""

    segment_bytes: int | None = 32 * MIB
    """Largest single transfer: a bucket travels as segments of about this size, each sent
    as soon as it is packed and applied (its whole tensors) as soon as it arrives, so the
    pipeline fills and drains in one segment instead of one bucket. None: one transfer per
    bucket. Taken from the sender by every receiver; ignored by transports that move no
    bytes (shared memory)."""

    bypass_cpu: bool = True
    """True: pack device tensors straight into the device bucket. False: stage them
    through a reused pinned host buffer first (what parameter snapshots need)."""

    wire_dtype: torch.dtype | None = None
    """Cast floating-point tensors wider than this dtype to it on the wire (fp32 master
    weights to a bf16 engine); narrower ones (fp8 next to a bf16 wire) travel as they
    are, never widened. None: send each tensor in its own dtype. See `wire_dtype_for`."""

    verify: bool = False
    """Send a checksum of every piece; receivers compare before applying and fail the
    sync on a mismatch."""

    timeout_s: float = 60.0
    """Longest wait for any one transfer or agreement with the peers before the sync
    fails with PeerError instead of hanging."""

    delta: DeltaConfig | None = None
    """Delta sync (`DeltaConfig`): after a complete sync, later ones send per segment only
    the words that changed, when that is smaller. None: every sync sends everything."""

    @property
    def bounds(self) -> WaitBounds:
        """The waits of a sync, derived from `timeout_s`."""
        return WaitBounds(self.timeout_s)

    def __post_init__(self) -> None:
        if self.bucket_bytes is not None and (not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 4096):
            raise ValueError(f"SyncConfig.bucket_bytes must be an int of at least 4096 bytes, got {self.bucket_bytes!r}")
        if self.segment_bytes is not None and (not isinstance(self.segment_bytes, int) or self.segment_bytes < 4096):
            raise ValueError(f"SyncConfig.segment_bytes must be None or an int of at least 4096 bytes, got {self.segment_bytes!r}")
        if self.wire_dtype is not None and not (isinstance(self.wire_dtype, torch.dtype) and self.wire_dtype.is_floating_point):
            raise ValueError(f"SyncConfig.wire_dtype must be a floating-point torch.dtype or None, got {self.wire_dtype!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"SyncConfig.timeout_s must be positive, got {self.timeout_s!r}")
        if self.delta is not None and not isinstance(self.delta, DeltaConfig):
            raise ValueError(f"SyncConfig.delta must be a DeltaConfig or None, got {self.delta!r}")


def wire_dtype_for(dtype: torch.dtype, wire_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of `dtype` travels in under `SyncConfig.wire_dtype`: floating-point
    dtypes wider than the wire dtype are cast down to it; everything else is left alone
    (an fp8 weight beside a bf16 wire would double its bytes if widened)."""
    if wire_dtype is None or not dtype.is_floating_point or dtype.itemsize <= wire_dtype.itemsize:
        return dtype
    return wire_dtype


def default_bucket_bytes(backend: Backend, largest_tensor_bytes: int = 0, sender_count: int = 1) -> int:
    """1/64 of free device memory, between 32 MiB and 256 MiB, rounded to whole MiB;
    raised to hold the largest tensor whole when two such buckets take at most 1/8 of
    free memory. With several senders into the same receivers (every trainer rank sends,
    hal.sync.send.sharded) each takes 1/`sender_count` of that (at least 1 MiB): a receiver holds two
    buckets per sender, and all of them add up to what one sender's would.

    Two buckets per side must fit beside the model and the engine's KV cache; past a few
    hundred MiB a larger bucket only delays the first transfer. A tensor larger than the
    bucket is split and reassembled, which costs the receiver an extra buffer and copy
    (measured in docs/benchmarks.md), so a little more memory is worth avoiding it.
    """
    free = backend.memory_info().free
    size = max(32 * MIB, min(256 * MIB, free // 64 // MIB * MIB))
    size = max(MIB, size // max(1, sender_count) // MIB * MIB)
    whole = -(-(largest_tensor_bytes + 64 * 1024) // MIB) * MIB  # room for alignment and checksums
    if whole > size and 2 * whole <= free // 8:
        size = whole
    return size
