"""The control plane: what the ranks of a sync say to each other about the weights,
never the weights' bytes (those are a transport's, hal.sync.transport).

One sync reads: every rank draws the header's challenge (`GroupChannel.challenge`), the
sender broadcasts its header (`SyncChannel.exchange_header`; the format and its checks are
hal.sync.wire.header) with a proof of the token over that challenge (`auth_proof`), every rank
checks it and all agree on the verdict (`GroupChannel.agree`); then each segment travels
after its status (`SegmentStatus`), through a transport, which has a `SyncChannel` for
these messages; then all agree on how the sync ended. Every wait is bounded and names the
rank and the step.

The trainer's own group speaks the same way (`trainer_channel`): the agreements of a
sharded trainer's ranks (`TrainerSync`, `ShardedSender`, the integrations' init and
outcome) are `GroupChannel.agree` over it.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import secrets
import struct
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator

import torch
import torch.distributed as dist

import hal
from hal.backends.interface import Backend
from hal.kernels.delta import Encoding
from hal.sync.errors import AuthError, HeaderError, PeerError, RankReport
from hal.sync.wire.header_json import MAX_HEADER_BYTES
from hal.sync.wire.kept_works import KeptWorks

# Largest status report one rank contributes to an agreement (its error message, JSON).
MAX_REPORT_BYTES = 8192


def default_group(argument: str = "group") -> Any:
    """torch.distributed's default group, for a caller given none (`argument` names the
    parameter it left out, for the error when there is no default group either)."""
    if not dist.is_initialized():
        raise PeerError(f"no process group: pass {argument}= or call torch.distributed.init_process_group first")
    return dist.group.WORLD


@dataclass(frozen=True, slots=True)
class SegmentStatus:
    """What the sender says about segment `segment` of bucket `bucket` before its bytes.

    The code on the wire: FAILED, OK, DIRECT, or for an encoded (delta) segment
    `ENCODED + encoding` (hal.kernels.Encoding: INDICES 3, BITMASK 4)."""

    FAILED: ClassVar[int] = -1
    OK: ClassVar[int] = 1
    DIRECT: ClassVar[int] = 2  # OK, and every later range of this tensor is sent from its own memory
    ENCODED: ClassVar[int] = 2  # plus an `Encoding` other than DENSE: the bytes are the words that changed

    code: int
    bucket: int
    segment: int
    nbytes: int

    @property
    def failed(self) -> bool:
        return self.code == self.FAILED

    @property
    def direct(self) -> bool:
        return self.code == self.DIRECT

    @property
    def encoding(self) -> Encoding:
        """How the bytes are encoded (hal.kernels.Encoding)."""
        return Encoding(self.code - self.ENCODED) if self.code > self.ENCODED else Encoding.DENSE

    @classmethod
    def code_of(cls, encoding: int, direct: bool) -> int:
        if encoding != Encoding.DENSE:
            return cls.ENCODED + Encoding(encoding)
        return cls.DIRECT if direct else cls.OK

    def tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([self.code, self.bucket, self.segment, self.nbytes], dtype=torch.int64, device=device)

    @classmethod
    def parse(cls, words: torch.Tensor, bucket: int, segment: int, nbytes: int, where: str) -> "SegmentStatus":
        code, got_bucket, got_segment, got_nbytes = (int(w) for w in words.cpu().tolist())
        status = cls(code, got_bucket, got_segment, got_nbytes)
        encoded = code - cls.ENCODED in _ENCODED
        if not (encoded or code in (cls.FAILED, cls.OK, cls.DIRECT)) or (got_bucket, got_segment) != (bucket, segment):
            raise PeerError(f"{where}: expected the status of bucket {bucket} segment {segment}, got {status}: the ranks are out of step")
        if not status.failed and (got_nbytes != nbytes if not encoded else not 0 < got_nbytes <= nbytes):
            raise PeerError(f"{where}: bucket {bucket} segment {segment} announced {got_nbytes} bytes, the plan says {nbytes}")
        return status


_ENCODED = frozenset(int(e) for e in Encoding if e != Encoding.DENSE)

# land(bucket, segment, status) -> where its bytes should go, or None for the transport's buffer
Land = Callable[[int, int, SegmentStatus], "torch.Tensor | None"]
# complete(bucket, segment, landed, status) once the segment's bytes are here
Complete = Callable[[int, int, bool, SegmentStatus], None]


def _random_words() -> torch.Tensor:
    """Two int64 of fresh randomness from the OS (`secrets`)."""
    return torch.tensor(struct.unpack("<2q", secrets.token_bytes(16)), dtype=torch.int64)


def _digest(words: torch.Tensor) -> str:
    return hashlib.sha256(words.contiguous().numpy().tobytes()).hexdigest()


def control_device_of(group: Any, backend: Backend) -> torch.device:
    """Where a group's control messages live (`Backend.control_device` of its collective
    library); the host for a group outside c10d's registry, which cannot be asked."""
    try:
        name = str(dist.get_backend(group))
    except (RuntimeError, ValueError, TypeError):
        return torch.device("cpu")
    return backend.control_device(name)


class GroupChannel:
    """Small control collectives over one process group, with errors that say which rank
    and what: the agreement every rank of a sync ends with, used by transports (over the
    sync group) and by `TrainerSync` (over the trainer's group); and the challenge each
    header's proof answers.

    A channel owns no timeout: whoever runs a sync bounds every wait of it, per call
    (`with channel.bounded(timeout_s):`; `Sender` from its `SyncConfig.timeout_s`, a
    `Receiver` from its own), so the setting lives in one place and is never copied.
    """

    name: ClassVar[str] = "group"

    def __init__(self, group: Any = None, *, control_device: str | torch.device = "cpu") -> None:
        self.group = group if group is not None else default_group()
        self.rank = self.group.rank()
        self.world_size = self.group.size()
        self.control_device = torch.device(control_device)
        self._bound_s: float | None = None  # while `bounded`: the longest wait of any one step
        self._challenge: str | None = None  # drawn in the last agreement, for the next header
        self._forged: str | None = None  # why the challenge drawn last cannot be trusted (`_drawn`)
        self._kept = KeptWorks()  # the last collectives' works, held past the library's threads (kept_works)

    def keep(self, work: Any, tensor: torch.Tensor) -> Any:
        """Hold `work`, a collective on `tensor` just posted on this channel's group, so that
        no thread of the collective library lets go of it last (hal.sync.wire.kept_works);
        returns it. Whoever issues a collective on this channel's group calls this."""
        return self._kept.keep(work, tensor)

    @contextlib.contextmanager
    def bounded(self, timeout_s: float) -> Iterator[None]:
        """Bound every wait of the calls made inside (one transfer, one agreement, one
        handle exchange) by `timeout_s` seconds; a sync's owner wraps the sync in this."""
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
            raise ValueError(f"{self.name}: timeout_s must be a positive number of seconds, got {timeout_s!r}")
        outer, self._bound_s = self._bound_s, float(timeout_s)
        try:
            yield
        finally:
            self._bound_s = outer

    @property
    def timeout_s(self) -> float:
        """The bound in force (see `bounded`)."""
        if self._bound_s is None:
            raise RuntimeError(
                f"{self.name} on rank {self.rank}: a collective outside a sync; every wait is bounded by the sync that "
                "makes it (Sender.send, Receiver.receive, TrainerSync.sync) or by `with channel.bounded(timeout_s):`"
            )
        return self._bound_s

    def collective_timeout(self) -> datetime.timedelta:
        """The bound in force, as a collective's options take it."""
        return datetime.timedelta(seconds=self.timeout_s)

    def wait(self, work: Any, what: str) -> None:
        """Wait for `work` within the bound in force; `PeerError` naming `what` otherwise."""
        try:
            ok = work.wait(self.collective_timeout())
        except RuntimeError as exc:
            raise PeerError(f"{self.name}: {what} failed on rank {self.rank} (a peer died or did not answer within {self.timeout_s} s): {exc}") from exc
        if ok is False:
            raise PeerError(f"{self.name}: {what} timed out on rank {self.rank} after {self.timeout_s} s")

    def allreduce(self, tensor: torch.Tensor, what: str) -> None:
        opts = dist.AllreduceOptions()
        opts.timeout = self.collective_timeout()
        try:
            work = self.keep(self.group.allreduce([tensor], opts), tensor)
        except RuntimeError as exc:
            raise PeerError(f"{self.name}: {what} failed on rank {self.rank}: {exc}") from exc
        self.wait(work, what)

    def agree(self, report: RankReport, what: str = "status") -> list[RankReport]:
        """Every rank's report, on every rank, so that all stop together.

        Gathered through all-reduces (one row per rank): message lengths and flags first,
        then, only if some rank has an error to tell, the messages' bytes. The common
        case, nobody failed, costs one small all-reduce.
        """
        text = report.encode().encode()[:MAX_REPORT_BYTES]
        head = torch.zeros(self.world_size, 4, dtype=torch.int64, device=self.control_device)
        # this rank's row: its message length, its flags, and the random words of the next
        # header's challenge, which comes along (see `challenge`); kept to check it came back
        mine = torch.cat([torch.tensor([len(text), report.flags], dtype=torch.int64), _random_words()])
        head[self.rank] = mine
        self.allreduce(head, f"{what} lengths")
        rows = head.cpu()
        self._drawn(rows, mine, rows[:, 2:], f"{what} lengths")
        rows_head = rows[:, :2].tolist()
        sizes = [int(n) for n, _ in rows_head]
        flags = [int(f) for _, f in rows_head]
        if any(not 0 <= n <= MAX_REPORT_BYTES for n in sizes) or any(not 0 <= f < 8 for f in flags):
            raise PeerError(f"{self.name}: {what}: a rank announced a malformed report {rows_head}")
        width = max(sizes)
        if width == 0:
            return [RankReport.decode("", f) for f in flags]
        rows = torch.zeros(self.world_size, width, dtype=torch.uint8)
        if text:
            rows[self.rank, : len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        rows = rows.to(self.control_device)
        self.allreduce(rows, what)
        rows = rows.cpu()
        return [RankReport.decode(rows[r, :n].numpy().tobytes().decode(errors="replace"), flags[r]) for r, n in enumerate(sizes)]

    def all_gather_bytes(self, payload: bytes, what: str, *, limit: int | None = None) -> list[bytes]:
        """Every rank's bytes (JSON, never pickles), through two all-reduces: the lengths,
        then one zero-padded row per rank. With `limit`, a length outside 0..limit fails
        every rank alike (each sees the same lengths) before any payload moves."""
        sizes = torch.zeros(self.world_size, dtype=torch.int64, device=self.control_device)
        sizes[self.rank] = len(payload)
        self.allreduce(sizes, f"{what} lengths")
        lengths = [int(n) for n in sizes.cpu().tolist()]
        if limit is not None and any(not 0 <= n <= limit for n in lengths):
            raise PeerError(f"{self.name}: {what}: a rank announced a length outside 0..{limit}: {lengths}")
        rows = torch.zeros(self.world_size, max(max(lengths, default=0), 1), dtype=torch.uint8)
        if payload:
            rows[self.rank, : len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        rows = rows.to(self.control_device)
        self.allreduce(rows, what)
        rows = rows.cpu()
        return [rows[r, :n].numpy().tobytes() for r, n in enumerate(lengths)]

    def challenge(self) -> str:
        """A fresh challenge for the next header, the same on every rank: 128 random bits
        from each rank, put together by an all-reduce. The sender's proof covers it
        (`hal.sync.wire.auth.auth_proof`), so a header is good for one exchange only: one
        recorded earlier, in this group or another, is refused. Every agreement (`agree`)
        draws the next one on the way, so only a group's first header, or one after a
        header without an agreement, costs a collective of its own. Every rank calls this
        before each header, as every rank calls `agree`: the ranks stay in step.

        Raises `AuthError` when this rank's own bits did not come back unchanged (`_drawn`),
        after the collective, so the ranks stay in step: the caller still takes part in the
        header's exchange and tells the others at its agreement (`Sender`, `Receiver`)."""
        if self._challenge is None and self._forged is None:
            rows = torch.zeros(self.world_size, 2, dtype=torch.int64, device=self.control_device)
            mine = _random_words()
            rows[self.rank] = mine
            self.allreduce(rows, "header challenge")
            rows = rows.cpu()
            self._drawn(rows, mine, rows, "header challenge")
        challenge, forged, self._challenge, self._forged = self._challenge, self._forged, None, None  # used once
        if forged is not None:
            raise AuthError(forged)
        return challenge

    def _drawn(self, rows: torch.Tensor, mine: torch.Tensor, bits: torch.Tensor, what: str) -> None:
        """Keep the challenge in `bits` (every rank's random words, one row each), unless
        this rank's row of `rows` differs from what it contributed (`mine`). Every other rank
        adds zeros there, so a changed row means a member did not follow the all-reduce but
        made up its result: a peer that sees the others' bits can steer the result to a
        challenge seen before, and so make a recorded header's proof valid again. Only this
        rank's own row can be checked here; each rank checks its own, so no honest rank
        takes a challenge that is not fresh for it."""
        if torch.equal(rows[self.rank], mine):
            self._challenge, self._forged = _digest(bits), None
            return
        self._challenge, self._forged = None, (
            f"{self.name}: rank {self.rank} of a group of {self.world_size}: its own row of the {what} all-reduce "
            "(with its random bits for the next header's challenge) came back changed; a member of the group does not "
            "follow the collective (it may be forcing a challenge seen before, to replay a recorded header): "
            "the next header is refused"
        )


class SyncChannel(GroupChannel):
    """The control plane of one sync group whose rank `src` sends: the header's exchange and
    the broadcasts of small control payloads, on top of the agreement. A transport has one
    (`Transport.channel`) and adds the bytes."""

    name: ClassVar[str] = "sync channel"

    def __init__(self, group: Any = None, *, src: int = 0, control_device: str | torch.device = "cpu") -> None:
        super().__init__(group, control_device=control_device)
        if not 0 <= src < self.world_size:
            raise ValueError(f"src={src} is not a rank of a group of size {self.world_size}")
        if self.world_size < 2:
            raise ValueError(f"a sync group needs the sender and at least one receiver; this group has {self.world_size} rank")
        self.src = src

    @property
    def is_sender(self) -> bool:
        return self.rank == self.src

    def broadcast(self, tensor: torch.Tensor, what: str) -> Any:
        """Post the broadcast of a control tensor (on `control_device`) from the sender; its work."""
        opts = dist.BroadcastOptions()
        opts.rootRank = self.src
        opts.timeout = self.collective_timeout()
        try:
            return self.keep(self.group.broadcast([tensor], opts), tensor)
        except RuntimeError as exc:
            raise PeerError(f"{self.name}: {what} failed on rank {self.rank}: {exc}") from exc

    def broadcast_bytes(self, payload: bytes | None, limit: int, what: str) -> bytes:
        """The sender's `payload` on every rank. Its length travels first; a length over
        `limit` fails every rank alike (each sees the same length) before the payload moves."""
        n = len(payload) if self.is_sender and payload is not None else 0
        size = torch.tensor([n], dtype=torch.int64, device=self.control_device)
        self.wait(self.broadcast(size, f"{what} size"), f"{what} size")
        n = int(size.item())
        if not 0 <= n <= limit:
            raise HeaderError(f"{what} of {n} bytes announced by rank {self.src}; the limit is {limit} bytes")
        if self.is_sender:
            data = torch.frombuffer(bytearray(payload or b""), dtype=torch.uint8).to(self.control_device) if n else torch.empty(0, dtype=torch.uint8)
        else:
            data = torch.empty(n, dtype=torch.uint8, device=self.control_device)
        if n:
            self.wait(self.broadcast(data, what), what)
        return bytes(payload or b"") if self.is_sender else data.cpu().numpy().tobytes()

    def exchange_header(self, payload: bytes | None) -> bytes:
        """The sender's encoded header on every rank (the receivers decode it themselves:
        nothing that came over the wire is unpickled)."""
        return self.broadcast_bytes(payload, MAX_HEADER_BYTES, "header")


def trainer_channel(trainer_group: Any = None, backend: Backend | None = None) -> GroupChannel:
    """The channel of a sharded trainer's own group (default: torch.distributed's default
    group), named "trainer group" in its errors, its control messages where that group's
    collective library keeps them. Every composite of trainer ranks (`TrainerSync`,
    `ShardedSender`, the integrations' init and outcome agreements) makes its channel here."""
    backend = backend or hal.current()
    group = trainer_group if trainer_group is not None else default_group("trainer_group")
    channel = GroupChannel(group, control_device=control_device_of(group, backend))
    channel.name = "trainer group"
    return channel
