"""The sender's packing of one segment: its whole tensors gathered from the source and
copied into the bucket by one multi-tensor copy on the pack stream, a tensor too large for
a segment cut into ranges (cast and laid out once), or a tensor that travels alone sent
from its own memory. What packing a segment needs of the layout (the views of the target,
per segment the specs and views of its whole tensors) is made once per plan and target.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import torch

from hal import kernels
from hal.backends.interface import Backend
from hal.backends.types import PreparedCopies
from hal.sync import errors
from hal.sync.config import SyncConfig
from hal.sync.delta import NO_DELTA
from hal.sync.metrics import PhaseTimer
from hal.sync.plan.buckets import Bucket, BucketPlan, Segment
from hal.sync.spec import TensorSpec
from hal.sync.plan.steady import KnownSource
from hal.sync.transport.base import Transport


class SegmentPacker:
    """Packs segments for a `Sender` (one per sender, reused across syncs): it keeps the pack
    stream, the pinned staging buffer (host-staged syncs) and the views, nothing per sync."""

    def __init__(self, transport: Transport, config: SyncConfig, backend: Backend) -> None:
        self.transport = transport
        self.config = config
        self.backend = backend
        self.stream = backend.new_stream()
        self._views = kernels.PieceViews()  # typed views of the pack targets, per plan
        self._packs: dict[tuple, SegmentPack] = {}  # per segment of several pieces, per plan and target (`_pack_whole`)
        self._staging: torch.Tensor | None = None
        self._epoch = -1  # the listing the packs' `srcs` were made from (`ListedCursor.epoch`)

    def ensure_staging(self, nbytes: int) -> None:
        """A pinned host buffer of at least `nbytes` to pack into (host-staged syncs)."""
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None  # free the old one before allocating the larger
            self._staging = self.backend.empty_pinned(nbytes)

    def pack(
        self, packing: "SourceCursor", bucket: Bucket, segment: Segment, keep: list[torch.Tensor], timer: PhaseTimer,
        segments: Any = NO_DELTA, into: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, bool]:
        """Pack one segment; returns the bytes to send (a range of the bucket buffer, of
        `into` when given (the delta baseline), or a tensor's own bytes) and whether they
        come straight from a tensor that sends every range that way."""
        backend, stream = self.backend, self.stream
        buffer = self.transport.buffer(bucket.index)
        target = buffer if self.config.bypass_cpu else self._staging
        if into is not None:
            target = buffer = into
        segments.clear_gaps(target, bucket, segment, stream)
        ranges = segment.ranges
        if len(ranges) > 1:
            # Several pieces, so none of them goes straight from its own memory (`_direct`):
            # the whole ones are gathered, then sent from the memory they lie back to back in
            # (`kernels.span_bytes`), or packed by one multi-tensor copy into views of the target cached
            # with the plan; chunks of larger tensors go the way below.
            spanned = segment.tight and into is None and segments is NO_DELTA and self.config.bypass_cpu and not self.config.verify
            ranges, span = self._pack_whole(packing, bucket, segment, target, keep, timer, spanned)
            if span is not None:
                keep.append(span)
                return span, False
        for index, lo, hi in ranges:
            piece = bucket.pieces[index]
            spec = piece.spec
            if piece.is_first and lo == 0:
                with timer("gather"):
                    tensor = packing.next_tensor(spec)
                if self.backend.supports_async_streams:  # a gather (e.g. full_tensor) may still be running
                    stream.wait_stream(backend.current_stream())
                in_ranges = not (piece.is_whole and hi == piece.nbytes)
                packing.start(spec, tensor, self._direct(packing.plan, spec, tensor, buffer), in_ranges, backend, stream)
                keep.append(packing.tensor)
            tensor = packing.tensor
            if packing.direct:
                keep.append(tensor)  # also when its first range went in an earlier bucket
                return kernels.as_bytes(tensor)[piece.tensor_offset + lo : piece.tensor_offset + hi], True
            if hi == lo:
                continue
            if piece.is_whole and lo == 0 and hi == piece.nbytes:
                kernels.pack_into(backend, target, piece.offset, tensor, spec.dtype, stream=stream)
            else:
                # a range of the piece, in wire bytes (ALIGNMENT-aligned: whole elements)
                kernels.pack_range_into(backend, target, piece.offset + lo, tensor, spec.dtype, piece.tensor_offset + lo, hi - lo, stream=stream)
        if segment.stop == bucket.nbytes and bucket.nbytes > bucket.checksum_offset:  # checksums travel last
            sums = kernels.typed_view(target, bucket.checksum_offset, (len(bucket.pieces),), torch.int64)
            baseline = segments.checksum_base(bucket)
            # with delta, both ways are planned at the first sync (a whole one): a delta sync's
            # time decides whether the next is one, and must not pay for planning
            split = None if baseline is None else bucket.checksummer(target.device, segment.start)
            if split is None or target.data_ptr() == baseline.data_ptr():
                backend.launch(stream, bucket.checksummer(target.device).into, sums, target)
            else:
                # over the bucket's new bytes, which the receiver checks what it rebuilt against:
                # with delta sync the earlier segments' are in the baseline by now (the buffer
                # holds the payloads sent), this segment's only in the target until it is encoded
                fresh = target[segment.start : bucket.checksum_offset] if split.needs[1] else None
                backend.launch(stream, split.into, sums, baseline, fresh)
        if not self.config.bypass_cpu:
            backend.copy_(buffer[segment.start : segment.stop], target[segment.start : segment.stop], stream=stream)
        return buffer[segment.start : segment.stop], False

    def _pack_whole(
        self, packing: "SourceCursor", bucket: Bucket, segment: Segment, target: torch.Tensor, keep: list[torch.Tensor], timer: PhaseTimer,
        spanned: bool = False,
    ) -> tuple[list[tuple[int, int, int]], torch.Tensor | None]:
        """Gather the whole pieces of a segment and pack them with one multi-tensor copy:
        one stream wait and one launch per segment, whatever its tensor count. Returns the
        segment's other ranges (chunks of larger tensors), for the caller to pack, and, when
        `spanned` (a tight segment the sender may send from the source's memory) and the
        tensors lie back to back as the segment's bytes do, that memory instead of a pack."""
        key = (packing.plan.digest, target.data_ptr(), target.numel(), bucket.index, segment.start)
        pack = self._packs.get(key)
        if pack is None:
            pack = self._packs[key] = self._segment_packs(packing.plan, bucket, segment, target)
        if packing.epoch != self._epoch:  # lists made from another listing hold tensors no longer sent: let them go
            for other in self._packs.values():
                other.srcs, other.copies, other.epoch, other.span = [], None, -1, _UNKNOWN
            self._epoch = packing.epoch
        began = time.perf_counter()
        srcs = packing.sources(pack)
        timer.add("gather", time.perf_counter() - began)
        keep.extend(srcs)
        if self.backend.supports_async_streams:  # a gather (e.g. full_tensor) may still be running
            self.stream.wait_stream(self.backend.current_stream())
        if spanned:
            # looked for once per listing (its tensors stay at their addresses until the epoch
            # changes), every sync for an iterated source
            span = pack.span if packing.epoch >= 0 else _UNKNOWN
            if span is _UNKNOWN:
                span = kernels.span_bytes(srcs, pack.offsets, segment.stop - segment.start, pack.dtypes, target.device)
                if packing.epoch >= 0:
                    pack.span = span
            if span is not None:
                return pack.others, span
        self._tight_dsts(packing.plan, bucket, segment, target, pack)
        # every source was checked against its spec (`gather`, or the listing's check), every view is made from it
        if packing.epoch < 0 or pack.fresh:
            # iterated, or the first sync of these tensors (a source may hand out new objects
            # every sync, `state_dict()` does): one multi-tensor copy, nothing prepared
            pack.fresh = False
            self.backend.copy_many_(pack.dsts, srcs, stream=self.stream, shapes_checked=True)
            return pack.others, None
        if pack.copies is None:  # once per listing: the same tensors at the same addresses, until the epoch changes
            pack.copies = self.backend.prepare_copies(pack.dsts, srcs, shapes_checked=True)
        self.backend.copy_prepared_(pack.copies, stream=self.stream)
        return pack.others, None

    def _segment_packs(self, plan: BucketPlan, bucket: Bucket, segment: Segment, target: torch.Tensor) -> "SegmentPack":
        """What packing a segment of several pieces needs, made once per plan and target
        (kept in `_packs` by the caller)."""
        if len(self._packs) >= 4 * sum(len(b.segments) for b in plan.buckets) + 8:
            self._packs.clear()  # buffers were reallocated or the layout changed: the old keys are stale
        # a tight segment's views are made only if it is ever packed (`_tight_dsts`): a view
        # per tensor is most of what a sender holds per tensor
        views = None if segment.tight else self._views.of(plan, target, bucket)
        pack = SegmentPack()
        for index, lo, hi in segment.ranges:
            piece = bucket.pieces[index]
            if piece.is_whole:
                pack.whole.append((piece.spec, hi > 0))
                if hi and views is not None:
                    pack.dsts.append(views[index])
            else:
                pack.others.append((index, lo, hi))
        if segment.tight:
            pieces = [bucket.pieces[index] for index, _, _ in segment.ranges]
            pack.offsets = [p.offset - segment.start for p in pieces]
            pack.dtypes = [p.spec.dtype for p in pieces]
        return pack

    def _tight_dsts(self, plan: BucketPlan, bucket: Bucket, segment: Segment, target: torch.Tensor, pack: "SegmentPack") -> None:
        if segment.tight and not pack.dsts:  # (every piece of a tight segment is whole, with bytes)
            views = self._views.of(plan, target, bucket)
            pack.dsts = [views[index] for index, _, _ in segment.ranges]

    def _direct(self, plan: BucketPlan, spec: TensorSpec, tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
        """Whether every range of this tensor goes straight from its memory, skipping the
        pack: it travels alone in its segments, is already contiguous, in its wire dtype
        and where the buffers are. Not when staging through the host (the point of
        staging) nor when verifying (checksums are computed over the packed bucket)."""
        return (
            self.config.bypass_cpu
            and not self.config.verify
            and spec.name in plan.solo_tensors
            and tensor.dtype == spec.dtype
            and tensor.is_contiguous()
            and tensor.device == buffer.device
        )


_UNKNOWN = object()  # a tight segment's span, not yet looked for in this listing


class SegmentPack:
    """What packing one segment of several pieces needs, made once per plan and target: per
    whole piece its spec and whether it has bytes (`whole`), the views they pack into
    (`dsts`), the segment's other ranges (`others`); and the tensors the views are copied
    from, when they are read from a listing (`srcs`, and the copies prepared between them,
    `copies`: made once per listing, `epoch`); for a tight segment, the source's memory its
    tensors lie back to back in, when they do (`span`: found once per listing)."""

    __slots__ = ("whole", "dsts", "others", "srcs", "copies", "epoch", "fresh", "offsets", "dtypes", "span")

    def __init__(self) -> None:
        self.whole: list[tuple[TensorSpec, bool]] = []
        self.dsts: list[torch.Tensor] = []
        self.others: list[tuple[int, int, int]] = []
        self.srcs: list[torch.Tensor] = []
        self.copies: PreparedCopies | None = None
        self.epoch = -1
        self.fresh = False  # `srcs` were made this sync
        # a tight segment's: where each tensor starts in it and its dtype; the source's memory
        # holding them back to back (None: they do not), found once per listing
        self.offsets: list[int] = []
        self.dtypes: list[torch.dtype] = []
        self.span: torch.Tensor | None | object = _UNKNOWN


class SourceCursor:
    """The source's iterator and the tensor being packed, for one sync: every tensor it hands
    out was checked against the spec it stands for."""

    def __init__(self, plan: BucketPlan, it: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.plan = plan
        self.it = it
        self.tensor: torch.Tensor | None = None
        self.direct = False
        self.epoch = -1  # no listing

    def next_tensor(self, spec: TensorSpec) -> torch.Tensor:
        try:
            name, tensor = next(self.it)
        except StopIteration:
            raise errors.SpecMismatchError(f"source ended before parameter {spec.name!r} that its metadata() declared") from None
        _check_yielded(spec, name, tensor)
        return tensor

    def sources(self, pack: SegmentPack) -> list[torch.Tensor]:
        """The tensors a segment's whole pieces are copied from: the next ones of the source."""
        return self.gather(pack.whole)

    def gather(self, whole: list[tuple[TensorSpec, bool]]) -> list[torch.Tensor]:
        """The next tensors of the source, for these specs (checked as `next_tensor` checks
        them; the loop is inlined: a segment may hold thousands); those with bytes, in order."""
        srcs: list[torch.Tensor] = []
        it, plain = self.it, torch.Tensor
        for spec, has_bytes in whole:
            try:
                name, tensor = next(it)
            except StopIteration:
                raise errors.SpecMismatchError(f"source ended before parameter {spec.name!r} that its metadata() declared") from None
            if name != spec.name or (type(tensor) is not plain and not isinstance(tensor, plain)) or tensor.shape != spec.shape:
                _check_yielded(spec, name, tensor)
            if has_bytes:
                srcs.append(tensor)
        return srcs

    def start(self, spec: TensorSpec, tensor: torch.Tensor, direct: bool, in_ranges: bool, backend: Backend, stream: Any) -> None:
        """Take `tensor` as the one being packed, in the form its ranges are cut from: a
        tensor sent in several ranges is cast and laid out once, then cut in wire bytes."""
        self.direct = direct
        if in_ranges and not direct and (tensor.dtype != spec.dtype or not tensor.is_contiguous()):
            wire = backend.empty(tuple(tensor.shape), spec.dtype)
            backend.copy_(wire, tensor, stream=stream)
            tensor = wire
        self.tensor = tensor


class ListedCursor(SourceCursor):
    """The tensors of one sync read from the source's listing, which the sender found to list
    the same tensors, shapes and dtypes as the plan's specs (hal.sync.plan.steady): no iterator,
    and per segment of small tensors the list made once per listing (`SegmentPack.srcs`)."""

    def __init__(self, plan: BucketPlan, known: KnownSource) -> None:
        super().__init__(plan, iter(()))
        self.known = known
        self.tensors = known.listing.tensors
        self.epoch = known.epoch

    def next_tensor(self, spec: TensorSpec) -> torch.Tensor:
        tensor = self.tensors[self.known.position(spec.name)]
        # out of autograd, as a source's iteration yields it (copied or viewed as bytes next)
        return tensor.detach() if tensor.requires_grad else tensor

    def sources(self, pack: SegmentPack) -> list[torch.Tensor]:
        # the listed objects themselves: a multi-tensor copy reads each as it is now (one whose
        # memory was replaced in place reads the new memory) and runs out of autograd
        # (hal.backends.hooks.copy_many_non_blocking)
        if pack.epoch != self.epoch:
            tensors, at = self.tensors, self.known.position
            pack.srcs = [tensors[at(spec.name)] for spec, has_bytes in pack.whole if has_bytes]
            pack.copies, pack.epoch, pack.fresh, pack.span = None, self.epoch, True, _UNKNOWN
        return pack.srcs


def _check_yielded(spec: TensorSpec, name: Any, tensor: Any) -> None:
    """Refuse what a source yielded where `spec` was declared, naming what differs."""
    if name != spec.name:
        raise errors.SpecMismatchError(f"source yielded {name!r} where its metadata() declared {spec.name!r}; iteration must follow metadata order")
    if not isinstance(tensor, torch.Tensor):
        raise errors.SpecMismatchError(f"parameter {name!r}: the source yielded a {type(tensor).__name__}, not a tensor")
    if tensor.shape != spec.shape:
        raise errors.SpecMismatchError(f"parameter {name!r}: metadata() declared shape {spec.shape}, iteration yielded {tuple(tensor.shape)}")
