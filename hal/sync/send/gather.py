"""The trainer side of a sync when the trainer is sharded over several ranks.

Every trainer rank makes the same call with the same source; the rank that holds the
sync transport (the one in the sync group with the engines) packs and sends, the others
only iterate, so that the collectives inside the iteration (an FSDP2 DTensor's
`full_tensor()` gathers over the trainer's own group) match on every rank:

    sync_group = ...                      # trainer rank 0 + every engine worker
    trainer = TrainerSync(
        transport=BroadcastTransport(sync_group) if rank == 0 else None,
        config=SyncConfig(bucket_bytes=256 << 20),
        trainer_group=fsdp_group,         # the ranks that hold shards; default: the default group
    )
    trainer.sync(ModuleSource(model), version=step)    # on every trainer rank

The trainer's group and the sync group are separate process groups; the ranks that do
not send allocate no bucket buffers and never touch the sync group.

Lockstep, and failures:

- Before anything is gathered, the trainer ranks agree over their group: the receivers'
  verdict on the header (a refused sync gathers nothing anywhere), and that every rank's
  source declares the same tensors (a rank with other metadata would gather out of step).
- While the sender sends, the other ranks iterate. If the sender fails part-way (its pack,
  or the sync group: a receiver died), it keeps iterating its source to the end without
  sending, so the others' gathers complete; then all trainer ranks agree again and raise
  the same error. Every wait of that agreement is bounded (twice the sync's `timeout_s`:
  the others may wait while the sender waits on the sync group).
- A source whose own iteration raises on one rank cannot be iterated further there; the
  other ranks then wait in their next gather until the trainer group's own collective
  timeout (create it with one: `init_process_group(timeout=...)`, `new_group(timeout=...)`).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from typing import Any, Callable, Iterator

import torch

import hal
from hal.backends.interface import Backend
from hal.sync import errors
from hal.sync.config import GATHER, SyncConfig
from hal.sync.errors import RankReport
from hal.sync.metrics import SyncMetrics
from hal.sync.spec import TensorSpec
from hal.sync.send.sender import Sender
from hal.sync.source import WeightSource, as_source
from hal.sync.wire.channel import trainer_channel
from hal.sync.transport.base import Transport


def metadata_digest(specs: list[TensorSpec]) -> int:
    """A 63-bit digest of a source's declared tensors (names, shapes, dtypes, order)."""
    h = hashlib.sha256()
    for s in specs:
        h.update(f"{s.name}|{s.shape}|{s.dtype}\n".encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1


class _Lockstep:
    """A source whose one iterator the sync uses and which can then be drained to its end."""

    def __init__(self, source: WeightSource) -> None:
        self.source = source
        self._it: Iterator[tuple[str, torch.Tensor]] | None = None
        self.dead = False  # the source's own iteration raised: it cannot go on
        self.exhausted = False
        self.gather_s = 0.0

    def metadata(self) -> Any:
        return self.source.metadata()

    def __iter__(self) -> "_Lockstep":
        if self._it is None:
            self._it = iter(self.source)
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        if self._it is None:
            self._it = iter(self.source)
        start = time.perf_counter()
        try:
            return next(self._it)
        except StopIteration:
            self.exhausted = True
            raise
        except BaseException:
            self.dead = True
            raise
        finally:
            self.gather_s += time.perf_counter() - start

    def drain(self) -> BaseException | None:
        """Iterate to the end, dropping every tensor; the source's own error, if it raised."""
        while not (self.exhausted or self.dead):
            try:
                next(self)
            except StopIteration:
                break
            except Exception as exc:  # noqa: BLE001 - reported at the trainer's agreement
                return exc
        return None


class TrainerSync:
    """One call, `sync(source, version=)`, on every rank of a sharded trainer (see the module doc).

    `transport` on the rank that sends (in the sync group with the engines), None on the
    others; exactly one trainer rank has one. `config` and `token` are the sender's; on
    the other ranks only `config.timeout_s` is used.
    """

    def __init__(
        self,
        *,
        transport: Transport | None,
        config: SyncConfig | None = None,
        trainer_group: Any = None,
        backend: Backend | None = None,
        token: str | None = None,
    ) -> None:
        self.config = config if config is not None else SyncConfig()
        self.backend = backend or hal.current()
        self.channel = trainer_channel(trainer_group, self.backend)
        self.sender = Sender(transport, self.config, backend=self.backend, token=token) if transport is not None else None
        self.version: int | None = None
        with self._bounded():
            self.sender_rank = self._find_sender()

    def _bounded(self) -> Any:
        # the other ranks may wait while the sender waits on the sync group
        return self.channel.bounded(self.config.bounds.behind_s)

    @property
    def rank(self) -> int:
        return self.channel.rank

    @property
    def is_sender(self) -> bool:
        return self.sender is not None

    def _find_sender(self) -> int:
        flags = torch.zeros(self.channel.world_size, dtype=torch.int64, device=self.channel.control_device)
        flags[self.rank] = int(self.is_sender)
        self.channel.allreduce(flags, "finding the sending rank")
        senders = [r for r, f in enumerate(flags.cpu().tolist()) if f]
        if len(senders) != 1:
            raise ValueError(
                f"TrainerSync: exactly one trainer rank must hold the sync transport, found {len(senders)} "
                f"(trainer ranks {senders}); pass transport= on the sending rank and None on the others"
            )
        return senders[0]

    def sync(self, source: Any, *, version: int, resend: Callable[[errors.SyncError], bool] | None = None) -> SyncMetrics:
        """Sync `source` as `version` from this rank's side; the same call on every trainer rank.

        Returns the sender's metrics on the sending rank, and this rank's (gather time,
        tensors) on the others. Raises the same `SyncError` subclass on every trainer
        rank (and every receiver) when the sync fails anywhere.

        `resend(error)`, on the sending rank, decides after a failed attempt whether the
        same sync is sent again (`WeightSync` does after a trainer-side failure that left an
        engine inconsistent); the other ranks learn it at the agreement and iterate again.
        On the sending rank the error is raised either way and the caller sends again.
        """
        errors.check_version(version)
        where = f"sync of version {version}"
        with self._bounded():
            if self.sender is not None:
                return self._send(_Lockstep(as_source(source)), version, where, resend)
            while True:
                try:
                    return self._follow(_Lockstep(as_source(source)), version, where)
                except errors.SyncError as exc:
                    if not exc.resend_follows:
                        raise

    # ---- the agreements over the trainer group ------------------------------------------------
    def _gate(self, lockstep: _Lockstep, header_error: errors.SyncError | None, where: str) -> None:
        """Before any gather: every rank declares the same tensors, and the receivers accepted."""
        digest = metadata_digest(list(lockstep.metadata()))
        digests = torch.zeros(self.channel.world_size, dtype=torch.int64, device=self.channel.control_device)
        digests[self.rank] = digest
        self.channel.allreduce(digests, "source metadata")
        theirs = digests.cpu().tolist()
        report = RankReport(sender=self.is_sender)
        if header_error is not None:
            report = errors.report_exception(header_error, sender=True)
        elif theirs[self.rank] != theirs[self.sender_rank]:
            report = RankReport(
                error=f"trainer rank {self.rank}'s source declares other tensors than the sending rank {self.sender_rank}'s: "
                "every trainer rank must iterate the same source in the same order",
                kind="spec",
            )
        errors.raise_if_any(self.channel.agree(report, "trainer header"), self.rank, where)

    def _send(
        self, lockstep: _Lockstep, version: int, where: str, resend: Callable[[errors.SyncError], bool] | None
    ) -> SyncMetrics:
        # the sender's phases (Sender.offer, then OutgoingSync.send or cancel) with the
        # trainer group's agreements between and after them
        try:
            outgoing = self.sender.offer(lockstep, version=version)
        except Exception as exc:  # refused or failed before the gate: the others wait there
            told = exc if isinstance(exc, errors.SyncError) else errors.SyncError(f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(errors.SyncError):
                self._gate(lockstep, told, where)  # raises on every trainer rank: nobody gathers
            raise
        try:
            self._gate(lockstep, None, where)
        except errors.SyncError as exc:  # a trainer rank declared other tensors: nobody gathers
            outgoing.cancel(exc)  # the receivers hear that no segment comes; raises on every rank
            raise
        failure: BaseException | None = None
        metrics: SyncMetrics | None = None
        try:
            metrics = outgoing.send()
        except Exception as exc:  # noqa: BLE001 - every trainer rank must hear of it
            failure = exc
        own = lockstep.drain()  # keep the others' gathers matched to the end
        if own is not None and failure is None:
            failure = errors.SourceError(f"{type(own).__name__}: {own}")
        if failure is None:
            report = RankReport(sender=True)
        else:
            again = isinstance(failure, errors.SyncError) and resend is not None and resend(failure)
            report = errors.report_exception(failure, sender=True, resend=again)
        reports = self.channel.agree(report, "trainer status")
        if failure is not None:
            raise failure
        errors.raise_if_any(reports, self.rank, where)
        self.version = version
        metrics.sending = GATHER
        return metrics

    def _follow(self, lockstep: _Lockstep, version: int, where: str) -> SyncMetrics:
        start = time.perf_counter()
        self._gate(lockstep, None, where)  # raises on every rank if the receivers refused
        own = lockstep.drain()
        report = RankReport() if own is None else errors.report_exception(own, sender=False)
        errors.raise_if_any(self.channel.agree(report, "trainer status"), self.rank, where)
        self.version = version
        tensors = len(list(lockstep.metadata()))
        return SyncMetrics(
            version=version, tensors=tensors, gather_s=lockstep.gather_s, total_s=time.perf_counter() - start, sending=GATHER
        )

    def close(self) -> None:
        """Free the sending rank's transport's buffers (the groups are their owners'); nothing elsewhere."""
        if self.sender is not None:
            self.sender.close()

