"""The sending side of a weight sync: one implementation for every backend.

Per sync: declare the tensors (a typed header), let every receiver check them, then for
each segment of each bucket pack it on the pack stream while the previous one is in
flight, and hand it to the transport once its pack event completed. Two bucket buffers
alternate; one is packed again only after the transport is done with its previous
bucket. There is no global synchronize in the loop: ordering comes from events.

If the source raises or a pack fails, the transport sends a FAILED status in place of
that segment and nothing more: no byte the sender did not pack leaves it, and every
receiver stops before landing anything of that segment (docs/design.md, "Failures").
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Iterator

import torch

import hal
from hal import kernels
from hal.backend import Backend
from hal.sync import errors
from hal.sync.config import SyncConfig, default_bucket_bytes, wire_dtype_for
from hal.sync.header import SyncHeader
from hal.sync.metrics import PhaseTimer, SyncMetrics
from hal.sync.plan import Bucket, BucketPlan, PlanCache, Segment, TensorSpec, bucket_offsets, segment_word
from hal.sync.source import as_source
from hal.sync.transport import Transport


class Sender:
    """Sends a source's tensors to every receiver of `transport`.

    `config` is used as given. `token`, when the engines were started with one, proves
    to them that this trainer may push weights (it never travels itself). Reused across
    syncs: it keeps the bucket layout (while metadata is unchanged), the pack stream and
    the pinned staging buffer, and nothing else.
    """

    def __init__(
        self, transport: Transport, config: SyncConfig | None = None, *, backend: Backend | None = None, token: str | None = None
    ) -> None:
        if not transport.is_sender:
            raise ValueError(f"Sender on rank {transport.rank}, but the transport's sender is rank {transport.src}")
        self.transport = transport
        self.config = config if config is not None else SyncConfig()
        if not isinstance(self.config, SyncConfig):
            raise TypeError(f"Sender config must be a SyncConfig, got {type(self.config).__name__}")
        self.backend = backend or hal.current()
        self.token = token
        self.transport.timeout_s = self.config.timeout_s
        # None until the first sync when derived from free memory (it depends on the largest tensor)
        self.bucket_bytes: int | None = self.config.bucket_bytes
        self.plans = PlanCache()
        self.version: int | None = None
        self._stream = self.backend.new_stream()
        self._views = kernels.PieceViews()  # typed views of the pack targets, per plan
        self._staging: torch.Tensor | None = None
        self._sized_for = 0
        # Delta sync: the wire bytes of the last complete sync (buckets back to back), their
        # version and layout, and how many delta syncs followed the last whole one.
        self._baseline: torch.Tensor | None = None
        self._baseline_version: int | None = None
        self._baseline_digest: str | None = None
        self._since_anchor = 0
        self._pacer = _DeltaPacer() if self.config.delta is not None and self.config.delta.choose == "time" else None
        self.anchors_after_refusal = 0
        """Delta syncs some receiver refused (it did not hold the base) and that went whole."""

    def _wire_specs(self, metadata: list[TensorSpec]) -> list[TensorSpec]:
        wire = self.config.wire_dtype
        if wire is None:
            return metadata
        return [s if (d := wire_dtype_for(s.dtype, wire)) is s.dtype else TensorSpec(s.name, s.shape, d) for s in metadata]

    def send(self, source: Any, *, version: int) -> SyncMetrics:
        """Send every tensor of `source` as weight version `version`; returns this sync's metrics.

        Raises a `SyncError` subclass (on this and every receiving rank) if any rank
        rejected the header, failed, or did not answer in time; `SourceError` when this
        side's source or a pack failed. The error's `reports` say which receivers were left
        holding part of the sync (`inconsistent_ranks`).
        """
        return self._send(source, version)

    def _send(self, source: Any, version: int, gate: Callable[[errors.SyncError | None], None] | None = None) -> SyncMetrics:
        """`send`, with `gate(header_error)` called once the receivers' verdict on the header
        is known, before any tensor is gathered (`TrainerSync` tells the other trainer
        ranks there whether to gather); a gate that raises stops the sync there."""
        if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version < 2**63:
            raise ValueError(f"version must be a non-negative int below 2**63 (e.g. the global step), got {version!r}")
        start = time.perf_counter()
        timer = PhaseTimer()
        transport = self.transport
        transport.timeout_s = self.config.timeout_s
        source = as_source(source)
        metadata = list(source.metadata())
        builds = self.plans.builds
        wire_specs = self._wire_specs(metadata)
        self._size_buckets(wire_specs)
        plan = self.plans.get(wire_specs, self.bucket_bytes, self.config.verify, transport.segment_bytes(self.config.segment_bytes))
        where = f"sync of version {version}"

        delta = self.config.delta
        base, choice, sample = self._delta_base(plan)
        while True:
            try:
                challenge = transport.challenge()
                header = SyncHeader.from_plan(
                    plan, version=version, token=self.token, challenge=challenge, delta=delta is not None, delta_base=base
                )
                transport.exchange_header(header.encode())
                errors.raise_if_any(transport.agree(errors.RankReport(sender=True), "header check"), transport.rank, where)
                break
            except errors.SyncError as exc:
                if base is not None and exc.only_delta_base:
                    # some receiver does not hold the base: the same sync, whole, at once (and, the
                    # sender's base being good, a measure of the compare when choosing by time)
                    base, choice, sample = None, "anchor", self._pacer is not None
                    self.anchors_after_refusal += 1
                    continue
                if gate is not None:
                    gate(exc)
                raise
        gate_error: errors.SyncError | None = None
        if gate is not None:
            try:
                gate(None)
            except errors.SyncError as exc:
                gate_error = exc
        transport.prepare(self.backend, plan)
        if not self.config.bypass_cpu:
            self._ensure_staging(plan.max_bucket_nbytes)

        cold = delta is not None and (self._ensure_baseline(plan) or self.plans.builds != builds)
        self._baseline_version = None  # until this sync completes, the baseline is neither old nor new
        deltas = None
        if delta is not None:
            budget = self._pacer.whole_s_per_byte() if self._pacer is not None else None
            # whole segments are packed straight into the baseline, so that they cost no copy more than without delta
            into_baseline = self.config.bypass_cpu and bool(plan.buckets) and self._baseline.device == transport.buffer(0).device
            deltas = _DeltaState(plan, base is not None, choice, budget, into_baseline, sample)
        if gate_error is None:
            failure = self._send_buckets(plan, iter(source), timer, deltas)
        else:  # the receivers wait for a first segment: tell them none comes
            failure = gate_error
            first = next(((b.index, j) for b in plan.buckets for j, _ in enumerate(b.segments)), None)
            if first is not None:
                transport.send_failure(*first)
            transport.finish()
        report = errors.RankReport(sender=True)
        if failure is not None:
            failure = errors.SourceError(f"{type(failure).__name__}: {failure}") if not isinstance(failure, errors.SyncError) else failure
            report = errors.report_exception(failure, sender=True)
        errors.raise_if_any(transport.agree(report, "sync status"), transport.rank, where)

        self.version = version
        total_s = time.perf_counter() - start
        if deltas is not None:
            self._baseline_version, self._baseline_digest = version, plan.digest
            self._since_anchor = self._since_anchor + 1 if deltas.active else 0
            if self._pacer is not None:
                # (less the samples' time: a whole sync without them is what a delta competes with)
                seconds = total_s - deltas.sampled_s
                self._pacer.record(deltas.choice, seconds, deltas.dense_bytes, warm=not cold, encode_rate=deltas.encode_rate())
        return SyncMetrics(
            version=version,
            bytes=plan.total_bytes,
            buckets=len(plan.buckets),
            tensors=len(plan.specs),
            gather_s=timer.get("gather"),
            pack_s=timer.get("pack"),
            transfer_s=timer.get("transfer"),
            total_s=total_s,
            plan_reused=self.plans.builds == builds,
            **(deltas.metrics(self._baseline.numel()) if deltas is not None else {}),
        )

    # ---- delta sync --------------------------------------------------------------------
    def _delta_base(self, plan: BucketPlan) -> tuple[int | None, str | None, bool]:
        """The version a delta can be computed from, or None for a whole sync; why
        (`SyncMetrics.delta_choice`): an anchor on the first sync, a new layout, every
        `anchor_every`-th sync and after any failure, a pause while deltas do not pay; and
        whether this whole sync samples the compare's speed (choosing by time, with a
        baseline that holds the last version to compare against)."""
        delta = self.config.delta
        if delta is None:
            return None, None, False
        if self._baseline_version is None or self._baseline_digest != plan.digest:
            return None, "anchor", False
        if self._since_anchor + 1 >= delta.anchor_every:
            return None, "anchor", self._pacer is not None
        if self._pacer is not None:
            choice, sample = self._pacer.choose()
            if choice == "paused":
                return None, choice, sample
        return self._baseline_version, "delta", False

    def _ensure_baseline(self, plan: BucketPlan) -> bool:
        """Allocate the baseline for this layout; True when it was (its pages are new)."""
        nbytes = sum(b.nbytes for b in plan.buckets)
        if self._baseline is None or self._baseline.numel() != nbytes:
            self._baseline = None  # free the old one first
            on_host = self.config.delta.baseline == "host"
            self._baseline = self.backend.empty_pinned(nbytes) if on_host else self.backend.empty(nbytes)
            self._baseline_version = self._baseline_digest = None
            return True
        return False

    @property
    def baseline_bytes(self) -> int:
        """Memory held for delta syncs: the bytes of the last complete sync (0 without delta)."""
        return 0 if self._baseline is None else self._baseline.numel()

    def _encode(
        self, deltas: "_DeltaState", bucket: Bucket, segment: Segment, data: torch.Tensor, ready: Any, compare: bool, sample: bool
    ) -> tuple[torch.Tensor, int, Any]:
        """The segment's new bytes into the baseline, and what to send: the bytes, or (when
        `compare`) the words that changed since the baseline when that is smaller. With
        `sample`, the start of the segment is encoded only to time it (it goes whole)."""
        k = bucket.index
        word = segment_word(bucket, segment)
        base = self._baseline[deltas.offsets[k] + segment.start : deltas.offsets[k] + segment.stop]
        encoding, payload, changed, sampled = kernels.DENSE, None, 0, None
        compare = compare and bool(segment.parts)
        sample = sample and not compare and bool(segment.parts)
        if compare or sample:
            ready.synchronize()  # the pack is done: its bytes are read here
        began = time.perf_counter()
        if compare or sample:
            new = data if compare else data[: min(data.numel(), _DeltaPacer.SAMPLE_BYTES) // word * word]
            old = base[: new.numel()]
            old = old if old.device == data.device else old.to(data.device)
            result = kernels.delta_encode(new, old, word)
            if compare:
                encoding, payload, changed = result
            else:  # timed alone: a delta sync's encode also copies, below
                sampled = (new.numel(), time.perf_counter() - began)
            if self.backend.supports_async_streams:  # the encoding ran on the current stream
                self._stream.wait_stream(self.backend.current_stream())
        if data.data_ptr() != base.data_ptr():  # (packed straight into the baseline: nothing to copy)
            self.backend.copy_(base, data, stream=self._stream)  # the baseline becomes this sync's bytes
        if payload is not None:  # into the bucket buffer, where the segment's own bytes were
            out = self.transport.buffer(k)[segment.start : segment.start + payload.numel()]
            self.backend.copy_(out, payload, stream=self._stream)
            data = out
        ready = self._stream.record_event()
        deltas.count(encoding, segment, data.numel(), changed, word, time.perf_counter() - began, compare, sampled)
        return data, encoding, ready

    def _size_buckets(self, specs: list[TensorSpec]) -> None:
        """Derive the bucket size once, and again only if a larger tensor appears, so that
        free-memory noise between syncs does not change the layout."""
        if self.config.bucket_bytes is not None:
            return
        largest = max((s.nbytes for s in specs), default=0)
        if self.bucket_bytes is None or largest > self._sized_for:
            self.bucket_bytes = default_bucket_bytes(self.backend, largest)
            self._sized_for = largest

    def _ensure_staging(self, nbytes: int) -> None:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None  # free the old one before allocating the larger
            self._staging = self.backend.empty_pinned(nbytes)

    def _send_buckets(
        self, plan: BucketPlan, it: Iterator[tuple[str, torch.Tensor]], timer: PhaseTimer, deltas: "_DeltaState | None" = None
    ) -> BaseException | None:
        """Send every segment, or stop at the first one whose source or pack failed, after
        announcing that failure in its place. Returns that failure; a transport failure
        (PeerError) propagates instead: the group can no longer agree on anything."""
        transport, async_streams = self.transport, self.backend.supports_async_streams
        packing = _Packing(plan, it)
        alive: dict[int, list[torch.Tensor]] = {}  # tensors sent from their own memory, until their bucket is sent
        failure: BaseException | None = None
        for bucket in plan.buckets:
            k = bucket.index
            if k >= 2:
                with timer("transfer"):
                    transport.wait_sent(k - 2)
                alive.pop(k - 2, None)
            if async_streams:  # earlier sends (issued on the current stream) read this buffer; sources were made there
                self._stream.wait_stream(self.backend.current_stream())
            keep = alive.setdefault(k, [])
            for j, segment in enumerate(bucket.segments):
                try:
                    gathered = timer.get("gather") or 0.0
                    began = time.perf_counter()
                    compare = deltas is not None and deltas.compare_next()
                    sample = deltas is not None and (k, j) in deltas.samples
                    into_baseline = deltas is not None and not compare and not sample and deltas.into_baseline
                    data, direct = self._pack(packing, bucket, segment, keep, timer, deltas, into_baseline)
                    ready = self._stream.record_event()
                    encoding = kernels.DENSE
                    if deltas is not None:
                        data, encoding, ready = self._encode(deltas, bucket, segment, data, ready, compare, sample)
                        direct = direct and encoding == kernels.DENSE
                    # on synchronous backends the copies happen here, not on the stream
                    timer.add("pack", time.perf_counter() - began - ((timer.get("gather") or 0.0) - gathered))
                    with timer("transfer"):
                        transport.send_segment(k, j, segment.start, data, ready=ready, direct=direct, encoding=encoding)
                except errors.PeerError:
                    raise
                except Exception as exc:  # noqa: BLE001 - announced to every rank, then reported
                    failure = exc
                    with timer("transfer"):
                        transport.send_failure(k, j)
                    break
            if failure is not None:
                break
        with timer("transfer"):
            transport.finish()
        alive.clear()
        return failure

    def _pack(
        self, packing: "_Packing", bucket: Bucket, segment: Segment, keep: list[torch.Tensor], timer: PhaseTimer,
        deltas: "_DeltaState | None" = None, into_baseline: bool = False,
    ) -> tuple[torch.Tensor, bool]:
        """Pack one segment; returns the bytes to send (a range of the bucket buffer, of the
        delta baseline with `into_baseline`, or a tensor's own bytes) and whether they come
        straight from a tensor that sends every range that way."""
        backend, stream = self.backend, self._stream
        buffer = self.transport.buffer(bucket.index)
        target = buffer if self.config.bypass_cpu else self._staging
        if into_baseline:
            target = buffer = self._baseline[deltas.offsets[bucket.index] :][: bucket.nbytes]
        if deltas is not None and len(segment.parts) > 1:
            # the alignment gaps between packed tensors hold whatever the buffer held before
            # (an earlier payload): zero them, or every delta would carry them as changes
            gaps = _gaps(bucket, segment)
            if gaps:
                backend.launch(stream, _zero, target, gaps)
        if len(segment.parts) > 1:
            # Several pieces, so none of them goes straight from its own memory (`_direct`):
            # the whole ones are gathered, then packed by one multi-tensor copy into views of
            # the target cached with the plan; chunks of larger tensors go the way below.
            self._pack_whole(packing, bucket, segment, target, keep, timer)
        for index, lo, hi in segment.parts:
            piece = bucket.pieces[index]
            if piece.is_whole and len(segment.parts) > 1:
                continue  # packed above
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
            ranges = bucket.checksum_ranges()
            baseline = None if deltas is None else self._baseline[deltas.offsets[bucket.index] :][: bucket.nbytes]
            if baseline is None or target.data_ptr() == baseline.data_ptr():
                backend.launch(stream, kernels.checksums_into, sums, target, ranges)
            else:
                # over the bucket's new bytes, which the receiver checks what it rebuilt against:
                # with delta sync the earlier segments' are in the baseline by now (the buffer
                # holds the payloads sent), this segment's only in the target until it is encoded
                fresh = target[segment.start : bucket.checksum_offset]
                backend.launch(stream, kernels.checksums_into, sums, baseline, ranges, fresh, segment.start)
        if not self.config.bypass_cpu:
            backend.copy_(buffer[segment.start : segment.stop], target[segment.start : segment.stop], stream=stream)
        return buffer[segment.start : segment.stop], False

    def _pack_whole(self, packing: "_Packing", bucket: Bucket, segment: Segment, target: torch.Tensor, keep: list[torch.Tensor], timer: PhaseTimer) -> None:
        """Gather the whole pieces of a segment and pack them with one multi-tensor copy:
        one stream wait and one launch per segment, whatever its tensor count."""
        views = self._views.of(packing.plan, target, bucket)
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        pieces, next_tensor, clock = bucket.pieces, packing.next_tensor, time.perf_counter
        began = clock()
        for index, _, hi in segment.parts:
            piece = pieces[index]
            if piece.is_whole:
                tensor = next_tensor(piece.spec)
                if hi:
                    dsts.append(views[index])
                    srcs.append(tensor)
        timer.add("gather", clock() - began)
        keep.extend(srcs)
        if self.backend.supports_async_streams:  # a gather (e.g. full_tensor) may still be running
            self._stream.wait_stream(self.backend.current_stream())
        self.backend.copy_many_(dsts, srcs, stream=self._stream)

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


class _Packing:
    """The source's iterator and the tensor being packed, for one sync."""

    def __init__(self, plan: BucketPlan, it: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.plan = plan
        self.it = it
        self.tensor: torch.Tensor | None = None
        self.direct = False

    def next_tensor(self, spec: TensorSpec) -> torch.Tensor:
        try:
            name, tensor = next(self.it)
        except StopIteration:
            raise errors.SpecMismatchError(f"source ended before parameter {spec.name!r} that its metadata() declared") from None
        if name != spec.name:
            raise errors.SpecMismatchError(f"source yielded {name!r} where its metadata() declared {spec.name!r}; iteration must follow metadata order")
        if not isinstance(tensor, torch.Tensor):
            raise errors.SpecMismatchError(f"parameter {name!r}: the source yielded a {type(tensor).__name__}, not a tensor")
        if tuple(tensor.shape) != spec.shape:
            raise errors.SpecMismatchError(f"parameter {name!r}: metadata() declared shape {spec.shape}, iteration yielded {tuple(tensor.shape)}")
        return tensor

    def start(self, spec: TensorSpec, tensor: torch.Tensor, direct: bool, in_ranges: bool, backend: Backend, stream: Any) -> None:
        """Take `tensor` as the one being packed, in the form its ranges are cut from: a
        tensor sent in several ranges is cast and laid out once, then cut in wire bytes."""
        self.direct = direct
        if in_ranges and not direct and (tensor.dtype != spec.dtype or not tensor.is_contiguous()):
            wire = backend.empty(tuple(tensor.shape), spec.dtype)
            backend.copy_(wire, tensor, stream=stream)
            tensor = wire
        self.tensor = tensor


def _gaps(bucket: Bucket, segment: Segment) -> list[tuple[int, int]]:
    """The byte ranges of a segment that belong to no piece (alignment padding)."""
    gaps, at = [], segment.start
    for index, lo, hi in segment.parts:
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


class _DeltaPacer:
    """`DeltaConfig.choose == "time"`: whether delta syncs pay for their time, from the
    sender's own measurements (docs/delta.md, "Choosing by time"), in seconds per byte of
    the segments. A whole sync's time ends with its receivers' statuses, so it includes
    their apply; the encode's comes from the last delta sync or from samples: a whole sync
    before a decision encodes the start of a few segments only to time it."""

    FIRST_PAUSE = 2
    LONGEST_PAUSE = 64
    WHOLE_KEPT = 4
    SAMPLE_SEGMENTS = 4
    SAMPLE_BYTES = 4 << 20

    def __init__(self) -> None:
        self.whole: deque[float] = deque(maxlen=self.WHOLE_KEPT)  # recent whole syncs that allocated nothing
        self.encode_rate: float | None = None
        # what a delta sync cost beyond its encode (pack, wire, the receivers' apply), from
        # the last complete one: the samples time the encode alone
        self.delta_rest = 0.0
        self.pause_next = self.FIRST_PAUSE
        self.pausing = 0  # whole syncs left before the next decision

    def whole_s_per_byte(self) -> float | None:
        """The fastest recent whole sync: the minimum, so that noise makes deltas look worse, not better."""
        return min(self.whole) if self.whole else None

    def choose(self) -> tuple[str, bool]:
        """For a sync that could carry deltas: "delta" or "paused", and whether it samples
        (the last sync of a pause does, for the decision after it)."""
        if self.pausing:
            self.pausing -= 1
            return "paused", self.pausing == 0
        best = self.whole_s_per_byte()
        if best is None or self.encode_rate is None:
            return "paused", True  # nothing to judge by yet: measure both
        if self.encode_rate + self.delta_rest > best:  # a delta sync would cost more than a whole one
            self._lost()
            return self.choose()
        return "delta", False

    def _lost(self) -> None:
        self.pausing = self.pause_next  # twice as long each time in a row
        self.pause_next = min(2 * self.pause_next, self.LONGEST_PAUSE)

    def record(self, choice: str, seconds: float, nbytes: int, *, warm: bool, encode_rate: float | None) -> None:
        if encode_rate is not None:
            self.encode_rate = encode_rate
        if not nbytes:
            return
        rate = seconds / nbytes
        best = self.whole_s_per_byte()
        if choice in ("anchor", "paused"):
            if warm:  # (a sync that allocated the baseline or built a plan is slower than the next)
                self.whole.append(rate)
        else:
            if choice == "delta" and encode_rate is not None:
                self.delta_rest = max(0.0, rate - encode_rate)
            if choice == "stopped" or (best is not None and rate > best):
                self._lost()
            else:
                self.pause_next = self.FIRST_PAUSE


class _DeltaState:
    """One delta-enabled sync on the sender: whether it may send deltas, and what it did."""

    MIN_COMPARED = 2
    """Segments compared before the encode's cost is judged (the first one pays warm-up)."""

    def __init__(self, plan: BucketPlan, active: bool, choice: str, budget: float | None, into_baseline: bool, sample: bool) -> None:
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
            spots = [(b.index, j) for b in plan.buckets for j, seg in enumerate(b.segments) if seg.parts]
            n, m = len(spots), _DeltaPacer.SAMPLE_SEGMENTS
            self.samples = set(spots) if n <= m else {spots[round(i * (n - 1) / (m - 1))] for i in range(m)}

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

    def metrics(self, baseline_bytes: int) -> dict[str, Any]:
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
            "baseline_bytes": baseline_bytes,
        }
