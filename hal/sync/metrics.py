"""What one sync did and how long each part took.

A phase that did not happen on this side is None, not 0.0: a timer reports only work
that was done (verl PR 4655 review: offload timers that measured nothing).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Iterator


@dataclass(slots=True)
class SyncMetrics:
    version: int | None = None
    bytes: int = 0
    """Bytes of tensor data that travelled (checksums and padding excluded). Over links, each
    worker taking only its own pieces (hal.sync.send.links, hal.sync.receive.links): on a
    trainer rank, what it sent (its share times the workers that need it, `bytes_out`); on an
    engine worker, what it received (its shard plus its replicated tensors, `bytes_in`)."""
    buckets: int = 0
    tensors: int = 0
    gather_s: float | None = None
    """Materializing source tensors (e.g. FSDP full_tensor), sender only."""
    pack_s: float | None = None
    """Waiting for packs into the bucket, sender only."""
    transfer_s: float | None = None
    """Waiting for the transport."""
    apply_s: float | None = None
    """Placing received tensors, receiver only: copies into destinations and reassembly
    buffers, and the time inside the apply callable."""
    total_s: float = 0.0
    host_s: float | None = None
    """CPU time of the thread that ran the sync (`time.thread_time`): Python and what it
    did itself (host copies on the cpu backend; not the waits, nor work on device streams or
    a sim stream's thread). Divided by `tensors`: the per-tensor host cost (`hal bench`)."""
    plan_reused: bool = False
    # ---- delta sync (SyncConfig.delta); None/empty without it -----------------------
    delta: bool | None = None
    """This sync carried deltas against the previous version (False: a whole, anchor sync)."""
    wire_bytes: int | None = None
    """Bytes of the segments as sent (deltas where smaller), against `dense_wire_bytes`."""
    dense_wire_bytes: int | None = None
    """Bytes the same segments take whole (tensors, alignment gaps, checksums)."""
    changed_fraction: float | None = None
    """Share of the compared bytes whose words changed since the previous version."""
    segments_by_encoding: dict | None = None
    """How many segments went whole ("dense") or as "indices" / "bitmask" deltas."""
    encode_s: float | None = None
    """Comparing with the baseline and encoding, sender only."""
    delta_choice: str | None = None
    """Why this sync went as it did: "anchor" (whole, by rule: first sync, `anchor_every`,
    after a failure, a new layout, a receiver without the base), "delta" (every segment
    compared), "stopped" (comparing stopped partway: the encode cost more than the wire
    time it could save), "paused" (whole: delta syncs have not paid lately)."""
    compared_bytes: int | None = None
    """Bytes compared with the baseline (the rest went whole without a compare)."""
    sampled_bytes: int | None = None
    """Bytes encoded only to time the compare (choose="time"; their segments went whole)."""
    baseline_bytes: int | None = None
    """Memory the sender keeps for delta sync: one image of the last complete sync."""
    sending: str | None = None
    """Which trainer ranks sent this sync (hal.sync.config.SENDING: "one", "gather", "all");
    None on a receiving rank."""
    # ---- several senders (hal.sync.send.sharded); None with one -------------------------
    senders: int | None = None
    """Trainer ranks that each sent their own shares of the model."""
    model_bytes: int | None = None
    """Bytes of the whole model; `bytes` is what this rank sent (or received in all)."""
    # ---- links: each worker only its pieces (hal.sync.send.links); None otherwise -------------
    links: int | None = None
    """Point-to-point links this rank sent over (one per engine worker) or received over
    (one per trainer rank)."""
    largest_link_bytes: int | None = None
    """The bytes of this rank's largest link."""
    layers: int | None = None
    """Engine worker: the layers its sink completed (landed whole and processed) in this sync."""
    worker_bytes: tuple[int, ...] | None = None
    """Trainer rank: per engine worker (in group-rank order), the bytes the sync's plan brings
    it from every trainer rank together: its shard plus its replicated tensors."""

    @property
    def gib_per_s(self) -> float | None:
        return self.bytes / self.total_s / 2**30 if self.total_s > 0 and self.bytes else None

    @property
    def host_us_per_tensor(self) -> float | None:
        return self.host_s / self.tensors * 1e6 if self.host_s is not None and self.tensors else None

    def as_dict(self) -> dict:
        out = asdict(self)
        out["gib_per_s"] = self.gib_per_s
        out["host_us_per_tensor"] = self.host_us_per_tensor
        return out


@dataclass(slots=True)
class PhaseTimer:
    """Accumulates seconds per phase; a phase never entered stays None."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def get(self, phase: str) -> float | None:
        return self.seconds.get(phase)
