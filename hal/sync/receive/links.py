"""An engine worker receives only its own pieces, from every trainer rank at once, and lands
them in its layers (issue 41; the trainer side: hal.sync.send.links).

Each trainer rank's sync group is as today's (`{r} ∪ workers`): per group this worker runs a
core `Receiver` over its own link (`PeerTransport(group, src=0)`), whose sync's tensors are
the pieces the plan sends it from that rank, landed by a `LandingSink`
(hal.sync.receive.landing):

    receiver = LinkReceiver([PeerTransport(g, src=0) for g in sync_groups])
    sink = LandingSink(needs, engine_layers)      # this worker's recorded needs
    metrics = receiver.receive(sink)              # metrics.bytes == plan.bytes_in[w]

One sync, as `ShardedReceiver` runs it: take and check every trainer rank's header (the
token over each group's challenge, the version, and the pieces it announces: that all the
links together bring this worker exactly its needs, `links_from_headers`; or, given the
M x N plan, exactly the link the plan says, piece for piece), answer in every group with
the verdict on all of them; receive the M links in M threads while this thread opens and closes the
engine's layers; two agreements per group end it, so that every rank raises the same
error class and the version advances only when every link completed on every rank.
"""

from __future__ import annotations

import contextlib
import operator
import time
from typing import Sequence

from hal.backends.interface import Backend
from hal.sync import errors
from hal.sync.errors import RankReport
from hal.sync.metrics import SyncMetrics
from hal.sync.plan.link_specs import LinkSpecs, link_specs, links_from_headers
from hal.sync.plan.mxn import MxNPlan
from hal.sync.receive.landing import Landing, LandingSink
from hal.sync.receive.every_sender import FromEverySender, unwrapped
from hal.sync.receive.receiver import IncomingSync
from hal.sync.spec import TensorSpec
from hal.sync.transport.peer import PeerTransport

__all__ = ["LinkReceiver"]


class LinkReceiver(FromEverySender):
    """An engine worker receiving its own pieces from every trainer rank (see the module doc).

    `transports`: one link per trainer rank, in trainer-rank order (`PeerTransport(group,
    src=0)` of each rank's group). `timeout_s`, `token` as for `Receiver`. A `SyncReceiver`
    (hal.sync.endpoints): `version`, `consistent`, `torn` and `abort_error` are its
    per-sender receivers' together."""

    def __init__(
        self,
        transports: Sequence[PeerTransport],
        *,
        timeout_s: float = 60.0,
        token: str | None = None,
        backend: Backend | None = None,
        version: int | None = None,
    ) -> None:
        if any(not isinstance(t, PeerTransport) for t in transports):
            raise TypeError("LinkReceiver: every transport must be a PeerTransport (this worker's link in a trainer rank's group)")
        super().__init__(transports, timeout_s=timeout_s, token=token, backend=backend, version=version)
        self._kept: tuple[MxNPlan | None, int, list[LinkSpecs]] = (None, -1, [])
        self._read: tuple[tuple, object, list[LinkSpecs]] | None = None  # the last headers' specs, needs, links

    def _links(self, plan: MxNPlan, worker: int) -> list[LinkSpecs]:
        """This worker's link from every trainer rank (once per plan)."""
        if self._kept[0] is not plan or self._kept[1] != worker:
            self._kept = (plan, worker, [link_specs(plan, r, worker) for r in range(len(plan.links))])
        return self._kept[2]

    def receive(self, sink: LandingSink, plan: MxNPlan | None = None) -> SyncMetrics:
        """Take one sync into `sink` (this worker's needs and its engine's layers); the same
        call on every worker, `LinkSender.send` on every trainer rank. Without `plan` the
        links are read from the headers and checked to bring exactly the sink's needs
        (`links_from_headers`); with it (every rank built the same), each header must
        announce the plan's link. Raises the `SyncError` every rank raises."""
        w = sink.worker
        links: list[LinkSpecs] | None = None
        if plan is not None:
            if not 0 <= w < len(plan.needs) or plan.needs[w].digest != sink.needs.digest:
                raise ValueError(f"LinkReceiver: the sink's needs (engine worker {w}) are not that worker's needs in the plan")
            if len(plan.links) != self.sender_count:
                raise ValueError(f"LinkReceiver: the plan has {len(plan.links)} trainer ranks, this worker has {self.sender_count} links")
            links = self._links(plan, w)
        start, host_start = time.perf_counter(), time.thread_time()
        with contextlib.ExitStack() as stack:
            for receiver in self.per_sender:
                stack.enter_context(receiver.transport.bounded(self.timeout_s))
            landing = sink.landing(links or [None] * self.sender_count, self.timeout_s)
            incoming = [IncomingSync(receiver, landing.part(m)) for m, receiver in enumerate(self.per_sender)]
            live = set(range(self.sender_count))  # the groups still in the sync (header agreed, none broken)
            failure, links = self._headers(incoming, links, sink, live)
            if failure is None:
                landing.use_links(links)
                landing.begin()
            else:
                landing.stop()
            self._deliver_all(incoming, landing, live)
            report = self._outcome(failure, incoming, landing)
            version, error = self._conclude(incoming, live, report)
            for inc in incoming:  # each part's outcome; the first part's abort reaches the engine
                inc.settle(error, touched=landing.touched)
            if error is not None:
                raise error
        return SyncMetrics(
            version=version,
            bytes=sum(i.plan.total_bytes for i in incoming),
            buckets=sum(len(i.plan.buckets) for i in incoming),
            tensors=sum(len(i.plan.specs) for i in incoming),
            transfer_s=max((i.timer.get("transfer") or 0.0) for i in incoming),
            apply_s=landing.apply_s,
            total_s=time.perf_counter() - start,
            host_s=time.thread_time() - host_start,
            senders=self.sender_count,
            model_bytes=plan.model_bytes if plan is not None else sum(s.nbytes for s in sink.needs.specs),
            links=self.sender_count,
            largest_link_bytes=max(i.plan.total_bytes for i in incoming),
            layers=len(landing.closed),
        )

    # ---- the phases ---------------------------------------------------------------------
    def _headers(
        self, incoming: list[IncomingSync], links: list[LinkSpecs] | None, sink: LandingSink, live: set[int]
    ) -> tuple[errors.SyncError | None, list[LinkSpecs] | None]:
        """Take and check every trainer rank's header, then agree in every group on all of
        them; the failure, if any, and this worker's links (the plan's, or the headers')."""
        reports: list[RankReport] = []
        for m, inc in enumerate(incoming):
            try:
                reports.append(inc.check())
            except errors.PeerError as exc:
                live.discard(m)
                reports.append(errors.report_exception(exc, sender=False))
        shared = next((r for r in reports if r.error), None)
        if shared is None and links is not None:
            problems = [p for inc, link in zip(incoming, links) if (p := _link_problem(inc.header.specs, link)) is not None]
            if problems:
                shared = errors.report_exception(errors.SpecMismatchError("; ".join(problems[: errors.MAX_REPORTED])), sender=False)
        elif shared is None:
            try:
                links = self._read_links(tuple(inc.header.specs for inc in incoming), sink)
            except errors.SpecMismatchError as exc:
                shared = errors.report_exception(exc, sender=False)
        failure: errors.SyncError | None = None
        for m in sorted(live):
            inc, report = incoming[m], reports[m] if reports[m].error else (shared or reports[m])
            try:
                inc.agree_header(report)
            except errors.SyncError as exc:
                live.discard(m)  # its sender stops after the header: nothing more happens in that group
                failure = failure or unwrapped(exc)
        if failure is None and len(live) < self.sender_count:
            failure = errors.PeerError(f"trainer rank(s) {sorted(set(range(self.sender_count)) - live)} did not send a header")
        return failure, links

    def _read_links(self, headers: tuple[tuple[TensorSpec, ...], ...], sink: LandingSink) -> list[LinkSpecs]:
        """`links_from_headers`, once per layout: while nothing changed, the headers' decoded
        spec tuples are the same objects as in the last sync (the core's header cache)."""
        kept = self._read
        if kept is None or kept[1] is not sink.needs or len(kept[0]) != len(headers) or not all(map(operator.is_, kept[0], headers)):
            self._read = None
            kept = self._read = (headers, sink.needs, links_from_headers(sink.needs, headers))
        return kept[2]

    def _outcome(self, failure: errors.SyncError | None, incoming: list[IncomingSync], landing: Landing) -> RankReport:
        """This worker's word on the whole sync: the first thing that went wrong, if any;
        when nothing did, the engine finishes the landing first."""
        problem = self._first_problem(failure, incoming, landing)
        if problem is not None:
            return problem
        touched = landing.touched
        left = landing.leftover()
        if left:
            return RankReport(error=f"layers {left[: errors.MAX_REPORTED]} never got all their pieces", kind="peer", inconsistent=touched)
        try:
            landing.finish()
        except Exception as exc:  # noqa: BLE001 - reported at the agreement
            return errors.report_exception(exc, sender=False, inconsistent=landing.touched)
        return RankReport(inconsistent=touched)


def _link_problem(got: tuple[TensorSpec, ...], link: LinkSpecs) -> str | None:
    """What differs between the pieces a header announces and those of this worker's plan."""
    want = link.specs
    if got == want:
        return None
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    said = f"{got[at].name} {got[at].shape} {got[at].dtype}" if at < len(got) else "nothing more"
    planned = f"{want[at].name} {want[at].shape} {want[at].dtype}" if at < len(want) else "nothing more"
    return (
        f"trainer rank {link.sender}'s link to engine worker {link.worker} announces {len(got)} pieces, this worker's plan "
        f"{len(want)}; piece {at}: {said} where the plan has {planned} (the two sides built different plans)"
    )
