"""What an engine worker receiving from every trainer rank at once does whatever it hands
its engine: one core `Receiver` per trainer rank's group (each checks and concludes that
rank's part of every sync), their state read together as one `SyncReceiver`, one receiving
thread per group, and the agreements that bind the groups. `ShardedReceiver` (whole
tensors, assembled) and `LinkReceiver` (this worker's own pieces, landed) add what they
hand over."""

from __future__ import annotations

import threading
from typing import Any, Sequence

import hal
from hal.backends.interface import Backend
from hal.sync import errors
from hal.sync.config import WaitBounds
from hal.sync.errors import RankReport
from hal.sync.receive.receiver import IncomingSync, Receiver
from hal.sync.transport.base import Transport


class FromEverySender:
    """The per-group receivers and the agreements of a worker that every trainer rank sends to.

    `transports`: one per trainer rank, in trainer-rank order (each that rank's group with
    the engine workers). `timeout_s`, `token` as for `Receiver`. `version`, `consistent`,
    `torn` and `abort_error` are its per-group receivers' together."""

    GROUP = "trainer rank"  # how an agreement's error names the group it came from

    def __init__(
        self,
        transports: Sequence[Transport],
        *,
        timeout_s: float = 60.0,
        token: str | None = None,
        backend: Backend | None = None,
        version: int | None = None,
    ) -> None:
        if not transports:
            raise ValueError(f"{type(self).__name__} needs one transport per trainer rank, got none")
        self.backend = backend or hal.current()
        self.per_sender = [Receiver(t, None, timeout_s=timeout_s, token=token, backend=self.backend) for t in transports]
        """One `Receiver` per sending trainer rank, in trainer-rank order."""
        self.timeout_s = float(timeout_s)
        self.bounds = WaitBounds(self.timeout_s)
        self.version = version

    @property
    def sender_count(self) -> int:
        """How many trainer ranks send to this receiver."""
        return len(self.per_sender)

    @property
    def version(self) -> int | None:
        """The weight version this side holds (as `Receiver.version`): set after a sync every
        rank completed; an older one is refused by every sender's header check."""
        return self.per_sender[0].version

    @version.setter
    def version(self, version: int | None) -> None:
        for receiver in self.per_sender:
            receiver.version = version

    @property
    def consistent(self) -> bool:
        """False while the weights mix two versions (a failed sync handed the engine part of itself)."""
        return all(receiver.consistent for receiver in self.per_sender)

    @property
    def torn(self) -> tuple[str, ...]:
        """Tensors a broken group may have torn (none: neither shares nor pieces land in the
        engine's tensors in place)."""
        return tuple(sorted({name for receiver in self.per_sender for name in receiver.torn}))

    @property
    def abort_error(self) -> str | None:
        """Why the engine's `abort()` failed after the last failed sync, if it did."""
        return next((r.abort_error for r in self.per_sender if r.abort_error is not None), None)

    def close(self) -> None:
        """Free every transport's buffers (the groups are their owner's)."""
        for receiver in self.per_sender:
            receiver.close()

    # ---- the steps both kinds share ----------------------------------------------------------
    def _deliver(self, m: int, inc: IncomingSync, handover: Any, live: set[int]) -> None:
        """Group m's receiving thread: deliver its part, then tell `handover` (the assembler,
        the landing) that this sender is done."""
        try:
            inc.deliver()  # what ends it early is kept (`IncomingSync.lost`) and reported at the agreement
            if isinstance(inc.lost, errors.PeerError):
                live.discard(m)  # that group broke: nobody in it can agree any more
        finally:
            handover.sender_done(m)

    def _deliver_all(self, incoming: list[IncomingSync], handover: Any, live: set[int]) -> None:
        """One receiving thread per live group while this thread drains `handover` (the
        assembler, the landing: what reaches the engine happens on the caller's thread)."""
        handover.expect(live)
        threads = [threading.Thread(target=self._deliver, args=(m, incoming[m], handover, live), daemon=True) for m in sorted(live)]
        for thread in threads:
            thread.start()
        handover.drain()
        for thread in threads:
            thread.join()

    def _conclude(self, incoming: list[IncomingSync], live: set[int], report: RankReport) -> tuple[int | None, errors.SyncError | None]:
        """The two agreements that end a sync in every live group; the version the headers
        announced and the error every rank raises (None when the sync completed)."""
        version = next((i.header.version for i in incoming if i.header is not None), None)
        report = self._agree(incoming, live, report, "sync status")
        report = self._agree(incoming, live, report, "every sender's status")
        try:
            errors.raise_if_any([report], 0, f"sync of version {version}" if version is not None else "sync")
        except errors.SyncError as exc:
            return version, exc
        return version, None

    def _first_problem(self, failure: errors.SyncError | None, incoming: list[IncomingSync], handover: Any) -> RankReport | None:
        """This worker's word when something already went wrong: the headers' failure, a
        part's own error, the hand-over's (assembler's, landing's), or a sender that failed
        (it says why at the agreement); None when nothing did."""
        touched = handover.touched
        if failure is not None:
            return errors.report_exception(failure, sender=False, inconsistent=touched)
        for inc in incoming:
            own = inc.report()
            if own.error is not None:
                return RankReport(error=own.error, kind=own.kind, inconsistent=touched)
        if handover.error is not None:
            return errors.report_exception(handover.error, sender=False, inconsistent=touched)
        if any(inc.sender_failed for inc in incoming):
            return RankReport(inconsistent=touched)
        return None

    def _agree(self, incoming: list[IncomingSync], live: set[int], report: RankReport, what: str) -> RankReport:
        """Agree in every live group; returns this worker's report with the first error any
        group's ranks told (so the next agreement tells it to every trainer rank)."""
        for m in sorted(live):
            try:
                reports = incoming[m].agree_outcome(report, what, bound_s=self.bounds.behind_s)
            except errors.PeerError as exc:
                live.discard(m)
                reports = [errors.report_exception(exc, sender=False)]
            told = next((r for r in reports if r.error), None)
            if report.error is None and told is not None:
                report = RankReport(error=f"{self.GROUP} {m}'s group: {told.error}", kind=told.kind, inconsistent=report.inconsistent)
        return report


def unwrapped(exc: errors.SyncError) -> errors.SyncError:
    """The error a rank reported at a header agreement, as its own kind, without the "sync
    of version v failed:" the agreement put before it (the senders put their own again)."""
    reports = [r for _, r in sorted(exc.reports.items(), key=lambda item: item[0] != exc.my_rank) if r.error]
    if not reports:
        return exc
    return errors.error_class(reports[0].kind)(reports[0].error, reports=exc.reports, my_rank=exc.my_rank)
