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
from hal.sync.errors import RankReport
from hal.sync.auth import check_auth
from hal.sync.header import SyncHeader
from hal.sync.metrics import PhaseTimer, SyncMetrics
from hal.sync.plan import Bucket, BucketPlan, PlanCache, Segment, TensorSpec, bucket_offsets, is_solo, segment_word
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
        # Delta sync: the bytes of the last complete sync, and which version and layout they
        # are. Kept either in the sink's destinations themselves (`_baseline_in` names them:
        # a delta is scattered into them) or, for sinks without exact destinations, in an
        # image of the sync, its buckets back to back (`plan.bucket_offsets`).
        self._baseline: torch.Tensor | None = None
        self._baseline_version: int | None = None
        self._baseline_digest: str | None = None
        self._baseline_in: tuple[tuple[str, int], ...] | None = None
        self._work: torch.Tensor | None = None  # one bucket: patched bytes of segments that are not one whole tensor's

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
                self._check_delta_base(header.delta_base, plan, sink)
        except errors.SyncError as exc:
            return header, None, errors.report_exception(exc, sender=False)
        return header, plan, RankReport()

    def _check_delta_base(self, base: int, plan: BucketPlan, sink: Sink) -> None:
        """A delta lands only on exactly the bytes it was computed from."""
        kept_in = self._scatter_key(plan, sink)
        if self._baseline_version != base or self._baseline_digest != plan.digest or not self.consistent or self._baseline_in != kept_in:
            held = "no complete delta-synced version" if self._baseline_version is None else f"version {self._baseline_version}"
            raise errors.DeltaBaseError(
                f"a delta against version {base} cannot land: this receiver holds {held}"
                + ("" if self.consistent else " and part of a failed sync")
                + ("" if self._baseline_digest in (None, plan.digest) or self._baseline_version is None else " of another layout")
                + ("" if self._baseline_in == kept_in or self._baseline_version is None else " in other destinations than this sink's")
            )

    def _scatter_key(self, plan: BucketPlan, sink: Sink) -> tuple[tuple[str, int], ...] | None:
        """The destinations a delta can be scattered into (their names and addresses), or
        None when the receiver must keep its own image of the sync instead: some tensor has
        no destination holding exactly its wire bytes (dtype, contiguous, this device), the
        sink forbids writing into them (`SinkPolicy.in_place`), or the sync is verified (the
        checksum is of the whole resulting bytes, so they are built in the image first)."""
        if plan.verify or not sink.policy.in_place:
            return None
        device = self.backend.device()
        key = []
        for spec in plan.specs:
            dest = sink.destination(spec.name)
            if not isinstance(dest, torch.Tensor) or dest.dtype != spec.dtype or not dest.is_contiguous() or dest.device != device:
                return None
            key.append((spec.name, dest.data_ptr()))
        return tuple(key)

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
        start = time.perf_counter()
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

        scatter = self._scatter_key(plan, sink) if header.delta else None
        if header.delta and scatter is None:
            self._ensure_baseline(plan)
        else:
            self._baseline = None  # the destinations hold the base (or nothing is kept)
        if not header.delta:
            self._baseline_version = self._baseline_digest = self._baseline_in = None
        delivery = _Delivery(self, plan, sink, timer, header, scatter=scatter is not None)
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
        if header.delta:
            self._baseline_version, self._baseline_digest, self._baseline_in = header.version, plan.digest, scatter
        return SyncMetrics(
            version=header.version,
            bytes=plan.total_bytes,
            buckets=len(plan.buckets),
            tensors=len(plan.specs),
            transfer_s=timer.get("transfer"),
            apply_s=timer.get("apply"),
            total_s=time.perf_counter() - start,
            plan_reused=self.plans.builds == builds,
        )

    def _ensure_baseline(self, plan: BucketPlan) -> None:
        nbytes = sum(b.nbytes for b in plan.buckets)
        if self._baseline is None or self._baseline.numel() != nbytes:
            self._baseline = None  # free the old one first
            self._baseline = self.backend.empty(nbytes)
            self._baseline_version = self._baseline_digest = None

    @property
    def baseline_bytes(self) -> int:
        """Memory held for delta syncs: an image of the last complete sync when the sink has
        no exact destinations, else one bucket to patch what is not a whole tensor in place
        (0 without delta)."""
        return sum(t.numel() for t in (self._baseline, self._work) if t is not None)

    def _failed(self, delivery: "_Delivery", sink: Sink) -> None:
        self._baseline_version = None  # a failed sync leaves no usable base: the next one is whole
        if delivery.touched:
            self.consistent = False
        try:
            sink.abort()
        except Exception as exc:  # noqa: BLE001 - the sync's own error is the one to raise
            delivery.notes.append(f"abort() failed: {type(exc).__name__}: {exc}")


class _Delivery:
    """The receiving state of one sync: where each tensor lands and what was applied."""

    def __init__(self, receiver: Receiver, plan: BucketPlan, sink: Sink, timer: PhaseTimer, header: SyncHeader, *, scatter: bool = False) -> None:
        self.receiver = receiver
        # Delta sync, two ways. Image (`delta`): every segment's bytes end up in the
        # receiver's baseline (an image of the sync, buckets back to back): whole ones are
        # received there, deltas patch it, and tensors are delivered from it. Scatter
        # (`patching`): the destinations are the base; once a bucket is all here its deltas
        # are checked, then scattered straight into the destinations of the tensors wholly
        # in one segment range, and applied to a copy of the old bytes (in `Receiver._work`)
        # for the rest, which are delivered from there as from the transport's buffer.
        self.delta = header.delta and not scatter
        self.patching = scatter and header.delta_base is not None
        self.offsets = bucket_offsets(plan) if self.delta else []
        self.pending: list[tuple[Segment, SegmentStatus]] = []  # a patching bucket's segments, applied at its end
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
        if self.patching:  # nothing is written before the whole bucket is here and checked
            return None
        if self.delta:  # whole bytes straight into the baseline; a delta payload into the transport's buffer
            return self._image(k)[bucket.segments[j].start : bucket.segments[j].stop] if status.encoding == kernels.DENSE else None
        return self._landing(bucket, bucket.segments[j], status)

    def _image(self, k: int) -> torch.Tensor:
        """Where bucket k's bytes are once its segments arrived: the baseline's image of it
        in a delta-synced sync, else the transport's buffer."""
        if not self.delta:
            return self.transport.buffer(k)
        return self.receiver._baseline[self.offsets[k] : self.offsets[k] + self.plan.buckets[k].nbytes]

    def _patch(self, bucket: Bucket, segment: Segment, landed: bool, status: SegmentStatus) -> None:
        """Bring the segment's new bytes into the baseline (a delta sync only)."""
        target = self._image(bucket.index)[segment.start : segment.stop]
        names = [bucket.pieces[i].spec.name for i, _, _ in segment.parts]
        if status.encoding == kernels.DENSE:
            if not landed:  # the transport kept them in its own (shared) buffer
                # a torch op, as the patches and checksums that read the image next: ordered
                # with them on the current stream (not queued on another, which they would race)
                target.copy_(self.transport.buffer(bucket.index)[segment.start : segment.stop])
            self.changed.update(names)  # not compared: counted as changed
            return
        payload = self.transport.buffer(bucket.index)[segment.start : segment.start + status.nbytes]
        if kernels.delta_apply(target, payload, status.encoding, segment_word(bucket, segment)):
            self.changed.update(names)

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
                if self.patching:
                    self.pending.append((segment, status))
                    if last_of_bucket:
                        pending, self.pending = self.pending, []
                        self._deliver(self._scatter(bucket, pending))
                    return
                if self.delta:
                    self._patch(bucket, segment, landed, status)
                    landed = False  # in the baseline: delivered from there
                completed = self._arrived(bucket, segment, landed)
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

    def _arrived(self, bucket: Bucket, segment: Segment, landed: bool, buffer: torch.Tensor | None = None) -> Pairs:
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
            into = self._reassembly_buffer(spec)
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
        if self.error is not None:
            return []
        buffer = self.transport.buffer(bucket.index)
        checked: list[tuple[int, int | None]] = []  # per pending segment: its word size, the words its delta changes
        for segment, status in pending:
            word, count = segment_word(bucket, segment), None
            if status.encoding != kernels.DENSE:
                payload = buffer[segment.start : segment.start + status.nbytes]
                count = kernels.delta_check(payload, status.encoding, (segment.stop - segment.start) // word, word)
            checked.append((word, count))
        out: Pairs = []
        for (segment, status), (word, count) in zip(pending, checked):
            names = [bucket.pieces[i].spec.name for i, _, _ in segment.parts]
            source, changed = buffer, True
            if status.encoding != kernels.DENSE:
                payload = buffer[segment.start : segment.start + status.nbytes]
                first = bucket.pieces[segment.parts[0][0]] if segment.parts else None
                if first is not None and first.is_whole and is_solo(bucket, segment):
                    _, lo, hi = segment.parts[0]
                    self.touched = True
                    if kernels.delta_apply(kernels.as_bytes(self.exact[first.spec.name])[lo:hi], payload, status.encoding, word, checked=count):
                        self.changed.add(first.spec.name)
                    if hi == first.nbytes:
                        out.append((first.spec.name, self.exact[first.spec.name]))
                    continue
                source = self._work_buffer()
                for index, lo, hi in segment.parts:  # the old bytes (gaps between pieces are never patched)
                    piece = bucket.pieces[index]
                    old = kernels.as_bytes(self.exact[piece.spec.name])[piece.tensor_offset + lo : piece.tensor_offset + hi]
                    source[piece.offset + lo : piece.offset + hi].copy_(old)
                changed = bool(kernels.delta_apply(source[segment.start : segment.stop], payload, status.encoding, word, checked=count))
            if changed:
                self.changed.update(names)
            for index, lo, hi in segment.parts:
                piece = bucket.pieces[index]
                spec = piece.spec
                new = source[piece.offset + lo : piece.offset + hi]
                if piece.is_whole:
                    if changed and hi > lo:  # unchanged: the destination holds these bytes already
                        kernels.as_bytes(self.exact[spec.name])[lo:hi].copy_(new)
                        self.touched = True
                    if hi == piece.nbytes:
                        out.append((spec.name, self.exact[spec.name]))
                    continue
                into = self._reassembly_buffer(spec)
                into[piece.tensor_offset + lo : piece.tensor_offset + hi].copy_(new)
                if hi == piece.nbytes and piece.is_last:
                    out.append((spec.name, kernels.typed_view(into, 0, spec.shape, spec.dtype)))
        return out

    def _reassembly_buffer(self, spec: TensorSpec) -> torch.Tensor:
        """Where a tensor that arrives in chunks across buckets is gathered (kept across syncs)."""
        into = self.receiver._reassembly.get(spec.name)
        if into is None or into.numel() != spec.nbytes:
            into = self.receiver._reassembly[spec.name] = self.backend.empty(spec.nbytes)
        return into

    def _work_buffer(self) -> torch.Tensor:
        work = self.receiver._work
        if work is None or work.numel() < self.plan.max_bucket_nbytes:
            work = self.receiver._work = None  # free the old one first
            work = self.receiver._work = self.backend.empty(self.plan.max_bucket_nbytes)
        return work

    def _deliver(self, pairs: Pairs) -> None:
        """Copy complete tensors into their destinations (those not landed there), then apply.
        A delta sync hands over only the tensors that changed: the others are as they were."""
        if (self.delta or self.patching) and self.error is None and not self.sink.policy.apply_unchanged:
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
