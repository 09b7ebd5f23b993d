"""The sender's half of delta sync: what it keeps across syncs (`DeltaSender`: the wire
bytes of the last complete sync, their version and layout, the pacer) and the per-segment
interface the sender calls with delta on or off (`DeltaSegments`, `NO_DELTA`)."""

from __future__ import annotations

import time
from typing import Any

import torch

from hal import kernels
from hal.backends.interface import Backend
from hal.sync.config import DeltaConfig
from hal.sync.delta.pacer import Pacer
from hal.sync.plan.buckets import Bucket, BucketPlan, Segment, bucket_offsets, segment_word


class PackedSegments:
    """Delta off: every segment goes as packed, into the transport's buffer."""

    def pack_target(self, bucket: Bucket, j: int) -> torch.Tensor | None:
        return None

    def clear_gaps(self, target: torch.Tensor, bucket: Bucket, segment: Segment, stream: Any) -> None:
        pass

    def checksum_base(self, bucket: Bucket) -> torch.Tensor | None:
        return None

    def encode(self, bucket: Bucket, j: int, data: torch.Tensor, ready: Any) -> tuple[torch.Tensor, int, Any]:
        return data, kernels.DENSE, ready

    def metrics(self) -> dict[str, Any]:
        return {}


NO_DELTA = PackedSegments()
"""The per-segment interface without delta (a tensor's kind "whole" is hal.sync.plan.shards's)."""


class DeltaSender:
    """The sender's side of delta sync across syncs (see the module doc)."""

    def __init__(self, config: DeltaConfig, backend: Backend) -> None:
        self.config = config
        self.backend = backend
        self.baseline: torch.Tensor | None = None
        self.version: int | None = None  # of the baseline's bytes; None: neither old nor new
        self.digest: str | None = None
        self.since_anchor = 0
        self.pacer = Pacer() if config.choose == "time" else None
        self.anchors_after_refusal = 0
        """Delta syncs some receiver refused (it did not hold the base) and that went whole."""

    @property
    def baseline_bytes(self) -> int:
        return 0 if self.baseline is None else self.baseline.numel()

    def base(self, plan: BucketPlan) -> tuple[int | None, str, bool]:
        """The version a delta can be computed from, or None for a whole sync; why
        (`SyncMetrics.delta_choice`): an anchor on the first sync, a new layout, every
        `anchor_every`-th sync and after any failure, a pause while deltas do not pay; and
        whether this whole sync samples the compare's speed (choosing by time, with a
        baseline that holds the last version to compare against)."""
        if self.version is None or self.digest != plan.digest:
            return None, "anchor", False
        if self.since_anchor + 1 >= self.config.anchor_every:
            return None, "anchor", self.pacer is not None
        if self.pacer is not None:
            choice, sample = self.pacer.choose()
            if choice == "paused":
                return None, choice, sample
        return self.version, "delta", False

    def refused(self) -> tuple[None, str, bool]:
        """Some receiver does not hold the base: the same sync goes whole at once (and, the
        sender's base being good, measures the compare when choosing by time)."""
        self.anchors_after_refusal += 1
        return None, "anchor", self.pacer is not None

    def begin(
        self, plan: BucketPlan, base: int | None, choice: str, sample: bool, *, new_plan: bool, bypass_cpu: bool,
        transport: Any, stream: Any,
    ) -> "DeltaSegments":
        """One sync's segments. Until it completes the baseline is neither old nor new."""
        cold = self._ensure_baseline(plan) or new_plan
        self.version = None
        budget = self.pacer.whole_s_per_byte() if self.pacer is not None else None
        # whole segments are packed straight into the baseline, so that they cost no copy more than without delta
        into_baseline = bypass_cpu and bool(plan.buckets) and self.baseline.device == transport.buffer(0).device
        return DeltaSegments(self, plan, base is not None, choice, budget, into_baseline, sample, cold, transport, stream)

    def completed(self, segments: "DeltaSegments", version: int, seconds: float) -> None:
        self.version, self.digest = version, segments.plan.digest
        self.since_anchor = self.since_anchor + 1 if segments.active else 0
        if self.pacer is not None:
            # (less the samples' time: a whole sync without them is what a delta competes with)
            self.pacer.record(
                segments.choice, seconds - segments.sampled_s, segments.dense_bytes, warm=not segments.cold,
                encode_rate=segments.encode_rate(),
            )

    def _ensure_baseline(self, plan: BucketPlan) -> bool:
        """Allocate the baseline for this layout; True when it was (its pages are new)."""
        nbytes = sum(b.nbytes for b in plan.buckets)
        if self.baseline is None or self.baseline.numel() != nbytes:
            self.baseline = None  # free the old one first
            on_host = self.config.baseline == "host"
            self.baseline = self.backend.empty_pinned(nbytes) if on_host else self.backend.empty(nbytes)
            self.version = self.digest = None
            return True
        return False


class DeltaSegments:
    """One delta-enabled sync on the sender: per segment, whether it is compared, sampled or
    packed straight into the baseline, its encoding; and what the sync did, for metrics."""

    MIN_COMPARED = 2
    """Segments compared before the encode's cost is judged (the first one pays warm-up)."""

    def __init__(
        self, owner: DeltaSender, plan: BucketPlan, active: bool, choice: str, budget: float | None, into_baseline: bool,
        sample: bool, cold: bool, transport: Any, stream: Any,
    ) -> None:
        self.owner, self.plan, self.cold = owner, plan, cold
        self.transport, self.stream, self.backend = transport, stream, owner.backend
        self.compare = self.sample = False  # the segment being packed: compared, sampled
        self.active = active
        self.choice = choice
        self.budget = budget  # seconds per byte of a whole sync, when choosing by time
        self.into_baseline = into_baseline
        self.offsets = bucket_offsets(plan)
        self.segments = {kernels.DENSE: 0, kernels.INDICES: 0, kernels.BITMASK: 0}
        self.wire_bytes = 0
        self.dense_bytes = 0
        self.changed_bytes = 0  # words that differ from the baseline, in bytes
        self.encode_s = 0.0
        self.compared = 0  # segments
        self.compared_bytes = 0
        self.compared_s = 0.0
        self.sampled_bytes = 0
        self.sampled_s = 0.0
        self.samples: set[tuple[int, int]] = set()  # (bucket, segment): the start of each is encoded only to time it
        if sample:
            spots = [(b.index, j) for b in plan.buckets for j, seg in enumerate(b.segments) if seg.ranges]
            n, m = len(spots), Pacer.SAMPLE_SEGMENTS
            self.samples = set(spots) if n <= m else {spots[round(i * (n - 1) / (m - 1))] for i in range(m)}

    def pack_target(self, bucket: Bucket, j: int) -> torch.Tensor | None:
        """Where segment j of `bucket` is packed: the bucket's range of the baseline when it
        goes whole and nothing reads the baseline's old bytes, else None (the buffer)."""
        self.compare = self.compare_next()
        self.sample = (bucket.index, j) in self.samples
        if self.into_baseline and not self.compare and not self.sample:
            return self.baseline_of(bucket)
        return None

    def baseline_of(self, bucket: Bucket) -> torch.Tensor:
        return self.owner.baseline[self.offsets[bucket.index] :][: bucket.nbytes]

    def clear_gaps(self, target: torch.Tensor, bucket: Bucket, segment: Segment, stream: Any) -> None:
        """Zero the alignment gaps between a segment's packed tensors: they hold whatever the
        buffer held before (an earlier payload), which every delta would carry as changes."""
        if len(segment.ranges) > 1:
            gaps = _gaps(bucket, segment)
            if gaps:
                self.backend.launch(stream, _zero, target, gaps)

    def checksum_base(self, bucket: Bucket) -> torch.Tensor | None:
        """Where the bucket's new bytes are once its earlier segments were encoded: the
        baseline (the buffer holds the payloads sent)."""
        return self.baseline_of(bucket)

    def encode(self, bucket: Bucket, j: int, data: torch.Tensor, ready: Any) -> tuple[torch.Tensor, int, Any]:
        """The segment's new bytes into the baseline, and what to send: the bytes, or (when
        `compare`) the words that changed since the baseline when that is smaller. With
        `sample`, the start of the segment is encoded only to time it (it goes whole)."""
        k, segment, compare, sample = bucket.index, bucket.segments[j], self.compare, self.sample
        word = segment_word(bucket, segment)
        base = self.owner.baseline[self.offsets[k] + segment.start : self.offsets[k] + segment.stop]
        encoding, payload, changed, sampled = kernels.DENSE, None, 0, None
        compare = compare and bool(segment.ranges)
        sample = sample and not compare and bool(segment.ranges)
        if compare or sample:
            ready.synchronize()  # the pack is done: its bytes are read here
        began = time.perf_counter()
        if compare or sample:
            new = data if compare else data[: min(data.numel(), Pacer.SAMPLE_BYTES) // word * word]
            old = base[: new.numel()]
            old = old if old.device == data.device else old.to(data.device)
            result = kernels.delta_encode(new, old, word)
            if compare:
                encoding, payload, changed = result
            else:  # timed alone: a delta sync's encode also copies, below
                sampled = (new.numel(), time.perf_counter() - began)
            if self.backend.supports_async_streams:  # the encoding ran on the current stream
                self.stream.wait_stream(self.backend.current_stream())
        if data.data_ptr() != base.data_ptr():  # (packed straight into the baseline: nothing to copy)
            self.backend.copy_(base, data, stream=self.stream)  # the baseline becomes this sync's bytes
        if payload is not None:  # into the bucket buffer, where the segment's own bytes were
            out = self.transport.buffer(k)[segment.start : segment.start + payload.numel()]
            self.backend.copy_(out, payload, stream=self.stream)
            data = out
        ready = self.stream.record_event()
        self.count(encoding, segment, data.numel(), changed, word, time.perf_counter() - began, compare, sampled)
        return data, encoding, ready

    def compare_next(self) -> bool:
        return self.active and self.choice != "stopped"

    def count(
        self, encoding: int, segment: Segment, sent: int, changed: int, word: int, seconds: float, compared: bool,
        sampled: tuple[int, float] | None = None,
    ) -> None:
        nbytes = segment.stop - segment.start
        self.segments[encoding] += 1
        self.wire_bytes += sent
        self.dense_bytes += nbytes
        self.changed_bytes += changed * word
        self.encode_s += seconds
        if compared:
            self.compared += 1
            self.compared_bytes += nbytes
            self.compared_s += seconds
            # the encode alone cost more than a whole sync of these bytes takes: delta cannot win
            if self.budget is not None and self.compared >= self.MIN_COMPARED and self.compared_s > self.budget * self.compared_bytes:
                self.choice = "stopped"
        elif sampled is not None:
            self.sampled_bytes += sampled[0]
            self.sampled_s += sampled[1]

    def encode_rate(self) -> float | None:
        """Seconds per byte this sync's compares took (those that decided what was sent,
        else the samples), or None."""
        if self.compared_bytes:
            return self.compared_s / self.compared_bytes
        return self.sampled_s / self.sampled_bytes if self.sampled_bytes else None

    def metrics(self) -> dict[str, Any]:
        return {
            "delta": self.active,
            "wire_bytes": self.wire_bytes,
            "dense_wire_bytes": self.dense_bytes,
            "changed_fraction": self.changed_bytes / self.compared_bytes if self.compared_bytes else None,
            "segments_by_encoding": {
                "dense": self.segments[kernels.DENSE],
                "indices": self.segments[kernels.INDICES],
                "bitmask": self.segments[kernels.BITMASK],
            },
            "encode_s": self.encode_s,
            "delta_choice": self.choice,
            "compared_bytes": self.compared_bytes,
            "sampled_bytes": self.sampled_bytes,
            "baseline_bytes": self.owner.baseline_bytes,
        }


def _gaps(bucket: Bucket, segment: Segment) -> list[tuple[int, int]]:
    """The byte ranges of a segment that belong to no piece (alignment padding)."""
    gaps, at = [], segment.start
    for index, lo, hi in segment.ranges:
        piece = bucket.pieces[index]
        begin = piece.offset + lo
        if begin > at:
            gaps.append((at, begin))
        at = max(at, piece.offset + hi)
    if segment.stop > at:
        gaps.append((at, segment.stop))
    return gaps


def _zero(target: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
    for a, b in ranges:
        target[a:b].zero_()
