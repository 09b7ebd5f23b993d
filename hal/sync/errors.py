"""Errors of a weight sync. Every rank of a failed sync raises one of these.

A failed sync carries what every rank reported (`SyncError.reports`), so the trainer
knows which rank failed first, whether the failure was its own (`trainer_side`), and
which receivers were left holding some new and some old tensors (`inconsistent_ranks`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


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


# Errors cross ranks as small JSON reports (Transport.agree); every rank then raises the
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
_MAX_MESSAGE = 2000


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

    @property
    def flags(self) -> int:
        return int(self.sender) | int(self.inconsistent) << 1 | int(self.resend) << 2

    def encode(self) -> str:
        """The error as JSON, or "" for none."""
        if self.error is None:
            return ""
        return json.dumps({"e": self.error[:_MAX_MESSAGE], "k": self.kind}, separators=(",", ":"))

    @classmethod
    def decode(cls, text: str | None, flags: int = 0) -> "RankReport":
        """A report from another rank; anything malformed becomes an error report saying so."""
        sender, inconsistent, resend = bool(flags & 1), bool(flags & 2), bool(flags & 4)
        if not text:
            return cls(sender=sender, inconsistent=inconsistent, resend=resend)
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict) or set(raw) != {"e", "k"}:
                raise ValueError("not an object with keys e, k")
            error, kind = raw["e"], raw["k"]
            if not isinstance(error, str) or not isinstance(kind, str):
                raise ValueError("bad field types")
        except (ValueError, RecursionError) as exc:
            return cls(error=f"unreadable status report ({exc}): {text[:200]!r}", kind="peer", sender=sender, inconsistent=inconsistent, resend=resend)
        return cls(error=error[:_MAX_MESSAGE], kind=kind if kind in _KINDS else "error", sender=sender, inconsistent=inconsistent, resend=resend)


MAX_REPORTED = 5  # problems named in one refusal; the rest are counted


def refuse_specs(problems: list[str], prefix: str = "") -> None:
    """Raise `SpecMismatchError` naming the first few `problems` (and how many more), if any."""
    if problems:
        more = f" (+{len(problems) - MAX_REPORTED} more)" if len(problems) > MAX_REPORTED else ""
        raise SpecMismatchError(prefix + "; ".join(problems[:MAX_REPORTED]) + more)


def error_class(kind: str) -> type[SyncError]:
    """The `SyncError` subclass a report's kind names."""
    return _KINDS.get(kind, SyncError)


def kind_of(exc: BaseException) -> str:
    for kind, cls in _KINDS.items():
        if isinstance(exc, cls):
            return kind
    return "error"


def report_exception(exc: BaseException, *, sender: bool, inconsistent: bool = False, resend: bool = False) -> RankReport:
    message = str(exc) if isinstance(exc, SyncError) else f"{type(exc).__name__}: {exc}"
    return RankReport(error=message, kind=kind_of(exc), sender=sender, inconsistent=inconsistent, resend=resend)


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
