"""The receiving side of a weight sync from one sender: `Receiver`, and `IncomingSync`,
the one place a receive is checked, delivered and concluded (a receiver of several
senders, hal.sync.receive.sharded, runs one per sender).

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
from hal.backends.interface import Backend
from hal.sync import errors
from hal.sync.wire.auth import check_auth
from hal.sync.receive.delivery import Delivery, Destinations, Kept, destination_problem
from hal.sync.delta import DeltaReceiver, agree_or_go_whole, scatter_key
from hal.sync.errors import RankReport
from hal.sync.wire.header import SyncHeader
from hal.sync.metrics import PhaseTimer, SyncMetrics
from hal.sync.plan.buckets import BucketPlan, PlanCache
from hal.sync.spec import TensorSpec
from hal.sync.sink import Sink, SinkPolicy, as_sink
from hal.sync.plan.steady import KnownDestinations
from hal.sync.transport.base import Transport

class Receiver:
    """Receives syncs into a `Sink` (or an `apply(pairs)` callable), accepting only
    tensors described by `specs`, or, with `specs=None`, whatever tensors the sender's
    header declares (a rollout side without a model of its own; the header is still
    decoded and checked, and the sink's destinations must fit it).

    A sync may carry any subset of `specs` (a LoRA sync sends only adapters).
    `timeout_s` bounds every wait for the sender or the other receivers. `token`, when
    set, must be proven by the sender in every header (see `hal.sync.wire.auth.check_auth`).
    `validate(specs)` may refuse, before anything is applied, a sync by the list of
    tensors it carries (e.g. "whole layers only"): raise `SpecMismatchError`.

    `version` is the weight version this side holds, set after a sync that every rank
    completed, never after a failed one; `consistent` is False while the weights mix two
    versions (a failed sync applied part of itself); `torn` names tensors whose bytes may
    be neither old nor new (a connection broke in the middle of an in-place transfer);
    `abort_error` says why the sink's `abort()` failed after the last failed sync (the
    sync's own error is the one raised). A `SyncReceiver` (hal.sync.endpoints).
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
        self.abort_error: str | None = None
        self.plans = PlanCache()
        self._accepted: tuple[TensorSpec, ...] | None = None  # the last spec tuple `destinations_for` passed
        self.known = KnownDestinations()
        """The sink's destinations checked last sync, kept while the sink says they are unchanged."""
        self.kept = Kept(self.backend)
        """What delivering syncs keeps across them (hal.sync.receive.delivery)."""
        self.delta = DeltaReceiver(self.backend)
        """What delta syncs land on, kept across syncs (hal.sync.delta)."""

    @property
    def reassembly_bytes(self) -> int:
        """Memory held across syncs for tensors that arrive in chunks (0 when none do)."""
        return self.kept.reassembly_bytes

    # ---- what a sync needs of this receiver -----------------------------------------------
    def destinations_for(
        self, specs: tuple[TensorSpec, ...], sink: Sink, policy: SinkPolicy, exact_for: frozenset[str] | None
    ) -> Destinations:
        """Refuse specs this receiver does not accept, or that the sink's destinations do not
        fit (`SpecMismatchError`); returns the sink's destinations for a sync of `specs`, asked
        once each, and which of those named in `exact_for` (None: all) may be written in place.
        What was checked last sync is kept while the sink says its destinations are unchanged
        (hal.sync.plan.steady)."""
        device = self.backend.device()
        in_place = policy.in_place and (exact_for is None or bool(exact_for))
        # what a kept check depends on: the same objects (the header's tuple, the plan's set;
        # the sink, when its generation is what says it is unchanged), and equal values (what
        # the sink declares, this device). A mapped sink's tensors are compared instead of
        # the sink: `copy_into(weights)` may be made anew each sync over the same weights.
        mode = policy.destinations
        same = (specs, exact_for, in_place, sink if mode == "generation" else None)
        equal = (mode, policy.generation if mode == "generation" else 0, device)
        kept = self.known.recall(same, equal, sink)
        if kept is not None:
            return kept
        self.known.forget()
        problems: list[str] = []
        # checked against `self.specs` already (the same tuple), or nothing to check against
        known = specs is self._accepted or self.specs is None
        every: dict[str, torch.Tensor] = {}
        exact: dict[str, torch.Tensor] = {}
        objects = [None] * len(specs) if mode == "none" else [sink.destination(spec.name) for spec in specs]
        for spec, dest in zip(specs, objects):
            if not known:
                expected = self.specs.get(spec.name)
                if expected is None:
                    problems.append(f"parameter {spec.name!r}: not a parameter this receiver accepts")
                    continue
                if expected.shape != spec.shape:
                    problems.append(f"parameter {spec.name!r}: expected shape {expected.shape}, got {spec.shape}")
                    continue
                if expected.dtype != spec.dtype:
                    problems.append(f"parameter {spec.name!r}: expected dtype {expected.dtype}, got {spec.dtype}")
                    continue
            if dest is None:
                continue
            problem = destination_problem(spec, dest)
            if problem is not None:
                problems.append(problem)
                continue
            every[spec.name] = dest
            # only a destination matching the wire spec exactly (dtype, contiguous, on the
            # buffers' device) may be written in place
            if in_place and (exact_for is None or spec.name in exact_for) and dest.dtype is spec.dtype and dest.is_contiguous() and dest.device == device:
                exact[spec.name] = dest
        errors.refuse_specs(problems)
        self._accepted = specs
        checked = Destinations(every, exact, objects)
        if mode != "ask":
            self.known.remember(same, equal, checked, [spec.name for spec in specs], objects)
        return checked

    # ---- one sync ---------------------------------------------------------------------
    def receive(self, sink: Any) -> SyncMetrics:
        """Take one sync into `sink` (a `Sink`, or a callable `apply(pairs)`); see the class doc."""
        with self.transport.bounded(self.timeout_s):
            incoming = IncomingSync(self, as_sink(sink))
            incoming.agree_header(incoming.check())
            incoming.deliver()
            return incoming.conclude()

    def completed(self, header: SyncHeader, plan: BucketPlan, kept_in: Any) -> None:
        """A sync every rank completed (`header`, laid out by `plan`) landed: this side holds
        its version, whole (consistent, nothing torn), and keeps what a delta lands on next
        (`kept_in`: where this sync's delta landed, hal.sync.delta.scatter_key)."""
        self.version = header.version
        self.consistent = True
        self.torn = ()
        self.delta.completed(header, plan, kept_in)

    def failed(self, *, touched: bool, torn: Iterable[str] | None, abort: Callable[[], None]) -> None:
        """A sync every rank agreed failed (or whose group broke) ended: what a delta would
        land on is dropped, the weights mix two versions if the sync `touched` them, `torn`
        (when given: a broken group) names tensors whose bytes may be neither old nor new, and
        the sink is told (`abort`, whose own failure is kept in `abort_error`)."""
        self.delta.lost()
        if touched:
            self.consistent = False
        if torn is not None:
            self.torn = tuple(sorted(torn))
        try:
            abort()
            self.abort_error = None
        except Exception as exc:  # noqa: BLE001 - the sync's own error is the one to raise
            self.abort_error = f"{type(exc).__name__}: {exc}"

    @property
    def baseline_bytes(self) -> int:
        """Memory held for delta syncs: an image of the last complete sync when the sink has
        no exact destinations, else one bucket to patch what is not a whole tensor in place
        (0 without delta)."""
        return self.delta.baseline_bytes

    def close(self) -> None:
        """Free the transport's buffers (the group is its owner's)."""
        self.transport.close()


class IncomingSync:
    """One sync on the receiving side, in its phases: `check` the header (this rank's
    verdict), `agree_header` (every rank's), `deliver` the segments into the sink, and
    `conclude` (every rank's outcome; the version). `Receiver.receive` runs them in
    order; a receiver of several senders at once (hal.sync.receive.sharded) interleaves
    the phases of one `IncomingSync` per sender and ends each with `settle`, the one place
    a receive's outcome lands on its receiver. Used once."""

    def __init__(self, receiver: Receiver, sink: Sink) -> None:
        self.receiver = receiver
        self.sink = sink
        self.policy: SinkPolicy = sink.policy
        """The sink's policy as it was when this sync started."""
        self.start, self.host_start = time.perf_counter(), time.thread_time()
        self.timer = PhaseTimer()
        self.builds = receiver.plans.builds
        self.header: SyncHeader | None = None
        self.plan: BucketPlan | None = None
        self.destinations: Destinations | None = None
        self.delivery: Delivery | None = None
        self._kept_in: Any = None  # where a delta of this sync lands (hal.sync.delta.scatter_key)
        self.where = "sync"
        self.lost: BaseException | None = None
        """Why `deliver` ended early (a broken group: `PeerError`), or None."""

    @property
    def channel(self) -> Any:
        return self.receiver.transport.channel

    def check(self) -> RankReport:
        """Draw the challenge, take the sender's header and check it; this rank's verdict."""
        receiver, channel = self.receiver, self.channel
        receiver.known.precheck(self.sink, self.policy)  # while the sender reads its source
        try:
            challenge = channel.challenge()
        except errors.AuthError as exc:  # forged by a member: still take the header, to stay in step
            channel.exchange_header(None)
            return errors.report_exception(exc, sender=False)
        payload = channel.exchange_header(None)
        self.header, self.plan, self.destinations, report = self._check_header(payload, challenge)
        self.where = f"sync of version {self.header.version}" if self.header is not None else "sync"
        return report

    def _check_header(self, payload: bytes, challenge: str) -> tuple[SyncHeader | None, BucketPlan | None, Destinations | None, RankReport]:
        """(the header, decoded or None; the plan and the sink's destinations, or None if
        refused; this rank's verdict)."""
        receiver, sink, policy = self.receiver, self.sink, self.policy
        header: SyncHeader | None = None
        try:
            header = SyncHeader.decode(payload)
            check_auth(header, receiver.token, challenge)
            if receiver.version is not None and header.version < receiver.version:
                raise errors.StaleVersionError(f"receiver holds weight version {receiver.version}; refusing older version {header.version}")
            try:
                plan = receiver.plans.get(header.specs, header.bucket_bytes, header.verify, header.segment_bytes)
            except ValueError as exc:
                raise errors.HeaderError(f"header describes no valid bucket layout: {exc}") from None
            # in place: only tensors that travel alone, or back to back in a tight segment, can
            # land there; a delta may patch any
            destinations = receiver.destinations_for(header.specs, sink, policy, None if header.delta else plan.in_place_tensors)
            if receiver.validate is not None:
                receiver.validate(list(header.specs))
            if plan.digest != header.digest:
                raise errors.SpecMismatchError(
                    f"bucket layout differs from the sender's ({plan.digest} vs {header.digest}): mismatched verl-hal versions?"
                )
            if header.delta_base is not None:
                receiver.delta.check_base(header.delta_base, plan, scatter_key(plan, sink, receiver.backend.device()), receiver.consistent)
        except errors.SyncError as exc:
            return header, None, None, errors.report_exception(exc, sender=False)
        return header, plan, destinations, RankReport()

    def agree_header(self, report: RankReport, shared: RankReport | None = None) -> None:
        """Every rank's verdict on the header (this rank's: `report`); raises the `SyncError`
        every rank raises. A delta refused only for its base comes again whole at once: that
        header is checked (`shared`, when given, is this rank's verdict on it unless the
        header itself is refused: a receiver of several senders judges them together) and
        agreed on in its place."""
        channel, verdict = self.channel, [report]

        def agree() -> None:
            errors.raise_if_any(channel.agree(verdict[0], "header check"), channel.rank, self.where)

        def go_whole() -> None:
            again = self.check()
            verdict[0] = shared if again.error is None and shared is not None else again

        agree_or_go_whole(agree, lambda: self.header is not None and self.header.delta_base is not None, go_whole)
        if self.header is None or self.plan is None or self.destinations is None:  # every rank agreed there was no error
            raise errors.SyncError(f"rank {channel.rank}: the header check passed on every rank but this one kept no plan")

    def deliver(self) -> None:
        """Receive every segment into the sink. A group that broke (`PeerError`) or any other
        failure ends it early and is kept in `lost`: `conclude` (or the caller's `settle`)
        tells the sink (`Sink.abort`) and the receiver."""
        receiver, plan = self.receiver, self.plan
        try:
            receiver.transport.prepare(receiver.backend, plan)
            self._kept_in = scatter_key(plan, self.sink, receiver.backend.device()) if self.header.delta else None
            delivery = self.delivery = Delivery(receiver.kept, receiver.transport, plan, self.sink, self.policy, self.destinations, self.timer)
            delivery.applier = receiver.delta.begin(self.header, plan, self._kept_in, delivery)
            delivery.run()
        except Exception as exc:  # noqa: BLE001 - concluded by `conclude` / `settle`
            self.lost = exc

    @property
    def touched(self) -> bool:
        """Whether this receive wrote a destination or handed its sink a tensor."""
        return self.delivery is not None and self.delivery.touched

    @property
    def sender_failed(self) -> bool:
        """The sender announced that its source or a pack failed (it says why at the agreement)."""
        return self.delivery is not None and self.delivery.sender_failed

    def report(self) -> RankReport:
        """This rank's word on how the delivery went (an error that ended it early first)."""
        if self.lost is not None:
            return errors.report_exception(self.lost, sender=False, inconsistent=self.touched)
        return self.delivery.report() if self.delivery is not None else RankReport()

    def agree_outcome(self, report: RankReport, what: str = "sync status", *, bound_s: float | None = None) -> list[RankReport]:
        """One agreement on how the sync ended, in this sender's group: every rank's report
        (`bound_s`: a wait longer than the receive's own, for a receiver of several senders)."""
        channel = self.channel
        if bound_s is None:
            return channel.agree(report, what)
        with channel.bounded(bound_s):
            return channel.agree(report, what)

    def conclude(self) -> SyncMetrics:
        """Every rank's outcome: the version advances only if every rank completed;
        otherwise raises the `SyncError` every rank raises (a broken group: this rank's
        `PeerError`, since nobody can agree any more)."""
        if isinstance(self.lost, errors.PeerError):
            self.settle(self.lost, touched=self.touched)
            raise self.lost
        try:
            errors.raise_if_any(self.agree_outcome(self.report()), self.channel.rank, self.where)
        except errors.SyncError as exc:
            self.settle(exc, touched=self.touched)
            raise
        self.settle(None, touched=self.touched)
        return self.metrics()

    def settle(self, error: BaseException | None, *, touched: bool) -> None:
        """The outcome every rank agreed on (`error`, None when every rank completed) lands on
        the receiver: a complete sync sets its version, makes it consistent and untorn, and
        keeps what a delta lands on next (`Receiver.completed`); a failed one drops that,
        marks the receiver inconsistent if this sync `touched` its weights, names what a
        broken group tore (`Receiver.torn`), and tells the sink (`Receiver.failed`: `abort`,
        whose own failure is recorded in `Receiver.abort_error`)."""
        if error is None:
            self.receiver.completed(self.header, self.plan, self._kept_in)
            return
        torn = self.delivery.landing if isinstance(error, errors.PeerError) and self.delivery is not None else None
        self.receiver.failed(touched=touched, torn=torn, abort=self.sink.abort)

    def metrics(self) -> SyncMetrics:
        receiver, plan, header = self.receiver, self.plan, self.header
        return SyncMetrics(
            version=header.version,
            bytes=plan.total_bytes,
            buckets=len(plan.buckets),
            tensors=len(plan.specs),
            transfer_s=self.timer.get("transfer"),
            apply_s=self.timer.get("apply"),
            total_s=time.perf_counter() - self.start,
            host_s=time.thread_time() - self.host_start,
            plan_reused=receiver.plans.builds == self.builds,
        )
