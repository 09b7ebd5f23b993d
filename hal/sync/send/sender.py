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

import operator
import time
from typing import Any, Iterator

import torch

import hal
from hal import kernels
from hal.backends.interface import Backend
from hal.sync import errors
from hal.sync.config import ONE, SyncConfig, default_bucket_bytes, wire_dtype_for
from hal.sync.delta import NO_DELTA, DeltaSender, agree_or_go_whole
from hal.sync.wire.header import SyncHeader
from hal.sync.metrics import PhaseTimer, SyncMetrics
from hal.sync.send.packing import ListedCursor, SegmentPacker, SourceCursor
from hal.sync.plan.buckets import BucketPlan, PlanCache
from hal.sync.spec import TensorSpec
from hal.sync.source import ListedSource, as_source
from hal.sync.plan.steady import KnownSource
from hal.sync.transport.base import Transport


_nbytes = operator.attrgetter("nbytes")


class Sender:
    """Sends a source's tensors to every receiver of `transport`.

    `config` is used as given. `token`, when the engines were started with one, proves
    to them that this trainer may push weights (it never travels itself). Reused across
    syncs: it keeps the bucket layout (while metadata is unchanged), the pack stream, the
    pinned staging buffer and, with delta sync, the baseline the next delta is computed
    against (`delta`); nothing of one sync's data otherwise.
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
        # None until the first sync when derived from free memory (it depends on the largest tensor)
        self.bucket_bytes: int | None = self.config.bucket_bytes
        self.plans = PlanCache()
        self.version: int | None = None
        self.packer = SegmentPacker(transport, self.config, self.backend)
        """Packs each segment (hal.sync.send.packing): the pack stream, views and staging buffer."""
        self._sized_for = 0
        self._sized_specs: list[TensorSpec] | None = None  # the specs list last sized from (a steady sync hands back the same one)
        self.sender_count = 1
        """How many senders send into the same receivers at once (hal.sync.send.sharded sets it):
        buckets sized from free memory take that share of it."""
        self._last_wire: tuple[list[TensorSpec], list[TensorSpec]] = ([], [])  # (metadata, its wire specs) of the last sync
        self.known = KnownSource()
        """The source's last listing and its specs (hal.sync.plan.steady): a sync of the same
        tensors makes no spec and reads no iterator."""
        self.delta = DeltaSender(self.config.delta, self.backend) if self.config.delta is not None else None
        """Delta sync's state across syncs (hal.sync.delta), or None without delta."""

    @property
    def anchors_after_refusal(self) -> int:
        """Delta syncs some receiver refused (it did not hold the base) and that went whole."""
        return 0 if self.delta is None else self.delta.anchors_after_refusal

    @property
    def baseline_bytes(self) -> int:
        """Memory held for delta syncs: the bytes of the last complete sync (0 without delta)."""
        return 0 if self.delta is None else self.delta.baseline_bytes

    def _wire_specs(self, metadata: list[TensorSpec]) -> list[TensorSpec]:
        wire = self.config.wire_dtype
        if wire is None:
            return metadata
        last_metadata, last_wire = self._last_wire
        if metadata is last_metadata or (len(metadata) == len(last_metadata) and all(map(operator.is_, metadata, last_metadata))):
            return last_wire  # the same specs as last time: the same wire specs (and plan)
        specs = [s if (d := wire_dtype_for(s.dtype, wire)) is s.dtype else TensorSpec(s.name, s.shape, d) for s in metadata]
        self._last_wire = (metadata, specs)
        return specs

    def send(self, source: Any, *, version: int) -> SyncMetrics:
        """Send every tensor of `source` as weight version `version`; returns this sync's metrics.

        Raises a `SyncError` subclass (on this and every receiving rank) if any rank
        rejected the header, failed, or did not answer in time; `SourceError` when this
        side's source or a pack failed. The error's `reports` say which receivers were left
        holding part of the sync (`inconsistent_ranks`).
        """
        metrics = self.offer(source, version=version).send()
        metrics.sending = ONE
        return metrics

    def offer(self, source: Any, *, version: int) -> "OutgoingSync":
        """The first phase of `send`: announce `source` as `version` and learn every
        receiver's verdict on the header, before any tensor is gathered. Raises the
        `SyncError` every rank raises when some receiver refused; otherwise the sync is
        under way and its caller either sends it (`OutgoingSync.send`) or cancels it
        (`OutgoingSync.cancel`): the receivers wait for one or the other. `TrainerSync`
        tells the other trainer ranks between the two whether to gather."""
        errors.check_version(version)
        outgoing = OutgoingSync(self, as_source(source), version)
        outgoing.offer()
        return outgoing

    def plan_for(self, source: Any) -> tuple[BucketPlan, bool]:
        """The bucket plan a sync of `source` sends by, and whether that sync may read its
        tensors from the source's listing (decided by `known.settle()` before the first
        pack). What it is made from is kept across syncs: the source's specs while it lists
        the same tensors (hal.sync.plan.steady), their wire specs, the bucket size, the plan."""
        metadata, listed = self._metadata(source)
        wire_specs = self._wire_specs(metadata)
        self._size_buckets(wire_specs)
        segment_bytes = self.transport.segment_bytes(self.config.segment_bytes)
        return self.plans.get(wire_specs, self.bucket_bytes, self.config.verify, segment_bytes), listed

    def completed(self, version: int, segments: Any, total_s: float) -> None:
        """A sync every rank agreed completed: this sender holds `version`, and with delta
        sync the next delta is computed against it (`segments`: that sync's delta state)."""
        self.version = version
        if self.delta is not None:
            self.delta.completed(segments, version, total_s)

    def _size_buckets(self, specs: list[TensorSpec]) -> None:
        """Derive the bucket size once, and again only if a larger tensor appears, so that
        free-memory noise between syncs does not change the layout."""
        if self.config.bucket_bytes is not None or specs is self._sized_specs:
            return  # the same list as last sync: the same largest tensor (no step per spec)
        self._sized_specs = specs
        largest = max(map(_nbytes, specs), default=0)
        if self.bucket_bytes is None or largest > self._sized_for:
            self.bucket_bytes = default_bucket_bytes(self.backend, largest, self.sender_count)
            self._sized_for = largest

    def _metadata(self, source: Any) -> tuple[list[TensorSpec], bool]:
        """The source's specs, and whether this sync may read its tensors from its listing
        (decided by `known.settle()` before the first pack): the last sync's specs when the
        source lists the same tensors (hal.sync.plan.steady)."""
        known = self.known
        known.begin(source)  # the steady state is per kind of source
        if not isinstance(source, ListedSource):
            known.forget()
            return list(source.metadata()), False
        listing = source.listing(known.listing)
        metadata = known.recall(listing)
        if metadata is None:
            metadata = list(source.metadata())
            if len(metadata) != len(listing.names) or [s.name for s in metadata] != listing.names:
                known.forget()  # a listing that is not what the source declares is not kept
                return metadata, False
            known.remember(listing, metadata)
        return metadata, True

    # ---- the sending contract (hal.sync.endpoints.SyncSender) ---------------------------------
    def sync(self, source: Any, *, version: int) -> SyncMetrics:
        """`send`, under the verb every sending side shares (`TrainerSync`, `ShardedSender`)."""
        return self.send(source, version=version)

    def close(self) -> None:
        """Free the transport's buffers (the group is its owner's)."""
        self.transport.close()


class OutgoingSync:
    """One sync on the sending side, in its two phases: `offer` (the header and every
    receiver's verdict on it), then `send` (every segment, then the agreement on how the
    sync ended) or `cancel`. Made by `Sender.offer`; used once."""

    def __init__(self, sender: Sender, source: Any, version: int) -> None:
        self.sender = sender
        self.source = source
        self.version = version
        self.where = f"sync of version {version}"
        self.start = time.perf_counter()
        self.host_start = time.thread_time()
        self.timer = PhaseTimer()
        self.plan: BucketPlan | None = None
        self.listed = False  # the source listed its tensors: `known` says whether to read them from there
        self.segments: Any = NO_DELTA
        self._builds = sender.plans.builds
        self._state = "new"
        self.failure: BaseException | None = None
        """Why sending stopped early: the source or a pack failed (announced to every rank)."""
        self.end_bound_s: float | None = None
        """The bound of the final agreement when it may wait longer than one step (a sender
        of several: the receivers first wait for the others' bytes; hal.sync.send.sharded)."""

    def offer(self) -> None:
        with self.sender.transport.bounded(self.sender.config.timeout_s):
            self._offer()

    def _offer(self) -> None:
        sender, transport = self.sender, self.sender.transport
        self.plan, self.listed = sender.plan_for(self.source)
        plan = self.plan
        delta = sender.delta
        offer = [*(delta.base(plan) if delta is not None else (None, None, False))]  # (base, choice, sample)
        channel = transport.channel

        def agree() -> None:
            try:
                challenge, report = channel.challenge(), errors.RankReport(sender=True)
            except errors.AuthError as exc:
                # forged by a member: prove nothing over it, but send the header and agree
                # as ever, so that every rank refuses this sync in step
                challenge, report = None, errors.report_exception(exc, sender=True)
            channel.exchange_header(self._header(challenge, offer[0]).encode())
            sender.known.settle()  # which tensors to read: while the receivers check the header
            errors.raise_if_any(channel.agree(report, "header check"), channel.rank, self.where)

        def go_whole() -> None:
            offer[:] = delta.refused()  # the same sync, whole, at once

        try:
            agree_or_go_whole(agree, lambda: offer[0] is not None, go_whole)
        except errors.SyncError:
            self._state = "done"
            raise
        self._ready(*offer)

    def _header(self, challenge: str | None, base: int | None) -> SyncHeader:
        sender = self.sender
        return SyncHeader.from_plan(
            self.plan, version=self.version, token=sender.token if challenge is not None else None, challenge=challenge,
            delta=sender.delta is not None, delta_base=base,
        )

    def _ready(self, base: Any, choice: Any, sample: Any) -> None:
        """Every rank agreed on the header: the transport and the packer get ready to send."""
        sender, transport, plan, delta = self.sender, self.sender.transport, self.plan, self.sender.delta
        transport.prepare(sender.backend, plan)
        if not sender.config.bypass_cpu:
            sender.packer.ensure_staging(plan.max_bucket_nbytes)
        if delta is not None:
            self.segments = delta.begin(
                plan, base, choice, sample, new_plan=sender.plans.builds != self._builds, bypass_cpu=sender.config.bypass_cpu,
                transport=transport, stream=sender.packer.stream,
            )
        self._state = "offered"

    # ---- phases for a composite that agrees for several syncs at once (hal.sync.send.links) ----
    def announce(self, challenge: str | None) -> SyncHeader:
        """Plan this sync and return its header, proving the token over `challenge` (None:
        no proof); the caller exchanges it and agrees on it for every sync it runs at once,
        then calls `agreed`. Without delta sync (a composite agrees on no delta base)."""
        if self._state != "new" or self.sender.delta is not None:
            raise RuntimeError(f"{self.where}: announce is for a new sync without delta sync (this one is {self._state})")
        self._state = "announced"
        self.plan, self.listed = self.sender.plan_for(self.source)
        return self._header(challenge, None)

    def agreed(self) -> None:
        """Every rank agreed on the header `announce` made: get ready to send (`steps`)."""
        if self._state != "announced":
            raise RuntimeError(f"{self.where}: agreed() follows announce(), this sync is {self._state}")
        self.sender.known.settle()
        self._ready(None, None, False)

    def steps(self) -> Iterator[None]:
        """Send every segment, one per step (a composite interleaves several syncs' segments
        in one thread); the caller bounds the waits. Once exhausted, `failure` says whether
        the source or a pack failed (announced in its place); a transport failure
        (PeerError) propagates. Then `report`, the caller's agreement, and `completed`."""
        self._take()
        yield from self._segments(self._cursor())

    def report(self) -> errors.RankReport:
        """This sender's word at the agreement that ends the sync (after `steps`)."""
        failure = self.failure
        if failure is None:
            return errors.RankReport(sender=True)
        if not isinstance(failure, errors.SyncError):
            failure = self.failure = errors.SourceError(f"{type(failure).__name__}: {failure}")
        return errors.report_exception(failure, sender=True)

    def send(self) -> SyncMetrics:
        """Every segment, then every rank's agreement; this sync's metrics. Raises as `Sender.send`."""
        self._take()
        with self.sender.transport.bounded(self.sender.config.timeout_s):
            for _ in self._segments(self._cursor()):
                pass
            return self._end(self.failure)

    def _cursor(self) -> SourceCursor:
        sender = self.sender
        sender.known.settle()  # (done already unless the header was never agreed on)
        listed = self.listed and sender.known.readable
        return ListedCursor(self.plan, sender.known) if listed else SourceCursor(self.plan, iter(self.source))

    def _segments(self, cursor: SourceCursor) -> Iterator[None]:
        """Send every segment, yielding after each, or stop at the first one whose source or
        pack failed, after announcing that failure in its place (kept in `failure`). A
        transport failure (PeerError) propagates instead: the group can no longer agree on
        anything."""
        sender, plan, timer, segments = self.sender, self.plan, self.timer, self.segments
        transport, async_streams = sender.transport, sender.backend.supports_async_streams
        packer, stream = sender.packer, sender.packer.stream
        alive: dict[int, list[torch.Tensor]] = {}  # tensors sent from their own memory, until their bucket is sent
        failure: BaseException | None = None
        for bucket in plan.buckets:
            k = bucket.index
            if k >= 2:
                with timer("transfer"):
                    transport.wait_sent(k - 2)
                alive.pop(k - 2, None)
            if async_streams:  # earlier sends (issued on the current stream) read this buffer; sources were made there
                stream.wait_stream(sender.backend.current_stream())
            keep = alive.setdefault(k, [])
            for j, segment in enumerate(bucket.segments):
                try:
                    gathered = timer.get("gather") or 0.0
                    began = time.perf_counter()
                    into = segments.pack_target(bucket, j)
                    data, direct = packer.pack(cursor, bucket, segment, keep, timer, segments, into)
                    data, encoding, ready = segments.encode(bucket, j, data, stream.record_event())
                    direct = direct and encoding == kernels.DENSE
                    # on synchronous backends the copies happen here, not on the stream
                    timer.add("pack", time.perf_counter() - began - ((timer.get("gather") or 0.0) - gathered))
                    with timer("transfer"):
                        transport.send_segment(k, j, segment.start, data, ready=ready, direct=direct, encoding=encoding)
                except errors.PeerError:
                    raise
                except Exception as exc:  # noqa: BLE001 - announced to every rank, then reported
                    failure = self.failure = exc
                    with timer("transfer"):
                        transport.send_failure(k, j)
                    break
                yield
            if failure is not None:
                break
        with timer("transfer"):
            transport.finish()
        alive.clear()

    def cancel(self, error: errors.SyncError) -> SyncMetrics:
        """Send nothing: the receivers, waiting for a first segment, hear that none comes,
        and every rank agrees the sync failed with `error`, which is raised."""
        self._take()
        transport = self.sender.transport
        first = next(((b.index, j) for b in self.plan.buckets for j, _ in enumerate(b.segments)), None)
        with transport.bounded(self.sender.config.timeout_s):
            if first is not None:
                transport.send_failure(*first)
            transport.finish()
            return self._end(error)

    def _take(self) -> None:
        if self._state != "offered":
            raise RuntimeError(f"{self.where}: this OutgoingSync is {self._state}, not offered: it is used once")
        self._state = "done"

    def _end(self, failure: BaseException | None) -> SyncMetrics:
        sender, transport = self.sender, self.sender.transport
        self.failure = failure
        report = self.report()
        with transport.bounded(self.end_bound_s or sender.config.timeout_s):
            errors.raise_if_any(transport.channel.agree(report, "sync status"), transport.rank, self.where)
        return self.completed()

    def completed(self) -> SyncMetrics:
        """Every rank agreed the sync completed: the sender holds its version (and, with
        delta sync, its baseline); this sync's metrics."""
        sender, plan, segments, timer = self.sender, self.plan, self.segments, self.timer
        total_s = time.perf_counter() - self.start
        sender.completed(self.version, segments, total_s)
        return SyncMetrics(
            version=self.version,
            bytes=plan.total_bytes,
            buckets=len(plan.buckets),
            tensors=len(plan.specs),
            gather_s=timer.get("gather"),
            pack_s=timer.get("pack"),
            transfer_s=timer.get("transfer"),
            total_s=total_s,
            host_s=time.thread_time() - self.host_start,
            plan_reused=sender.plans.builds == self._builds,
            **segments.metrics(),
        )
