"""Errors of a weight sync. Every rank of a failed sync raises one of these."""


class SyncError(RuntimeError):
    """A sync did not complete; nothing about it was reported as success."""


class SpecMismatchError(SyncError, ValueError):
    """A name, shape or dtype the receiving side does not expect (raised before anything is applied)."""


class StaleVersionError(SyncError):
    """The sync carries a version older than the one a receiver already holds."""


class ChecksumMismatchError(SyncError):
    """Bytes received differ from the bytes sent."""


class PeerError(SyncError):
    """Another rank failed, died or did not answer within the timeout."""


# Errors cross ranks as "kind|message" strings (Transport.agree); every rank then raises
# the same class, so a test on any rank sees what went wrong where.
_KINDS = {
    "spec": SpecMismatchError,
    "stale": StaleVersionError,
    "checksum": ChecksumMismatchError,
    "peer": PeerError,
}


def encode(kind: str, message: str) -> str:
    return f"{kind}|{message}"


def encode_exception(exc: BaseException) -> str:
    for kind, cls in _KINDS.items():
        if isinstance(exc, cls):
            return encode(kind, str(exc))
    return encode("error", f"{type(exc).__name__}: {exc}")


def raise_if_any(errors: "list[str | None]", my_rank: int, what: str) -> None:
    """Raise on every rank if any rank reported an error; this rank's own error first."""
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if not failed:
        return
    failed.sort(key=lambda item: item[0] != my_rank)
    rank, text = failed[0]
    kind, _, message = text.partition("|")
    cls = _KINDS.get(kind, SyncError)
    where = "" if rank == my_rank else f"rank {rank}: "
    others = f" (and {len(failed) - 1} more rank(s) failed)" if len(failed) > 1 else ""
    raise cls(f"{what} failed: {where}{message}{others}")
