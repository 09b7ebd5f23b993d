"""Where each tensor goes: the bucket layout, built from metadata alone.

The plan depends only on (name, shape, wire dtype) of every tensor plus the bucket
size, so the sender and every receiver build the same plan from the same header, and
the sender caches it while the metadata is unchanged. Nothing per-sync lives here:
tensors, iterators and conversion objects are created fresh by each sync (SkyRL PR
1345: a conversion object cached across syncs loaded wrong weights).

A tensor larger than a bucket is split into byte chunks across consecutive buckets
and reassembled by the receiver.

A bucket travels as one or more segments (consecutive byte ranges of at most
`segment_bytes`): the sender sends each as soon as it is packed and the receiver applies
the tensors a segment completes as soon as it arrives, so the pipeline fills and
drains in one segment rather than one bucket. A bucket can thus stay large enough to
hold the largest tensor whole (no reassembly) without delaying the first byte on the wire.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from hal.kernels import ALIGNMENT, RangeChecksums, align_up
from hal.sync.spec import TensorSpec

# Bytes reserved per piece for its checksum when verification is on.
CHECKSUM_BYTES = 8


@dataclass(frozen=True, slots=True)
class Piece:
    """One tensor, or one chunk of a tensor too large for a bucket, inside a bucket."""

    spec: TensorSpec
    offset: int  # byte offset in the bucket
    nbytes: int  # bytes of this piece
    tensor_offset: int  # byte offset of this piece within the whole tensor
    checksum_slot: int  # index of its checksum in the bucket's checksum area
    # derived once: read for every piece of every sync
    is_first: bool = field(init=False, repr=False, compare=False)
    is_last: bool = field(init=False, repr=False, compare=False)
    is_whole: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        first = self.tensor_offset == 0
        last = self.tensor_offset + self.nbytes == self.spec.nbytes
        object.__setattr__(self, "is_first", first)
        object.__setattr__(self, "is_last", last)
        object.__setattr__(self, "is_whole", first and last)


@dataclass(frozen=True, slots=True)
class Segment:
    """Bytes `[start, stop)` of a bucket, sent as one transfer (none when empty).

    `ranges` are the ranges of pieces it carries, as (piece index, first byte, end byte)
    relative to the piece; a range with `end == piece.nbytes` completes its piece (an
    empty piece has one range (i, 0, 0)). A segment of checksums has no ranges.
    """

    start: int
    stop: int
    ranges: tuple[tuple[int, int, int], ...]
    tight: bool = False
    """Its ranges are two or more whole, non-empty pieces back to back, with no padding
    between them: its bytes are exactly theirs, in order. A side that holds those tensors
    back to back in one allocation, in the same order, sends them from there or receives
    them there with no copy (hal.sync.send.packing, hal.sync.receive.delivery)."""


@dataclass(frozen=True, slots=True)
class Bucket:
    index: int
    pieces: tuple[Piece, ...]
    checksum_offset: int  # where the int64 checksums start (== data end when verify is off)
    nbytes: int  # bytes that travel: data plus checksums
    segments: tuple[Segment, ...]
    checksum_ranges: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    """The byte range each checksum covers: exactly the piece, never padding, so the
    checksum depends only on the tensor's bytes (derived once: a verified sync reads it
    for every bucket of every sync)."""

    _checksummers: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "checksum_ranges", tuple((p.offset, p.nbytes) for p in self.pieces))
        object.__setattr__(self, "_checksummers", {})

    def checksummer(self, device: torch.device, newer_at: int | None = None) -> RangeChecksums:
        """The checksums of this bucket's pieces on `device` (with the bytes from `newer_at`
        on in a second tensor), planned once: a verified sync checks every bucket of every
        sync, and the plan's indices are the same each time."""
        key = (device, newer_at)
        found = self._checksummers.get(key)
        if found is None:
            found = self._checksummers[key] = RangeChecksums(self.checksum_ranges, device, newer_at)
        return found


@dataclass(frozen=True, slots=True)
class BucketPlan:
    specs: tuple[TensorSpec, ...]
    bucket_bytes: int
    verify: bool
    buckets: tuple[Bucket, ...]
    digest: str
    segment_bytes: int | None
    solo_tensors: frozenset[str] = frozenset()
    """Tensors every byte of which travels in segments holding nothing else (a range of
    that one tensor, exactly). Only these can go straight from the sender's tensor and
    land straight in a receiver's destination: no other tensor shares their transfers."""
    span_tensors: frozenset[str] = frozenset()
    """Tensors that travel in a tight segment (`Segment.tight`): they too may land straight
    in a receiver's destinations, when those lie back to back as the segment's bytes do."""
    total_bytes: int = field(init=False, compare=False)
    """The bytes of every tensor (derived once: every sync's metrics report it)."""
    in_place_tensors: frozenset[str] = field(init=False, compare=False)
    """`solo_tensors` and `span_tensors`: those a receiver may land in place (one object per
    plan: a receiver recognises its last check by it)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_bytes", sum(s.nbytes for s in self.specs))
        object.__setattr__(self, "in_place_tensors", self.solo_tensors | self.span_tensors)

    @property
    def max_bucket_nbytes(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)


def plan_key(specs: Sequence[TensorSpec], bucket_bytes: int, verify: bool, segment_bytes: int | None = None) -> str:
    h = hashlib.sha256(f"{bucket_bytes}|{verify}|{ALIGNMENT}|{segment_bytes}".encode())
    # one update of the joined text: the same digest as one update per spec, a fraction of the calls
    h.update("".join([f"\n{s.name}|{s.shape}|{s.dtype}" for s in specs]).encode())
    return h.hexdigest()[:24]


def build_plan(
    specs: Iterable[TensorSpec], bucket_bytes: int, *, verify: bool = False, segment_bytes: int | None = None
) -> BucketPlan:
    """Lay `specs` out in buckets of at most `bucket_bytes`, in order, splitting what does
    not fit; each bucket travels in segments of at most `segment_bytes` (None: whole)."""
    specs = tuple(specs)
    if segment_bytes is not None and segment_bytes < ALIGNMENT:
        raise ValueError(f"segment_bytes must be at least {ALIGNMENT} or None, got {segment_bytes}")
    slot_bytes = CHECKSUM_BYTES if verify else 0
    min_bucket = 2 * ALIGNMENT + slot_bytes
    if bucket_bytes < min_bucket:
        raise ValueError(f"bucket_bytes must be at least {min_bucket}, got {bucket_bytes}")
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ValueError(f"parameter {s.name!r} appears twice in the sync")
        seen.add(s.name)

    buckets: list[Bucket] = []
    pieces: list[Piece] = []
    used = 0  # aligned end of data in the open bucket

    def capacity_left() -> int:
        # data must leave room for one more checksum slot at the end, 8-aligned
        return bucket_bytes - used - (len(pieces) + 1) * slot_bytes - 8

    def close() -> None:
        nonlocal pieces, used
        # checksums follow the last piece's bytes, not the alignment padding after them
        data_end = pieces[-1].offset + pieces[-1].nbytes if pieces else 0
        checksum_offset = align_up(data_end, 8)
        nbytes = checksum_offset + len(pieces) * slot_bytes
        segments = segment_bucket(pieces, checksum_offset, nbytes, segment_bytes)
        buckets.append(Bucket(len(buckets), tuple(pieces), checksum_offset, nbytes, segments))
        pieces, used = [], 0

    for spec in specs:
        remaining = spec.nbytes
        tensor_offset = 0
        if remaining == 0:  # an empty tensor still gets a (zero-length) piece so the receiver applies it
            if capacity_left() < 0:
                close()
            pieces.append(Piece(spec, used, 0, 0, len(pieces)))
            continue
        while remaining:
            room = capacity_left()
            if tensor_offset == 0 and remaining > room and remaining <= bucket_bytes - slot_bytes - 8 and pieces:
                close()  # fits whole in a fresh bucket: do not split it
                room = capacity_left()
            if room < ALIGNMENT:
                close()
                room = capacity_left()
            # chunk boundaries stay ALIGNMENT-aligned inside the tensor so views stay aligned
            take = remaining if remaining <= room else room // ALIGNMENT * ALIGNMENT
            pieces.append(Piece(spec, used, take, tensor_offset, len(pieces)))
            used = align_up(used + take)
            tensor_offset += take
            remaining -= take
    if pieces:
        close()
    key = plan_key(specs, bucket_bytes, verify, segment_bytes)
    spans = frozenset(b.pieces[i].spec.name for b in buckets for s in b.segments if s.tight for i, _, _ in s.ranges)
    return BucketPlan(specs, bucket_bytes, verify, tuple(buckets), key, segment_bytes, _solo_tensors(buckets), spans)


def is_solo(bucket: Bucket, segment: Segment) -> bool:
    """The segment is exactly one non-empty range of one piece: nothing else travels with it."""
    if len(segment.ranges) != 1:
        return False
    _, lo, hi = segment.ranges[0]
    return hi > lo and segment.stop - segment.start == hi - lo


def _solo_tensors(buckets: Sequence[Bucket]) -> frozenset[str]:
    solo: dict[str, bool] = {}
    for bucket in buckets:
        for segment in bucket.segments:
            alone = is_solo(bucket, segment)
            for index, _, _ in segment.ranges:
                name = bucket.pieces[index].spec.name
                solo[name] = solo.get(name, True) and alone
    return frozenset(name for name, ok in solo.items() if ok)


def segment_bucket(pieces: Sequence[Piece], checksum_offset: int, nbytes: int, segment_bytes: int | None) -> tuple[Segment, ...]:
    """Cut a bucket into the transfers it travels in (see `Segment`).

    None: one transfer of the whole bucket. Otherwise pieces are grouped, whole and in
    order, into segments of at most `segment_bytes`, except that a piece of at least a
    quarter of that gets segments of its own (split at ALIGNMENT multiples when larger):
    the sender can then send it from the tensor's own memory without packing it.
    A piece followed by padding (its size not a multiple of ALIGNMENT: a 96-byte norm)
    would make a whole segment of small tensors not tight (`Segment.tight`), so such
    pieces (with any padded neighbours) are set apart in a segment of their own when a
    run of at least a quarter of a segment of other pieces lies before or after them (one
    small segment more, which is packed; the runs stay tight). Padding between segments
    does not travel; checksums, when verifying, travel last in a segment of their own.
    """
    if segment_bytes is None:
        every = tuple((i, 0, p.nbytes) for i, p in enumerate(pieces))
        return (Segment(0, nbytes, every, _tight(pieces, every, 0, nbytes)),)
    limit = max(ALIGNMENT, segment_bytes // ALIGNMENT * ALIGNMENT)
    # per piece: whether it breaks a tight run, and the bytes of the run of unbroken pieces
    # that starts at it (0 for a breaker)
    breaks = [not p.is_whole or p.nbytes == 0 or p.nbytes % ALIGNMENT != 0 for p in pieces]
    run_from = [0] * (len(pieces) + 1)
    for i in range(len(pieces) - 1, -1, -1):
        run_from[i] = 0 if breaks[i] else pieces[i].nbytes + run_from[i + 1]
    segments: list[Segment] = []
    ranges: list[tuple[int, int, int]] = []
    start = end = 0
    broken = False  # the open segment holds a breaker

    def close() -> None:
        nonlocal ranges
        if ranges:
            segments.append(Segment(start, end, tuple(ranges), _tight(pieces, ranges, start, end)))
            ranges = []

    for i, piece in enumerate(pieces):
        if piece.nbytes >= limit // 4:  # its own segments
            close()
            for lo in range(0, piece.nbytes, limit):
                hi = min(piece.nbytes, lo + limit)
                segments.append(Segment(piece.offset + lo, piece.offset + hi, ((i, lo, hi),)))
            continue
        if ranges and piece.offset + piece.nbytes - start > limit:
            close()
        elif ranges and breaks[i] and not broken and end - start >= limit // 4:
            close()  # keep the tight run before it tight
        elif ranges and not breaks[i] and broken and run_from[i] >= limit // 4:
            close()  # and the one after it
        if not ranges:
            start, broken = piece.offset, False
        ranges.append((i, 0, piece.nbytes))
        end = piece.offset + piece.nbytes
        broken = broken or breaks[i]
    close()
    if nbytes > checksum_offset:
        segments.append(Segment(checksum_offset, nbytes, ()))
    return tuple(segments)


def _tight(pieces: Sequence[Piece], ranges: Sequence[tuple[int, int, int]], start: int, stop: int) -> bool:
    """Whether bytes `[start, stop)` are exactly `ranges`, two or more whole, non-empty
    pieces back to back (`Segment.tight`)."""
    if len(ranges) < 2:
        return False
    end = start
    for index, lo, hi in ranges:
        piece = pieces[index]
        if not piece.is_whole or lo != 0 or hi != piece.nbytes or hi == 0 or piece.offset != end:
            return False
        end += hi
    return end == stop


def segment_word(bucket: Bucket, segment: Segment) -> int:
    """The word size a segment is compared in for delta sync: the smallest element size of
    the pieces it carries (every piece starts on an ALIGNMENT boundary and holds whole
    elements, so this divides every offset and length); 8 for a segment of checksums."""
    sizes = [bucket.pieces[i].spec.dtype.itemsize for i, _, _ in segment.ranges]
    return min(sizes) if sizes else 8


def bucket_offsets(plan: BucketPlan) -> list[int]:
    """Where each bucket starts in a flat image of the whole sync (its buckets back to back)."""
    offsets, at = [], 0
    for bucket in plan.buckets:
        offsets.append(at)
        at += bucket.nbytes
    return offsets


class PlanCache:
    """Keeps the last few plans, keyed by their metadata: rebuilt when anything changes."""

    def __init__(self, size: int = 4) -> None:
        self._size = size
        self._plans: dict[str, BucketPlan] = {}
        self._last: tuple | None = None
        self.builds = 0  # how many plans were built (tests check reuse)

    def get(self, specs: Sequence[TensorSpec], bucket_bytes: int, verify: bool, segment_bytes: int | None = None) -> BucketPlan:
        last = self._last
        if last is not None and last[1:4] == (bucket_bytes, verify, segment_bytes):
            plan = last[4]
            if last[0] is specs:
                return plan  # the very tuple of the last call (a receiver's decoded header): nothing to hash
            # the same spec objects as the last plan's, in order (what `TensorSpec.of` hands
            # out while nothing changed): the same layout, at a pointer compare per tensor
            if len(specs) == len(plan.specs) and all(map(operator.is_, specs, plan.specs)):
                return plan
        key = plan_key(specs, bucket_bytes, verify, segment_bytes)
        plan = self._plans.pop(key, None)
        if plan is None:
            plan = build_plan(specs, bucket_bytes, verify=verify, segment_bytes=segment_bytes)
            self.builds += 1
        self._plans[key] = plan  # most recent last
        while len(self._plans) > self._size:
            self._plans.pop(next(iter(self._plans)))
        # only a tuple is immutable: a list passed again may have changed since (the
        # element-wise compare above still holds for one)
        self._last = (specs if isinstance(specs, tuple) else None, bucket_bytes, verify, segment_bytes, plan)
        return plan
