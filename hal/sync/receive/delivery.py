"""The receiver's delivery of one sync: where each segment lands, which tensors it
completes, and handing those to the sink (hal.sync.receive.receiver runs it).

A tensor reaches the sink, or its destination, only whole and only with bytes the sender
packed; with verification, or a sink that asks for whole buckets, only once its whole
bucket is here (and checked). What a receiver keeps from one sync to the next for this
(`Kept`) is derived from the layout and the sink's destinations alone: typed views of the
buckets, buffers that tensors spread over buckets are gathered in, and per segment the
lists a delivery hands to the copy and to the sink, so that a segment of thousands of
small tensors costs one multi-tensor copy and no Python object per tensor.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch

from hal import kernels
from hal.backends.interface import Backend
from hal.backends.types import PreparedCopies
from hal.sync import errors
from hal.sync.errors import RankReport
from hal.sync.metrics import PhaseTimer
from hal.sync.plan.buckets import Bucket, BucketPlan, Segment, is_solo
from hal.sync.spec import TensorSpec
from hal.sync.wire.channel import SegmentStatus
from hal.sync.sink import Pairs, Sink, SinkPolicy

_MAX_REPORTED = 5
_UNKNOWN = object()  # a tight segment's landing, not yet looked for


def destination_problem(spec: TensorSpec, dest: Any) -> str | None:
    """What is wrong with `dest` as the destination of a tensor of `spec` (a destination must
    be a tensor of the sync's shape; its dtype may differ: the copy casts), or None."""
    if isinstance(dest, torch.Tensor) and tuple(dest.shape) == spec.shape:
        return None
    got = tuple(dest.shape) if isinstance(dest, torch.Tensor) else type(dest).__name__
    return f"parameter {spec.name!r}: the engine's destination has shape {got}, the sync carries {spec.shape}"


@dataclass(frozen=True, slots=True)
class Destinations:
    """The sink's destinations for one sync, as the header check asked it for them."""

    every: dict[str, torch.Tensor]
    """Every destination the sink names: the tensor's bytes are copied there if they did not land there."""
    exact: dict[str, torch.Tensor]
    """Those that may be written in place (the wire's dtype, contiguous, on the buffers' device),
    among the tensors that travel alone or back to back in a tight segment (any tensor, for
    a delta sync, which patches in place)."""
    objects: list[Any]
    """Per spec of the sync, in order, what the sink answered (a tensor or None): compared by
    identity with the last sync's to know whether the cached handovers still hold."""


@dataclass(slots=True)
class Handover:
    """Whole tensors a segment (or a bucket) completes in the receiver's buffer: the copies
    into their destinations, then what the sink is handed. Kept across syncs (`Kept`)."""

    copy_dsts: list[torch.Tensor]
    copy_srcs: list[torch.Tensor]
    applied: Pairs
    """(name, where its new bytes are: the destination, else the view of the buffer)."""
    kept: bool = False
    """Kept across syncs: its copies are worth preparing (`copies`)."""
    copies: PreparedCopies | None = None
    """Its copies made ready once (`Backend.prepare_copies`), while the destinations are
    those the receiver kept, at the same addresses (`Kept.steady`)."""


@dataclass(frozen=True, slots=True)
class SpanLanding:
    """Where a tight segment lands: the memory its destinations lie back to back in, the
    names of its tensors, and what the sink is handed once it arrived."""

    memory: torch.Tensor
    names: list[str]
    handover: Handover


class Kept:
    """What a receiver keeps across syncs for delivering them (see the module doc)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.stream = backend.new_stream()
        self.views = kernels.PieceViews()  # typed views of received buckets, per plan and buffer
        # Buffers for tensors that arrive in chunks across buckets (their size is part of the
        # layout): a fresh one per sync is page-faulted in each time, which cost more than
        # its transfer (docs/benchmarks.md).
        self.reassembly: dict[str, torch.Tensor] = {}
        self._handovers: dict[tuple[int, int, int, int], Handover] = {}
        self._handover_basis: tuple[str | None, list[Any]] = (None, [])  # (plan digest, destination objects)
        self._checked: Destinations | None = None  # the destinations of the last sync
        # per tight segment (bucket, segment): where it lands, or None (it does not lie back
        # to back in the destinations). Kept only while `steady`
        self.spans: dict[tuple[int, int], SpanLanding | None] = {}
        self.steady = False
        """This sync's destinations are the very check of the last sync, which the receiver
        kept because the sink said nothing changed, memory included (hal.sync.plan.steady): the
        copies prepared into them hold."""

    @property
    def reassembly_bytes(self) -> int:
        return sum(t.numel() for t in self.reassembly.values())

    def begin(self, plan: BucketPlan, destinations: Destinations) -> None:
        """A sync laid out by `plan` into `destinations` starts: drop what no longer holds."""
        digest, objects = self._handover_basis
        if digest != plan.digest and self.reassembly:  # the layout changed: drop what it no longer needs
            multi_piece = {p.spec.name for b in plan.buckets for p in b.pieces if not p.is_whole}
            for name in set(self.reassembly) - multi_piece:
                del self.reassembly[name]
        self.steady = digest == plan.digest and destinations is self._checked
        self._checked = destinations
        if self.steady:
            return
        self.spans = {}  # destinations checked again may have moved
        if digest == plan.digest and len(objects) == len(destinations.objects) and all(map(operator.is_, objects, destinations.objects)):
            # the same objects, checked again: the lists hold, copies prepared into their memory may not
            for handover in self._handovers.values():
                handover.copies = None
            return
        self._handovers = {}
        self._handover_basis = (plan.digest, destinations.objects)

    def reassembly_buffer(self, spec: TensorSpec) -> torch.Tensor:
        """Where a tensor that arrives in chunks across buckets is gathered (kept across syncs)."""
        into = self.reassembly.get(spec.name)
        if into is None or into.numel() != spec.nbytes:
            into = self.reassembly[spec.name] = self.backend.empty(spec.nbytes)
        return into

    def handover(self, key: tuple[int, int, int, int]) -> Handover | None:
        """The handover kept for a segment of whole tensors in a buffer (`key`: the buffer's
        address and size, bucket, segment), made once per layout, buffer and destinations."""
        return self._handovers.get(key)

    def keep_handover(self, key: tuple[int, int, int, int], handover: Handover) -> Handover:
        handover.kept = True
        self._handovers[key] = handover
        return handover


def make_handover(pairs: Pairs, destinations: Destinations) -> Handover:
    every = destinations.every
    copies = [(every[n], t) for n, t in pairs if n in every and t is not every[n]]
    return Handover([d for d, _ in copies], [t for _, t in copies], [(n, every.get(n, t)) for n, t in pairs])


class Delivery:
    """The receiving state of one sync: where each tensor lands and what was applied.

    The transport calls `land` and `complete` per segment (`Transport.receive_segments`).
    A delta sync's image or scatter applier (hal.sync.delta) answers land, complete and
    image per segment in place of the plain path here, and uses `arrived`, `changed`,
    `touched`, `exact` and `reassembly_buffer` as this path does.
    """

    def __init__(
        self, kept: Kept, transport: Any, plan: BucketPlan, sink: Sink, policy: SinkPolicy, destinations: Destinations, timer: PhaseTimer
    ) -> None:
        self.kept = kept
        self.transport = transport
        self.backend = kept.backend
        self.plan = plan
        self.sink = sink
        self.policy = policy
        self.timer = timer
        self.applier: Any = None  # set by the receiver for a delta sync (hal.sync.delta)
        self.changed: set[str] = set()  # tensors of a delta sync some of whose words changed
        self.error: RankReport | None = None
        self.touched = False  # some destination was written or some tensor applied
        self.sender_failed = False
        self.landing: set[str] = set()  # tensors landing in place with ranges still outstanding
        self.in_place: dict[str, bool] = {}  # the decision taken at each tensor's first range
        self.ready: list[Pairs | Handover] = []  # complete tensors waiting for the end of their bucket
        self.whole_buckets = policy.whole_buckets or plan.verify
        self.notes: list[str] = []
        self.destinations = destinations
        self.exact = destinations.exact
        kept.begin(plan, destinations)

    def report(self) -> RankReport:
        if self.error is not None:
            return RankReport(error=self.error.error, kind=self.error.kind, inconsistent=self.touched)
        return RankReport(inconsistent=self.touched)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = errors.report_exception(exc, sender=False)

    def run(self) -> None:
        """Take every segment through the transport, which orders the steps (see
        `Transport.receive_segments`); a FAILED status from the sender ends it early."""
        with self.timer("transfer"):
            self.sender_failed = self.transport.receive_segments(self.land, self.complete)
            self.transport.finish()
        # the time inside complete is applying, not waiting for the wire
        self.timer.add("transfer", -(self.timer.get("apply") or 0.0))

    # ---- per segment ----------------------------------------------------------------
    def land(self, k: int, j: int, status: SegmentStatus) -> torch.Tensor | None:
        bucket = self.plan.buckets[k]
        if self.applier is not None:
            return self.applier.land(bucket, j, status)
        segment = bucket.segments[j]
        if segment.tight:
            return self._span_landing(bucket, j, segment)
        return self._landing(bucket, segment, status)

    def image(self, k: int) -> torch.Tensor:
        """Where bucket k's bytes are once its segments arrived: the transport's buffer, or
        a delta sync's image of it."""
        return self.transport.buffer(k) if self.applier is None else self.applier.image(k)

    def _landing(self, bucket: Bucket, segment: Segment, status: SegmentStatus) -> torch.Tensor | None:
        """Where a segment lands: the bytes of a destination, or None (the transport's buffer).

        In place only when the segment is one range of one tensor with an exact
        destination, nothing is being verified, and either this one segment carries the
        whole tensor or the sender vouches (DIRECT) that every range of it follows. The
        decision is taken at a tensor's first range and kept for the rest of it.
        """
        if not is_solo(bucket, segment):
            return None
        index, lo, hi = segment.ranges[0]
        piece = bucket.pieces[index]
        name = piece.spec.name
        dest = self.exact.get(name)
        if dest is None or self.plan.verify:
            return None
        if piece.is_first and lo == 0:
            whole_here = piece.is_whole and hi == piece.nbytes
            decided = self.error is None and (status.direct or whole_here)
            self.in_place[name] = decided
        else:
            decided = self.in_place.get(name, False)
            if decided and not status.direct:
                raise errors.PeerError(f"parameter {name!r}: the sender stopped vouching for its remaining ranges mid-tensor")
        if not decided:
            return None
        self.landing.add(name)
        self.touched = True
        return kernels.as_bytes(dest)[piece.tensor_offset + lo : piece.tensor_offset + hi]

    def _span_landing(self, bucket: Bucket, j: int, segment: Segment) -> torch.Tensor | None:
        """Where a tight segment lands: the memory its tensors' destinations lie back to back
        in, exactly as the segment's bytes do (each exact: the wire's dtype, contiguous,
        this device), or None (the transport's buffer, then a copy). Found once while the
        destinations are kept (`Kept.steady`); not when verifying (checksums are checked
        before any destination is written) nor after a failure in this sync."""
        if self.plan.verify or self.error is not None:
            return None
        key = (bucket.index, j)
        span = self.kept.spans.get(key, _UNKNOWN)
        if span is _UNKNOWN:
            span = self.kept.spans[key] = self._find_span(bucket, segment)
        if span is None:
            return None
        self.landing.update(span.names)
        self.touched = True
        return span.memory

    def _find_span(self, bucket: Bucket, segment: Segment) -> SpanLanding | None:
        exact, pieces = self.exact, [bucket.pieces[index] for index, _, _ in segment.ranges]
        dests = [exact.get(p.spec.name) for p in pieces]
        if any(d is None for d in dests):
            return None
        offsets = [p.offset - segment.start for p in pieces]
        memory = kernels.span_bytes(dests, offsets, segment.stop - segment.start, [p.spec.dtype for p in pieces], dests[0].device)
        if memory is None:
            return None
        names = [p.spec.name for p in pieces]
        # the sink is handed the destinations themselves: nothing to copy
        return SpanLanding(memory, names, Handover([], [], list(zip(names, dests))))

    def complete(self, k: int, j: int, landed: bool, status: SegmentStatus) -> None:
        bucket = self.plan.buckets[k]
        segment = bucket.segments[j]
        try:
            with self.timer("apply"):
                if self.applier is not None:
                    completed: Pairs | Handover = self.applier.complete(bucket, j, landed, status)
                else:
                    completed = self._arrived_plain(bucket, j, segment, landed)
                if not self.whole_buckets:
                    self._deliver([completed])
                    return
                self.ready.append(completed)
                if j == len(bucket.segments) - 1:
                    ready, self.ready = self.ready, []
                    self._verify(bucket)
                    self._deliver(ready)
        except errors.PeerError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported at the agreement; the protocol goes on
            self._fail(exc)

    def _arrived_plain(self, bucket: Bucket, j: int, segment: Segment, landed: bool) -> Pairs | Handover:
        """What segment j completes on the plain path: a cached handover when it is packed
        whole tensors in the transport's buffer (the case of thousands of small tensors)."""
        if landed and segment.tight:
            span = self.kept.spans[(bucket.index, j)]  # found when it landed (`_span_landing`)
            self.landing.difference_update(span.names)
            return span.handover
        if landed or not segment.ranges:
            return self.arrived(bucket, segment, landed)
        buffer = self.transport.buffer(bucket.index)
        key = (buffer.data_ptr(), buffer.numel(), bucket.index, j)
        found = self.kept.handover(key)
        if found is not None:
            return found  # (only a segment of whole tensors is ever kept)
        pieces = bucket.pieces
        if not all(pieces[i].is_whole for i, _, _ in segment.ranges):
            return self.arrived(bucket, segment, landed)
        return self.kept.keep_handover(key, make_handover(self.arrived(bucket, segment, False, buffer), self.destinations))

    def arrived(self, bucket: Bucket, segment: Segment, landed: bool, buffer: torch.Tensor | None = None) -> Pairs:
        """The tensors this segment completes, each as (name, where its bytes are now:
        the destination when landed, else `buffer`, by default the bucket's image)."""
        out: Pairs = []
        if landed:
            index, _, hi = segment.ranges[0]
            piece = bucket.pieces[index]
            if hi == piece.nbytes and piece.is_last:
                self.landing.discard(piece.spec.name)
                out.append((piece.spec.name, self.exact[piece.spec.name]))
            return out
        if buffer is None:
            buffer = self.image(bucket.index)
        views = self.kept.views.of(self.plan, buffer, bucket)
        stream, copied = self.kept.stream, False
        for index, _, hi in segment.ranges:
            piece = bucket.pieces[index]
            spec = piece.spec
            if hi != piece.nbytes:
                continue  # this piece has more bytes to come in the bucket
            if piece.is_whole:
                out.append((spec.name, views[index]))
                continue
            # one chunk of a tensor spread over buckets: gather it before anyone sees it
            into = self.reassembly_buffer(spec)
            if piece.nbytes:
                if not copied and self.backend.supports_async_streams:  # the receive completed on the current stream
                    stream.wait_stream(self.backend.current_stream())
                self.backend.copy_(
                    into[piece.tensor_offset : piece.tensor_offset + piece.nbytes],
                    buffer[piece.offset : piece.offset + piece.nbytes],
                    stream=stream,
                )
                copied = True
            if piece.is_last:
                out.append((spec.name, kernels.typed_view(into, 0, spec.shape, spec.dtype)))
        if copied:
            stream.synchronize()  # the buffer is reused after this bucket
        return out

    def reassembly_buffer(self, spec: TensorSpec) -> torch.Tensor:
        return self.kept.reassembly_buffer(spec)

    def _deliver(self, completed: list[Pairs | Handover]) -> None:
        """Copy complete tensors into their destinations (those not landed there), then apply.
        A delta sync hands over only the tensors that changed: the others are as they were."""
        if self.error is not None:
            return
        if self.applier is not None and not self.policy.apply_unchanged:
            # a delta sync's appliers hand over pairs, never a cached handover
            changed = self.changed
            completed = [[(n, t) for n, t in pairs if n in changed] for pairs in completed]
        handovers = [c if isinstance(c, Handover) else make_handover(c, self.destinations) for c in completed]
        if len(handovers) == 1:
            dsts, srcs, applied = handovers[0].copy_dsts, handovers[0].copy_srcs, list(handovers[0].applied)
        else:
            dsts = [d for h in handovers for d in h.copy_dsts]
            srcs = [s for h in handovers for s in h.copy_srcs]
            applied = [p for h in handovers for p in h.applied]
        if not applied:
            return
        self.touched = True
        if dsts:
            stream = self.kept.stream
            if self.backend.supports_async_streams:
                stream.wait_stream(self.backend.current_stream())
            # one multi-tensor copy for the segment (per copy, a launch cost more than the copy: H100);
            # every destination's shape was checked against its spec, every view is made from it
            one = handovers[0] if len(handovers) == 1 else None
            if one is not None and one.kept and self.kept.steady:
                if one.copies is None:  # once while the destinations are kept
                    one.copies = self.backend.prepare_copies(dsts, srcs, shapes_checked=True)
                self.backend.copy_prepared_(one.copies, stream=stream)
            else:
                self.backend.copy_many_(dsts, srcs, stream=stream, shapes_checked=True)
            stream.synchronize()  # the views are reused once this returns
        self.sink.apply(applied)

    def _verify(self, bucket: Bucket) -> None:
        if bucket.nbytes <= bucket.checksum_offset:
            return
        data = self.image(bucket.index)  # with delta: the resulting bytes, so drift is caught
        sent = kernels.typed_view(data, bucket.checksum_offset, (len(bucket.pieces),), torch.int64)
        got = bucket.checksummer(data.device).compute(data)  # every piece at once
        bad = (sent != got).nonzero().flatten().tolist()
        if bad:
            names = ", ".join(repr(bucket.pieces[i].spec.name) for i in bad[:_MAX_REPORTED])
            raise errors.ChecksumMismatchError(f"bucket {bucket.index}: checksum mismatch for parameter(s) {names}")
