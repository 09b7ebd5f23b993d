"""The receiving side of a weight sync: built from engine-side specs alone.

A receiver knows the names, shapes and dtypes it accepts (`TensorSpec`s, e.g. from the
engine's own model), never the trainer's model. Everything else about a sync (bucket and
segment sizes, verification, the weight version) comes from the sender's typed header,
which the receiver decodes and checks itself before anything is applied; every rank
learns the verdict. Then, segment by segment, it reads the sender's status, lands the
bytes (in a destination of the sink, or in the transport's buffer), and delivers each
tensor to the sink once all of it is here (and checked, when verifying).

Failure semantics (docs/design.md, "Failures"): a tensor reaches the sink, or its
destination, only whole and only with bytes the sender packed. After a failed sync the
receiver's `version` does not advance; if any tensor of that sync was applied the
receiver is `consistent = False` (some tensors new, some old) until a complete sync lands.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import torch

import hal
from hal import kernels
from hal.backend import Backend
from hal.sync import errors
from hal.sync.delta import DeltaReceiver, scatter_key
from hal.sync.errors import RankReport
from hal.sync.auth import check_auth
from hal.sync.header import SyncHeader
from hal.sync.metrics import PhaseTimer, SyncMetrics
from hal.sync.plan import Bucket, BucketPlan, PlanCache, Segment, TensorSpec, is_solo
from hal.sync.sink import Pairs, Sink, as_sink
from hal.sync.protocol import SegmentStatus
from hal.sync.transport import Transport

_MAX_REPORTED = 5


class Receiver:
    """Receives syncs into a `Sink` (or an `apply(pairs)` callable), accepting only
    tensors described by `specs`, or, with `specs=None`, whatever tensors the sender's
    header declares (a rollout side without a model of its own; the header is still
    decoded and checked, and the sink's destinations must fit it).

    A sync may carry any subset of `specs` (a LoRA sync sends only adapters).
    `timeout_s` bounds every wait for the sender or the other receivers. `token`, when
    set, must be proven by the sender in every header (see `hal.sync.auth.check_auth`).
    `validate(specs)` may refuse, before anything is applied, a sync by the list of
    tensors it carries (e.g. "whole layers only"): raise `SpecMismatchError`.

    `version` is the weight version this side holds, set after a sync that every rank
    completed, never after a failed one; `consistent` is False while the weights mix two
    versions (a failed sync applied part of itself); `torn` names tensors whose bytes may
    be neither old nor new (a connection broke in the middle of an in-place transfer).
    """

    def __init__(
        self,
        transport: Transport,
        specs: Iterable[TensorSpec] | None,
        *,
        timeout_s: float = 60.0,
        token: str | None = None,
        validate: Callable[[list[TensorSpec]], None] | None = None,
        backend: Backend | None = None,
        version: int | None = None,
    ) -> None:
        if transport.is_sender:
            raise ValueError(f"Receiver on rank {transport.rank}, which is the transport's sender")
        if not timeout_s > 0:
            raise ValueError(f"Receiver timeout_s must be positive, got {timeout_s!r}")
        self.transport = transport
        self.timeout_s = float(timeout_s)
        self.token = token
        self.validate = validate
        self.backend = backend or hal.current()
        self.specs: dict[str, TensorSpec] | None = None if specs is None else {}
        for spec in specs if specs is not None else ():
            if not isinstance(spec, TensorSpec):
                raise TypeError(f"Receiver specs must be TensorSpec, got {type(spec).__name__}")
            if spec.name in self.specs:
                raise ValueError(f"parameter {spec.name!r} is listed twice in the receiver's specs")
            self.specs[spec.name] = spec
        self.version = version
        self.consistent = True
        self.torn: tuple[str, ...] = ()
        self.plans = PlanCache()
        self._stream = self.backend.new_stream()
        self._views = kernels.PieceViews()  # typed views of received buckets, per plan
        self._accepted: tuple[TensorSpec, ...] | None = None  # the last spec tuple `_check_specs` passed
        self._sink_destinations: tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor]] = (None, {}, {})
        # Buffers for tensors that arrive in chunks across buckets, kept across syncs (their
        # size is part of the layout): a fresh one per sync is page-faulted in each time,
        # which cost more than its transfer (docs/benchmarks.md).
        self._reassembly: dict[str, torch.Tensor] = {}
        self.delta = DeltaReceiver(self.backend)
        """What delta syncs land on, kept across syncs (hal.sync.delta)."""

    @property
    def reassembly_bytes(self) -> int:
        """Memory held across syncs for tensors that arrive in chunks (0 when none do)."""
        return sum(t.numel() for t in self._reassembly.values())

    # ---- header -----------------------------------------------------------------------
    def _check_header(self, payload: bytes, sink: Sink, challenge: str) -> tuple[SyncHeader | None, BucketPlan | None, RankReport]:
        """(the header, decoded or None; the plan, or None if refused; this rank's verdict)."""
        header: SyncHeader | None = None
        try:
            header = SyncHeader.decode(payload)
            check_auth(header, self.token, challenge)
            if self.version is not None and header.version < self.version:
                raise errors.StaleVersionError(f"receiver holds weight version {self.version}; refusing older version {header.version}")
            self._check_specs(header.specs, sink)
            if self.validate is not None:
                self.validate(list(header.specs))
            try:
                plan = self.plans.get(header.specs, header.bucket_bytes, header.verify, header.segment_bytes)
            except ValueError as exc:
                raise errors.HeaderError(f"header describes no valid bucket layout: {exc}") from None
            if plan.digest != header.digest:
                raise errors.SpecMismatchError(
                    f"bucket layout differs from the sender's ({plan.digest} vs {header.digest}): mismatched verl-hal versions?"
                )
            if header.delta_base is not None:
                self.delta.check_base(header.delta_base, plan, scatter_key(plan, sink, self.backend.device()), self.consistent)
        except errors.SyncError as exc:
            return header, None, errors.report_exception(exc, sender=False)
        return header, plan, RankReport()

    def _check_specs(self, specs: tuple[TensorSpec, ...], sink: Sink) -> None:
        """Refuse specs this receiver does not accept, or that the sink's destinations do not
        fit; keep the sink's destinations for this sync (`_Delivery`), asked once each."""
        problems: list[str] = []
        # checked against `self.specs` already (the same tuple), or nothing to check against
        known = specs is self._accepted or self.specs is None
        device = self.backend.device()
        in_place = sink.policy.in_place
        every: dict[str, torch.Tensor] = {}
        exact: dict[str, torch.Tensor] = {}
        for spec in specs:
            expected = None if known else self.specs.get(spec.name)
            if known:
                pass
            elif expected is None:
                problems.append(f"parameter {spec.name!r}: not a parameter this receiver accepts")
                continue
            elif expected.shape != spec.shape:
                problems.append(f"parameter {spec.name!r}: expected shape {expected.shape}, got {spec.shape}")
                continue
            elif expected.dtype != spec.dtype:
                problems.append(f"parameter {spec.name!r}: expected dtype {expected.dtype}, got {spec.dtype}")
                continue
            dest = sink.destination(spec.name)
            if dest is None:
                continue
            if not isinstance(dest, torch.Tensor) or dest.shape != spec.shape:
                got = tuple(dest.shape) if isinstance(dest, torch.Tensor) else type(dest).__name__
                problems.append(f"parameter {spec.name!r}: the engine's destination has shape {got}, the sync carries {spec.shape}")
                continue
            every[spec.name] = dest
            # only a destination matching the wire spec exactly (dtype, contiguous, on the
            # buffers' device) may be written in place
            if in_place and dest.dtype == spec.dtype and dest.is_contiguous() and dest.device == device:
                exact[spec.name] = dest
        if problems:
            more = f" (+{len(problems) - _MAX_REPORTED} more)" if len(problems) > _MAX_REPORTED else ""
            raise errors.SpecMismatchError("; ".join(problems[:_MAX_REPORTED]) + more)
        self._accepted = specs
        self._sink_destinations = (sink, every, exact)

    # ---- one sync ---------------------------------------------------------------------
    def receive(self, sink: Any) -> SyncMetrics:
        """Take one sync into `sink` (a `Sink`, or a callable `apply(pairs)`); see the class doc."""
        start, host_start = time.perf_counter(), time.thread_time()
        timer = PhaseTimer()
        sink = as_sink(sink)
        transport, rank = self.transport, self.transport.rank
        transport.timeout_s = self.timeout_s
        builds = self.plans.builds
        while True:
            challenge = transport.challenge()
            payload = transport.exchange_header(None)
            header, plan, report = self._check_header(payload, sink, challenge)
            where = f"sync of version {header.version}" if header is not None else "sync"
            try:
                errors.raise_if_any(transport.agree(report, "header check"), rank, where)
                break
            except errors.SyncError as exc:
                if header is not None and header.delta_base is not None and exc.only_delta_base:
                    continue  # the sender sends the same sync whole right away
                raise
        if header is None or plan is None:  # every rank agreed there was no error, so this cannot happen
            raise errors.SyncError(f"rank {rank}: the header check passed on every rank but this one kept no plan")
        transport.prepare(self.backend, plan)
        multi_piece = {p.spec.name for b in plan.buckets for p in b.pieces if not p.is_whole}
        for name in set(self._reassembly) - multi_piece:  # the layout changed: drop what it no longer needs
            del self._reassembly[name]

        kept_in = scatter_key(plan, sink, self.backend.device()) if header.delta else None
        delivery = _Delivery(self, plan, sink, timer)
        delivery.applier = self.delta.begin(header, plan, kept_in, delivery)
        try:
            delivery.run()
        except errors.PeerError:
            self._failed(delivery, sink)
            self.torn = tuple(sorted(delivery.landing))
            raise
        try:
            errors.raise_if_any(transport.agree(delivery.report(), "sync status"), rank, where)
        except errors.SyncError:
            self._failed(delivery, sink)
            raise
        self.version = header.version
        self.consistent = True
        self.torn = ()
        self.delta.completed(header, plan, kept_in)
        return SyncMetrics(
            version=header.version,
            bytes=plan.total_bytes,
            buckets=len(plan.buckets),
            tensors=len(plan.specs),
            transfer_s=timer.get("transfer"),
            apply_s=timer.get("apply"),
            total_s=time.perf_counter() - start,
            host_s=time.thread_time() - host_start,
            plan_reused=self.plans.builds == builds,
        )

    @property
    def baseline_bytes(self) -> int:
        """Memory held for delta syncs: an image of the last complete sync when the sink has
        no exact destinations, else one bucket to patch what is not a whole tensor in place
        (0 without delta)."""
        return self.delta.baseline_bytes

    def _failed(self, delivery: "_Delivery", sink: Sink) -> None:
        self.delta.lost()
        if delivery.touched:
            self.consistent = False
        try:
            sink.abort()
        except Exception as exc:  # noqa: BLE001 - the sync's own error is the one to raise
            delivery.notes.append(f"abort() failed: {type(exc).__name__}: {exc}")


class _Delivery:
    """The receiving state of one sync: where each tensor lands and what was applied."""

    def __init__(self, receiver: Receiver, plan: BucketPlan, sink: Sink, timer: PhaseTimer) -> None:
        self.receiver = receiver
        # A delta sync's image or scatter applier (hal.sync.delta), which answers land,
        # complete and image per segment in place of the plain path below; None: this one.
        self.applier: Any = None
        self.changed: set[str] = set()  # tensors of a delta sync some of whose words changed
        self.transport = receiver.transport
        self.backend = receiver.backend
        self.plan = plan
        self.sink = sink
        self.timer = timer
        self.error: RankReport | None = None
        self.touched = False  # some destination was written or some tensor applied
        self.sender_failed = False
        self.landing: set[str] = set()  # tensors landing in place with ranges still outstanding
        self.in_place: dict[str, bool] = {}  # the decision taken at each tensor's first range
        self.ready: Pairs = []  # complete tensors waiting for the end of their bucket
        self.whole_buckets = sink.policy.whole_buckets or plan.verify
        self.notes: list[str] = []
        # every destination the sink names, and those that may be written in place, as the
        # header check asked the sink for them (`Receiver._check_specs`)
        kept_for, self.destinations, self.exact = receiver._sink_destinations
        if kept_for is not sink:
            raise RuntimeError("receiver: the destinations were asked of another sink than this sync's")

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
            self.sender_failed = self.transport.receive_segments(self._land, self._complete)
            self.transport.finish()
        # the time inside _complete is applying, not waiting for the wire
        self.timer.add("transfer", -(self.timer.get("apply") or 0.0))

    def _land(self, k: int, j: int, status: SegmentStatus) -> torch.Tensor | None:
        bucket = self.plan.buckets[k]
        if self.applier is not None:
            return self.applier.land(bucket, j, status)
        return self._landing(bucket, bucket.segments[j], status)

    def _image(self, k: int) -> torch.Tensor:
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
        index, lo, hi = segment.parts[0]
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

    def _complete(self, k: int, j: int, landed: bool, status: SegmentStatus) -> None:
        bucket = self.plan.buckets[k]
        segment = bucket.segments[j]
        last_of_bucket = j == len(bucket.segments) - 1
        completed: Pairs = []
        try:
            with self.timer("apply"):
                if self.applier is not None:
                    completed = self.applier.complete(bucket, j, landed, status)
                else:
                    completed = self.arrived(bucket, segment, landed)
                if self.whole_buckets:
                    self.ready += completed
                    if last_of_bucket:
                        ready, self.ready = self.ready, []
                        self._verify(bucket)
                        self._deliver(ready)
                else:
                    self._deliver(completed)
        except errors.PeerError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported at the agreement; the protocol goes on
            self._fail(exc)

    def arrived(self, bucket: Bucket, segment: Segment, landed: bool, buffer: torch.Tensor | None = None) -> Pairs:
        """The tensors this segment completes, each as (name, where its bytes are now:
        the destination when landed, else `buffer`, by default the bucket's image)."""
        out: Pairs = []
        if landed:
            index, _, hi = segment.parts[0]
            piece = bucket.pieces[index]
            if hi == piece.nbytes and piece.is_last:
                self.landing.discard(piece.spec.name)
                out.append((piece.spec.name, self.exact[piece.spec.name]))
            return out
        if buffer is None:
            buffer = self._image(bucket.index)
        views = self.receiver._views.of(self.plan, buffer, bucket)
        copied = False
        for index, _, hi in segment.parts:
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
                    self.receiver._stream.wait_stream(self.backend.current_stream())
                self.backend.copy_(
                    into[piece.tensor_offset : piece.tensor_offset + piece.nbytes],
                    buffer[piece.offset : piece.offset + piece.nbytes],
                    stream=self.receiver._stream,
                )
                copied = True
            if piece.is_last:
                out.append((spec.name, kernels.typed_view(into, 0, spec.shape, spec.dtype)))
        if copied:
            self.receiver._stream.synchronize()  # the buffer is reused after this bucket
        return out

    def reassembly_buffer(self, spec: TensorSpec) -> torch.Tensor:
        """Where a tensor that arrives in chunks across buckets is gathered (kept across syncs)."""
        into = self.receiver._reassembly.get(spec.name)
        if into is None or into.numel() != spec.nbytes:
            into = self.receiver._reassembly[spec.name] = self.backend.empty(spec.nbytes)
        return into

    def _deliver(self, pairs: Pairs) -> None:
        """Copy complete tensors into their destinations (those not landed there), then apply.
        A delta sync hands over only the tensors that changed: the others are as they were."""
        if self.applier is not None and self.error is None and not self.sink.policy.apply_unchanged:
            pairs = [(n, t) for n, t in pairs if n in self.changed]
        if not pairs or self.error is not None:
            return
        stream = self.receiver._stream
        copies = [(self.destinations[n], t) for n, t in pairs if n in self.destinations and t is not self.destinations[n]]
        self.touched = True
        if copies:
            if self.backend.supports_async_streams:
                stream.wait_stream(self.backend.current_stream())
            # one multi-tensor copy for the segment (per copy, a launch cost more than the copy: H100)
            self.backend.copy_many_([d for d, _ in copies], [t for _, t in copies], stream=stream)
            stream.synchronize()  # the views are reused once this returns
        self.sink.apply([(n, self.destinations.get(n, t)) for n, t in pairs])

    def _verify(self, bucket: Bucket) -> None:
        if bucket.nbytes <= bucket.checksum_offset:
            return
        data = self._image(bucket.index)  # with delta: the resulting bytes, so drift is caught
        sent = kernels.typed_view(data, bucket.checksum_offset, (len(bucket.pieces),), torch.int64)
        got = torch.stack([kernels.checksum(data[o : o + n]) for o, n in bucket.checksum_ranges()])
        bad = (sent != got).nonzero().flatten().tolist()
        if bad:
            names = ", ".join(repr(bucket.pieces[i].spec.name) for i in bad[:_MAX_REPORTED])
            raise errors.ChecksumMismatchError(f"bucket {bucket.index}: checksum mismatch for parameter(s) {names}")
