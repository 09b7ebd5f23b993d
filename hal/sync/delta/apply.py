"""The receiver's half of delta sync.

`DeltaReceiver` keeps, across syncs, what a delta lands on and checks that a header's
delta base is exactly it. A delta lands in one of two ways (docs/delta.md):

- image (`ImageApplier`): every segment's bytes end up in the receiver's image of the sync
  (its buckets back to back): whole ones are received there, deltas patch it, and tensors
  are delivered from it. For sinks without exact destinations, and verified syncs.
- scatter (`ScatterApplier`): the sink's destinations are the base; once a bucket is all
  here its deltas are checked, then scattered straight into the destinations of the
  tensors wholly in one segment range, and applied to a copy of the old bytes (the work
  buffer, one bucket) for the rest, which are delivered from there.

Both answer the receiver's per-segment calls (`land`, `complete`, `image`) the way its
plain path does (hal.sync.receive.receiver), and record which tensors changed: a delta sync
hands the sink only those (unless its policy says `apply_unchanged`).
"""

from __future__ import annotations

from typing import Any

import torch

from hal import kernels
from hal.backends.interface import Backend
from hal.sync import errors
from hal.sync.wire.header import SyncHeader
from hal.sync.plan.buckets import Bucket, BucketPlan, Segment, bucket_offsets, is_solo, segment_word
from hal.sync.wire.channel import SegmentStatus
from hal.sync.sink import Pairs, Sink

Destinations = tuple[tuple[str, int], ...]


def scatter_key(plan: BucketPlan, sink: Sink, device: torch.device) -> Destinations | None:
    """The destinations a delta can be scattered into (their names and addresses), or
    None when the receiver must keep its own image of the sync instead: some tensor has
    no destination holding exactly its wire bytes (dtype, contiguous, this device), the
    sink forbids writing into them (`SinkPolicy.in_place`), or the sync is verified (the
    checksum is of the whole resulting bytes, so they are built in the image first)."""
    if plan.verify or not sink.policy.in_place:
        return None
    key = []
    for spec in plan.specs:
        dest = sink.destination(spec.name)
        if not isinstance(dest, torch.Tensor) or dest.dtype != spec.dtype or not dest.is_contiguous() or dest.device != device:
            return None
        key.append((spec.name, dest.data_ptr()))
    return tuple(key)


class DeltaReceiver:
    """What a receiver keeps for delta syncs: the base's version, layout and where it is
    (the destinations, `kept_in`, or `image`), and the work buffer of the scatter path."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.image: torch.Tensor | None = None
        self.version: int | None = None
        self.digest: str | None = None
        self.kept_in: Destinations | None = None
        self.work: torch.Tensor | None = None  # one bucket: patched bytes of segments that are not one whole tensor's

    @property
    def baseline_bytes(self) -> int:
        return sum(t.numel() for t in (self.image, self.work) if t is not None)

    def check_base(self, base: int, plan: BucketPlan, kept_in: Destinations | None, consistent: bool) -> None:
        """A delta lands only on exactly the bytes it was computed from."""
        if self.version != base or self.digest != plan.digest or not consistent or self.kept_in != kept_in:
            held = "no complete delta-synced version" if self.version is None else f"version {self.version}"
            raise errors.DeltaBaseError(
                f"a delta against version {base} cannot land: this receiver holds {held}"
                + ("" if consistent else " and part of a failed sync")
                + ("" if self.digest in (None, plan.digest) or self.version is None else " of another layout")
                + ("" if self.kept_in == kept_in or self.version is None else " in other destinations than this sink's")
            )

    def begin(self, header: SyncHeader, plan: BucketPlan, kept_in: Destinations | None, delivery: Any) -> Any:
        """This sync's applier (None: the receiver's plain path), the image made ready."""
        if header.delta and kept_in is None:
            nbytes = sum(b.nbytes for b in plan.buckets)
            if self.image is None or self.image.numel() != nbytes:
                self.image = None  # free the old one first
                self.image = self.backend.empty(nbytes)
                self.version = self.digest = None
        else:
            self.image = None  # the destinations hold the base (or nothing is kept)
        if not header.delta:
            self.version = self.digest = self.kept_in = None
            return None
        if kept_in is None:
            return ImageApplier(self, delivery)
        return ScatterApplier(self, delivery) if header.delta_base is not None else None

    def completed(self, header: SyncHeader, plan: BucketPlan, kept_in: Destinations | None) -> None:
        if header.delta:
            self.version, self.digest, self.kept_in = header.version, plan.digest, kept_in

    def lost(self) -> None:
        """A failed sync leaves no usable base: the next one is whole."""
        self.version = None

    def work_buffer(self, nbytes: int) -> torch.Tensor:
        if self.work is None or self.work.numel() < nbytes:
            self.work = None  # free the old one first
            self.work = self.backend.empty(nbytes)
        return self.work


class ImageApplier:
    """A delta sync into the receiver's image (see the module doc)."""

    def __init__(self, state: DeltaReceiver, delivery: Any) -> None:
        self.state, self.d = state, delivery
        self.offsets = bucket_offsets(delivery.plan)

    def image(self, k: int) -> torch.Tensor:
        return self.state.image[self.offsets[k] : self.offsets[k] + self.d.plan.buckets[k].nbytes]

    def land(self, bucket: Bucket, j: int, status: SegmentStatus) -> torch.Tensor | None:
        """Whole bytes straight into the image; a delta payload into the transport's buffer."""
        if status.encoding != kernels.DENSE:
            return None
        return self.image(bucket.index)[bucket.segments[j].start : bucket.segments[j].stop]

    def complete(self, bucket: Bucket, j: int, landed: bool, status: SegmentStatus) -> Pairs:
        segment = bucket.segments[j]
        self._patch(bucket, segment, landed, status)
        return self.d.arrived(bucket, segment, False)  # delivered from the image

    def _patch(self, bucket: Bucket, segment: Segment, landed: bool, status: SegmentStatus) -> None:
        """Bring the segment's new bytes into the baseline (a delta sync only)."""
        target = self.image(bucket.index)[segment.start : segment.stop]
        names = [bucket.pieces[i].spec.name for i, _, _ in segment.ranges]
        if status.encoding == kernels.DENSE:
            if not landed:  # the transport kept them in its own (shared) buffer
                # a torch op, as the patches and checksums that read the image next: ordered
                # with them on the current stream (not queued on another, which they would race)
                target.copy_(self.d.transport.buffer(bucket.index)[segment.start : segment.stop])
            self.d.changed.update(names)  # not compared: counted as changed
            return
        payload = self.d.transport.buffer(bucket.index)[segment.start : segment.start + status.nbytes]
        if kernels.delta_apply(target, payload, status.encoding, segment_word(bucket, segment)):
            self.d.changed.update(names)


class ScatterApplier:
    """A delta sync scattered into the sink's destinations (see the module doc)."""

    def __init__(self, state: DeltaReceiver, delivery: Any) -> None:
        self.state, self.d = state, delivery
        self.pending: list[tuple[Segment, SegmentStatus]] = []  # this bucket's segments, applied at its end

    def image(self, k: int) -> torch.Tensor:
        return self.d.transport.buffer(k)

    def land(self, bucket: Bucket, j: int, status: SegmentStatus) -> torch.Tensor | None:
        return None  # nothing is written before the whole bucket is here and checked

    def complete(self, bucket: Bucket, j: int, landed: bool, status: SegmentStatus) -> Pairs:
        self.pending.append((bucket.segments[j], status))
        if j < len(bucket.segments) - 1:
            return []
        pending, self.pending = self.pending, []
        return self._scatter(bucket, pending)

    def _scatter(self, bucket: Bucket, pending: list[tuple[Segment, SegmentStatus]]) -> Pairs:
        """Apply a patching bucket whose segments are all here; returns what it completes.

        Every delta payload is checked before anything is written, so a bad one leaves every
        destination as it was. A delta segment that is one range of a tensor wholly in this
        bucket is scattered straight into its destination; any other is rebuilt in the
        work buffer from the destinations' old bytes and patched there; whole (DENSE)
        segments are in the transport's buffer. From those, each range goes to its tensor's
        destination, or, for a tensor spread over buckets, to its reassembly buffer. All of
        it is torch work on the current stream, ordered like the kernels' own (on `sim`: now).
        """
        if self.d.error is not None:
            return []
        buffer = self.d.transport.buffer(bucket.index)
        checked: list[tuple[int, int | None]] = []  # per pending segment: its word size, the words its delta changes
        for segment, status in pending:
            word, count = segment_word(bucket, segment), None
            if status.encoding != kernels.DENSE:
                payload = buffer[segment.start : segment.start + status.nbytes]
                count = kernels.delta_check(payload, status.encoding, (segment.stop - segment.start) // word, word)
            checked.append((word, count))
        out: Pairs = []
        for (segment, status), (word, count) in zip(pending, checked):
            names = [bucket.pieces[i].spec.name for i, _, _ in segment.ranges]
            source, changed = buffer, True
            if status.encoding != kernels.DENSE:
                payload = buffer[segment.start : segment.start + status.nbytes]
                first = bucket.pieces[segment.ranges[0][0]] if segment.ranges else None
                if first is not None and first.is_whole and is_solo(bucket, segment):
                    _, lo, hi = segment.ranges[0]
                    self.d.touched = True
                    if kernels.delta_apply(kernels.as_bytes(self.d.exact[first.spec.name])[lo:hi], payload, status.encoding, word, checked=count):
                        self.d.changed.add(first.spec.name)
                    if hi == first.nbytes:
                        out.append((first.spec.name, self.d.exact[first.spec.name]))
                    continue
                source = self.state.work_buffer(self.d.plan.max_bucket_nbytes)
                for index, lo, hi in segment.ranges:  # the old bytes (gaps between pieces are never patched)
                    piece = bucket.pieces[index]
                    old = kernels.as_bytes(self.d.exact[piece.spec.name])[piece.tensor_offset + lo : piece.tensor_offset + hi]
                    source[piece.offset + lo : piece.offset + hi].copy_(old)
                changed = bool(kernels.delta_apply(source[segment.start : segment.stop], payload, status.encoding, word, checked=count))
            if changed:
                self.d.changed.update(names)
            for index, lo, hi in segment.ranges:
                piece = bucket.pieces[index]
                spec = piece.spec
                new = source[piece.offset + lo : piece.offset + hi]
                if piece.is_whole:
                    if changed and hi > lo:  # unchanged: the destination holds these bytes already
                        kernels.as_bytes(self.d.exact[spec.name])[lo:hi].copy_(new)
                        self.d.touched = True
                    if hi == piece.nbytes:
                        out.append((spec.name, self.d.exact[spec.name]))
                    continue
                into = self.d.reassembly_buffer(spec)
                into[piece.tensor_offset + lo : piece.tensor_offset + hi].copy_(new)
                if hi == piece.nbytes and piece.is_last:
                    out.append((spec.name, kernels.typed_view(into, 0, spec.shape, spec.dtype)))
        return out
