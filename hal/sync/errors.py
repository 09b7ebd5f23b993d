"""Errors of a weight sync. Every rank of a failed sync raises one of these.

A failed sync carries what every rank reported (`SyncError.reports`), so the trainer
knows which rank failed first, whether the failure was its own (`trainer_side`), and
which receivers were left holding some new and some old tensors (`inconsistent_ranks`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable


class SyncError(RuntimeError):
    """A sync did not complete; nothing about it was reported as success."""

    def __init__(self, message: str = "", *, reports: "dict[int, RankReport] | None" = None, my_rank: int | None = None) -> None:
        super().__init__(message)
        self.reports: dict[int, RankReport] = dict(reports or {})
        """What each rank said at the agreement that failed the sync (empty when no agreement was reached)."""
        self.my_rank = my_rank

    @property
    def failed_ranks(self) -> list[int]:
        return sorted(r for r, rep in self.reports.items() if rep.error)

    @property
    def inconsistent_ranks(self) -> list[int]:
        """Receivers that applied part of this failed sync: they hold some new and some old tensors."""
        return sorted(r for r, rep in self.reports.items() if rep.inconsistent)

    @property
    def only_delta_base(self) -> bool:
        """Every rank that failed refused a delta's base (the same answer on every rank)."""
        failed = [rep for rep in self.reports.values() if rep.error]
        return bool(failed) and all(rep.kind == "base" for rep in failed)

    @property
    def resend_follows(self) -> bool:
        """The sending trainer rank sends this sync again (`TrainerSync`'s agreement)."""
        return any(rep.sender and rep.resend for rep in self.reports.values())

    @property
    def trainer_side(self) -> bool:
        """True when the sending rank itself failed (its source raised, a pack failed)."""
        return any(rep.sender and rep.error for rep in self.reports.values())


class VersionError(ValueError, TypeError):
    """A weight version that is not an int in 0 <= version < 2**63 (the trainer's step).
    Both a ValueError and a TypeError: callers of either era catch it (`check_version`)."""


def check_version(version: object) -> int:
    """`version` as a sync's weight version; `VersionError` naming it otherwise (the one
    check every sending side makes before anything is sent)."""
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version < 2**63:
        raise VersionError(f"version must be a non-negative int below 2**63 (e.g. the global step), got {version!r}")
    return version


class HeaderError(SyncError, ValueError):
    """A sync header that is malformed, truncated, oversize or not of this protocol (nothing was applied)."""


class SpecMismatchError(SyncError, ValueError):
    """A name, shape or dtype the receiving side does not expect (raised before anything is applied)."""


class StaleVersionError(SyncError):
    """The sync carries a version older than the one a receiver already holds."""


class DeltaBaseError(SyncError):
    """A delta sync refused: a receiver does not hold exactly the version the delta is
    computed from (it joined or restarted, or a sync failed). The sender then sends the
    same sync whole (a dense anchor) at once."""


class ChecksumMismatchError(SyncError):
    """Bytes received differ from the bytes sent."""


class AuthError(SyncError):
    """The trainer did not present the token the engine was started with (refused before any byte)."""


class SourceError(SyncError):
    """The trainer's source or a pack failed on the sending rank; no byte of the failed tensor left it."""


class PeerError(SyncError):
    """Another rank failed, died or did not answer within the timeout."""


# Errors cross ranks as small JSON reports (GroupChannel.agree); every rank then raises the
# same class, so a test on any rank sees what went wrong where.
_KINDS: dict[str, type[SyncError]] = {
    "header": HeaderError,
    "spec": SpecMismatchError,
    "stale": StaleVersionError,
    "base": DeltaBaseError,
    "checksum": ChecksumMismatchError,
    "auth": AuthError,
    "source": SourceError,
    "peer": PeerError,
}
# Failures that are not a sync's own but that every rank of a composite must raise alike
# (a trainer rank's ValueError at init, a LoRA part it cannot read): told with
# `keep_class=True` they keep their class (`rebuild`); any other class comes back a
# RuntimeError with the same message. A sync's own agreement never raises these
# (`raise_if_any` raises a `SyncError` for them), whatever a peer says.
_PLAIN: dict[str, type[Exception]] = {
    "value": ValueError,
    "type": TypeError,
    "key": KeyError,
    "not_implemented": NotImplementedError,
    "runtime": RuntimeError,
    "timeout": TimeoutError,
}
_MAX_MESSAGE = 2000
_FAILED_BIT = 8  # in `RankReport.told`: that rank reported an error
_MAX_TOLD = 512  # ranks a retold failure names (flags beyond these are dropped)


@dataclass(frozen=True, slots=True)
class RankReport:
    """One rank's word at an agreement: its error (None for success), whether it is the
    sender, and whether it touched its weights during the sync (wrote a destination or
    applied a tensor): if the sync then fails, that receiver holds some new and some old
    tensors. The two flags travel as bits beside the message length; only an error costs
    a second round trip (`Transport.agree`)."""

    error: str | None = None
    kind: str = "error"
    sender: bool = False
    inconsistent: bool = False
    resend: bool = False
    """From the sending trainer rank to the others (`TrainerSync`): the same sync follows again."""
    told: tuple[tuple[int, int], ...] = ()
    """For an error that is itself the outcome of another group's agreement (a `SyncError`
    retold over the trainer's group, `report_exception(..., keep_class=True)`): the ranks
    of that agreement that said something, as (rank, flags; `_FAILED_BIT` where it failed),
    so that every rank rebuilds the same `reports` (`rebuild`)."""

    @property
    def flags(self) -> int:
        return int(self.sender) | int(self.inconsistent) << 1 | int(self.resend) << 2

    def encode(self) -> str:
        """The error as JSON, or "" for none."""
        if self.error is None:
            return ""
        word: dict = {"e": self.error[:_MAX_MESSAGE], "k": self.kind}
        if self.told:
            word["r"] = [list(pair) for pair in self.told[:_MAX_TOLD]]
        return json.dumps(word, separators=(",", ":"))

    @classmethod
    def decode(cls, text: str | None, flags: int = 0) -> "RankReport":
        """A report from another rank; anything malformed becomes an error report saying so."""
        sender, inconsistent, resend = bool(flags & 1), bool(flags & 2), bool(flags & 4)
        if not text:
            return cls(sender=sender, inconsistent=inconsistent, resend=resend)
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict) or not {"e", "k"} <= set(raw) <= {"e", "k", "r"}:
                raise ValueError("not an object with keys e, k (and r)")
            error, kind, told = raw["e"], raw["k"], raw.get("r", [])
            if not isinstance(error, str) or not isinstance(kind, str):
                raise ValueError("bad field types")
            told = tuple(_told_pair(pair) for pair in told[:_MAX_TOLD]) if isinstance(told, list) else _told_pair(told)
        except (ValueError, RecursionError) as exc:
            return cls(error=f"unreadable status report ({exc}): {text[:200]!r}", kind="peer", sender=sender, inconsistent=inconsistent, resend=resend)
        kind = kind if kind in _KINDS or kind in _PLAIN else "error"
        return cls(error=error[:_MAX_MESSAGE], kind=kind, sender=sender, inconsistent=inconsistent, resend=resend, told=told)

    @property
    def told_reports(self) -> "dict[int, RankReport]":
        """`told` as the reports of the agreement it came from (an error says only "failed")."""
        return {
            rank: RankReport(error="failed" if flags & _FAILED_BIT else None, sender=bool(flags & 1), inconsistent=bool(flags & 2))
            for rank, flags in self.told
        }


def _told_pair(pair: object) -> tuple[int, int]:
    if (
        not isinstance(pair, list) or len(pair) != 2 or not all(type(x) is int for x in pair)
        or not 0 <= pair[0] < 2**31 or not 0 <= pair[1] < 16
    ):
        raise ValueError(f"r: expected a list of [rank, flags], got {pair!r}"[:200])
    return pair[0], pair[1]


MAX_REPORTED = 5  # problems named in one refusal; the rest are counted


def refuse_specs(problems: list[str], prefix: str = "") -> None:
    """Raise `SpecMismatchError` naming the first few `problems` (and how many more), if any."""
    if problems:
        more = f" (+{len(problems) - MAX_REPORTED} more)" if len(problems) > MAX_REPORTED else ""
        raise SpecMismatchError(prefix + "; ".join(problems[:MAX_REPORTED]) + more)


def error_class(kind: str) -> type[SyncError]:
    """The `SyncError` subclass a report's kind names."""
    return _KINDS.get(kind, SyncError)


def kind_of(exc: BaseException, *, keep_class: bool = False) -> str:
    """A report's kind for `exc`: its `SyncError` class, else "error" (or, with
    `keep_class`, its plain class: "value", "type", ..., else "runtime")."""
    for kind, cls in _KINDS.items():
        if isinstance(exc, cls):
            return kind
    if isinstance(exc, SyncError) or not keep_class:
        return "error"
    return next((kind for kind, cls in _PLAIN.items() if isinstance(exc, cls)), "runtime")


def report_exception(
    exc: BaseException, *, sender: bool, inconsistent: bool = False, resend: bool = False, keep_class: bool = False
) -> RankReport:
    """This rank's report of `exc`. A sync's own reports name any other class in the
    message (`"KeyError: ..."`) and come back a `SyncError`; with `keep_class` (a composite
    of ranks telling its members one failure, `rebuild`) the class itself travels, and a
    `SyncError` brings the reports of the agreement it came from (`RankReport.told`)."""
    if isinstance(exc, SyncError) or keep_class:
        message = str(exc)
    else:
        message = f"{type(exc).__name__}: {exc}"
    told: tuple[tuple[int, int], ...] = ()
    if keep_class and isinstance(exc, SyncError):
        told = tuple(
            (rank, rep.flags | (_FAILED_BIT if rep.error else 0))
            for rank, rep in sorted(exc.reports.items())
            if rep.error or rep.flags
        )
    kind = kind_of(exc, keep_class=keep_class)
    return RankReport(error=message, kind=kind, sender=sender, inconsistent=inconsistent, resend=resend, told=told)


def rebuild(report: RankReport, prefix: str = "", *, reports: "dict[int, RankReport] | None" = None, my_rank: int | None = None) -> Exception:
    """The error `report` tells (it has one), as its own class with its message after
    `prefix`: a `SyncError` subclass with `reports` (default: those it retells,
    `RankReport.told`), or the plain class `report_exception(..., keep_class=True)` kept."""
    plain = _PLAIN.get(report.kind)
    if plain is not None:
        return plain(prefix + (report.error or ""))
    told = report.told_reports if reports is None else reports
    return error_class(report.kind)(prefix + (report.error or ""), reports=told, my_rank=my_rank)


def first_failure(reports: "list[RankReport]") -> "tuple[int, RankReport] | None":
    """(rank, report) of the lowest rank that reported an error (an empty message is one too), or None."""
    return next(((rank, rep) for rank, rep in enumerate(reports) if rep.error is not None), None)


def agree_failure(
    channel: Any,
    error: BaseException | None,
    what: str,
    prefix: "Callable[[int], str]",
    *,
    my_rank: int | None = None,
    together: bool = False,
) -> Exception | None:
    """One step of a composite of ranks (a sharded trainer's init and outcome, what a LoRA
    sync sends) ended as a sync ends, so that every rank goes on, or fails alike, together:
    every rank of `channel` (a `hal.sync.wire.GroupChannel`, which imports this module) tells its `error` (None: its part went well) with its class kept
    (`report_exception(..., keep_class=True)`) at one agreement (`what`), and gets back the
    same error to raise, or None when no rank failed: the lowest failing rank's, as its own
    class, its message after `prefix(rank)` (`rebuild`). The caller bounds the wait
    (`channel.bounded`) and raises it (`from error`).

    A `SyncError` keeps the reports of the agreement it came from (`RankReport.told`): the
    first failing rank's, or with `together` every failing rank's as one (`retold_together`:
    each rank's own sync group, all of them alike)."""
    report = RankReport() if error is None else report_exception(error, sender=True, keep_class=True)
    reports = channel.agree(report, what)
    failed = first_failure(reports)
    if failed is None:
        return None
    rank, first = failed
    told = retold_together([r for r in reports if r.error is not None]) if together else None
    return rebuild(first, prefix(rank), reports=told, my_rank=my_rank)


def retold_together(failed: "list[RankReport]") -> "dict[int, RankReport]":
    """The agreements `failed` retell (each a `SyncError` told with `keep_class`, `told`),
    of groups alike (every trainer rank's own sync group: its rank 0 the sender, the same
    receivers at the same ranks), as the reports of one: rank 0, the sender, with the first
    report's error when a sender failed in any; each receiver that failed, or holds part of
    the sync, in any."""
    told = [r.told_reports for r in failed]
    side = any(rep.sender and rep.error for t in told for rep in t.values())
    inconsistent = {w for t in told for w, rep in t.items() if rep.inconsistent}
    lost = {w for t in told for w, rep in t.items() if rep.error} - {0}
    reports = {0: RankReport(error=failed[0].error if side else None, sender=True)}
    for worker in sorted(inconsistent | lost):
        if worker != 0:
            reports[worker] = RankReport(error="failed" if worker in lost else None, inconsistent=worker in inconsistent)
    return reports


def raise_if_any(reports: "list[RankReport]", my_rank: int, what: str) -> None:
    """Raise on every rank if any rank reported an error; this rank's own error first.

    A report that only says "inconsistent" (no error) never raises by itself: some other
    rank's error is what failed the sync.
    """
    failed = [(r, rep) for r, rep in enumerate(reports) if rep.error]
    if not failed:
        return
    failed.sort(key=lambda item: item[0] != my_rank)
    rank, report = failed[0]
    cls = _KINDS.get(report.kind, SyncError)
    where = "" if rank == my_rank else f"rank {rank}: "
    others = f" (and {len(failed) - 1} more rank(s) failed)" if len(failed) > 1 else ""
    raise cls(f"{what} failed: {where}{report.error}{others}", reports=dict(enumerate(reports)), my_rank=my_rank)
