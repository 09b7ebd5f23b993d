"""The trainer side of a sync in which every trainer rank sends: `WeightSync(engines,
trainer_group=g, senders="all")`, made and called the same way on every rank of `g`.

Each trainer rank sends only the rows it holds (`hal.sync.ShardedSender`: FSDP2 shards as
they are) over a sync group of its own with every engine worker, and each worker puts
whole tensors together from all of them (`hal.sync.ShardedReceiver`, in
hal.integrations.vllm when `HalInitInfo.senders` lists the ranks):

    init:  every rank picks a port on its own `master_address` and serves that group's
           rendezvous; the ranks exchange (address, port) over `g` (JSON through
           all-reduces, never pickled); rank 0 alone asks each engine to join, with a
           `HalInitInfo` listing every rank's rendezvous (the token's proof covers it);
           every rank joins its own group as its rank 0.
    sync:  the ranks agree on who sends which rows (a layout they disagree on is refused
           on every rank before any engine hears of it); rank 0 drives each engine's
           start / update_weights (in a thread) / finish / prefix-cache reset; every rank
           runs `ShardedSender.sync(source, version=)`; the ranks then agree on the
           outcome, so that every rank returns (with the engines' versions as rank 0 read
           them) or raises the same error, and resends the same way.

Each of those steps ends with an agreement over `g`, bounded, so that a failure on one
rank (an engine refusing, a port taken, a rendezvous nobody came to) fails every rank at
once with the same error, instead of leaving the others waiting for their timeout.
`WeightSync` (hal.integrations.vllm_weight_sync) mixes this in; nothing here is used alone.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import hal
from hal.integrations import vllm_internals
from hal.integrations._shared import in_daemon_thread, result_within
from hal.integrations.vllm_info import TRANSPORTS, check_senders
from hal.procs import free_port
from hal.sync import AuthError, ShardedSender, SyncError, SyncMetrics
from hal.sync import errors as sync_errors
from hal.sync.errors import PeerError, RankReport
from hal.sync.group import RendezvousServer, SyncGroupSpec, join_sync_group
from hal.sync.layout import declare
from hal.sync.protocol import GroupChannel, control_device_of
from hal.sync.sharded import local_tensors

logger = logging.getLogger("hal.integrations.vllm_weight_sync")

# Errors a trainer rank rebuilds from another rank's word (by class name), so that every
# rank raises the same; anything else comes back as a RuntimeError with the same message.
_REBUILT: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        SyncError, sync_errors.HeaderError, sync_errors.SpecMismatchError, sync_errors.StaleVersionError,
        sync_errors.DeltaBaseError, sync_errors.ChecksumMismatchError, AuthError, sync_errors.SourceError, PeerError,
        ValueError, TypeError, RuntimeError, TimeoutError,
    )
}
_MAX_MESSAGE = 4000


class EveryRankSends:
    """`WeightSync`'s senders="all" mode (see the module doc): the methods it adds. They
    use what `WeightSync` holds (engines, config, token, timeouts, its group and sender)
    and its shared steps (`_init_engines`, `_join`, `_finish`, `_mark_inconsistent`)."""

    def _init_all(self) -> None:
        """Every trainer rank: serve a rendezvous of its own, tell the others where (trainer
        rank 0 then asks the engines to join all of them), join it. After each step the
        ranks agree, so that all of them go on, or raise the same, together."""
        if self._group is not None or self._channel is not None:
            raise RuntimeError("WeightSync.init called twice")
        vllm_internals.require_supported_vllm()
        backend = hal.current()
        self.transport = "broadcast"
        channel = GroupChannel(self.trainer_group, control_device=control_device_of(self.trainer_group, backend))
        channel.name = "trainer group"
        self._channel = channel
        lead = channel.rank == 0
        port = self.master_port or free_port(self.master_address)
        mine = {"address": self.master_address, "port": port, "engines": [[e.name, e.num_workers] for e in self.engines]}
        try:
            with channel.bounded(self.timeout_s):
                payloads = channel.all_gather_bytes(json.dumps(mine).encode(), "weight-sync endpoints")
            senders, sizes = _senders_of(payloads)  # the same on every rank, or the same error
        except BaseException:
            self._channel = None
            raise
        self._sizes = sizes  # the world size of every group, on every rank
        offset = 1
        for name, workers in sizes:  # on every rank: which group ranks are whose (`inconsistent`)
            self._ranks[name] = range(offset, offset + workers)
            offset += workers
        spec = SyncGroupSpec(address=self.master_address, port=port, world_size=self.world_size)
        server: RendezvousServer | None = None
        try:
            server = RendezvousServer(spec, timeout_s=self.timeout_s)
            error = None
        except Exception as exc:  # noqa: BLE001 - told to every rank
            error = exc
        try:
            self._agree_init(error, "opening its rendezvous", self.timeout_s)
        except BaseException:
            if server is not None:
                server.close()
            raise
        group_call = in_daemon_thread(
            f"hal-trainer rank {channel.rank}: join the weight-sync group",
            lambda: join_sync_group(spec, 0, backend=backend.dist_backend, timeout_s=self.timeout_s, server=server),
        )
        try:
            error = None
            if lead:  # the engines are driven from here only
                try:
                    self._join(group_call, self._init_engines(port, senders), port)
                except Exception as exc:  # noqa: BLE001 - told to every rank
                    error = exc
            # the others wait here while the engines join (or refuse): their own joins end with it
            self._agree_init(error, "initialising the engines", 2 * self.timeout_s)
            if not lead:
                try:
                    self._group = result_within(group_call, f"trainer rank {channel.rank}: join the weight-sync group", self.timeout_s)
                except Exception as exc:  # noqa: BLE001 - told to every rank
                    error = exc
            self._agree_init(error, "joining its weight-sync group", 2 * self.timeout_s)
        except BaseException:
            server.close()  # a join still waiting ends now, and the port is free
            if self._group is None and group_call.done() and group_call.exception() is None:
                self._group = group_call.result()
            self.close()  # engines that joined let go of every trainer rank's group; this rank of its own
            raise
        transport = TRANSPORTS["broadcast"](self._group, src=0, control_device=backend.control_device())
        self._sharded = ShardedSender(transport, config=self.config, trainer_group=self.trainer_group, backend=backend, token=self.token)
        self._sender = self._sharded.sender

    def _agree_init(self, error: BaseException | None, what: str, bound_s: float) -> None:
        """Every trainer rank's word on one step of init; raises the first rank's error on
        every rank when any rank failed."""
        try:
            with self._channel.bounded(bound_s):
                payloads = self._channel.all_gather_bytes(b"" if error is None else _error_json(error), f"weight-sync init: {what}")
        except BaseException:
            self._channel = None
            raise
        failed = next(((r, p) for r, p in enumerate(payloads) if p), None)
        if failed is not None:
            rank, payload = failed
            self._channel = None  # init may be called again
            raise _rebuild(payload, f"WeightSync.init: trainer rank {rank}, {what}: ") from error

    def _sync_all(self, source: Any, version: int) -> tuple[SyncMetrics, dict[str, str], int]:
        """`sync` with senders="all", on every trainer rank (see the class doc): (this rank's
        metrics, the engines' versions as rank 0 read them, how many times it was resent)."""
        attempt = self._attempt = 0
        while True:
            metrics, error, versions = self._sync_all_once(source, version)
            exc, versions = self._agree_sync(error, versions, version)
            if exc is None:
                break
            self._mark_inconsistent(exc, call_engines=self.trainer_rank == 0)
            if isinstance(exc, SyncError) and self._resends(exc):
                attempt = self._attempt = attempt + 1
                logger.warning(
                    "hal sync of version %d failed on the trainer and left %s inconsistent; sending it again (%d of %d): %s",
                    version, sorted(self.inconsistent), attempt, self.resend_after_failure, exc,
                )
                continue
            raise exc from error
        return metrics, versions, attempt

    def _sync_all_once(self, source: Any, version: int) -> tuple[SyncMetrics | None, BaseException | None, dict[str, str]]:
        """One attempt on this rank: (its metrics, its error, the engines' versions (rank 0))."""
        refused = self._check_layout(source)
        if refused is not None:  # the same on every rank, before any engine was asked for anything
            return None, refused, {}
        lead = self.trainer_rank == 0
        problems: list[str] = []
        calls = []
        if lead:
            for engine in self.engines:
                try:
                    engine.start_weight_update()
                except Exception as exc:  # noqa: BLE001 - its workers do not receive: the sync fails in every group
                    problems.append(f"{engine.name}: start_weight_update: {exc}")
                    continue
                what = f"{engine.name}: update_weights"
                calls.append((what, in_daemon_thread(f"hal-{engine.name}-update", lambda e=engine: e.update_weights({"version": version}))))
        metrics, error = None, None
        try:
            metrics = self._sharded.sync(source, version=version)  # every rank, its own rows
        except Exception as exc:  # noqa: BLE001 - told to every rank (a SyncError is already the same on all)
            error = exc
        versions: dict[str, str] = {}
        if not lead:
            return metrics, error, versions
        for what, call in calls:
            try:
                result_within(call, what, self.timeout_s)
            except BaseException as exc:  # noqa: BLE001 - the engines' message is usually the precise one
                problems.append(f"{what}: {exc}")
        if problems:
            detail = " | ".join(problems)
            if isinstance(error, SyncError):
                error = type(error)(f"{error} | {detail}", reports=error.reports, my_rank=error.my_rank)
            else:
                error = SyncError(detail)
        if error is None:
            try:
                versions = self._finish(version)
            except Exception as exc:  # noqa: BLE001 - told to every rank
                error = exc
        return metrics, error, versions

    def _check_layout(self, source: Any) -> SyncError | None:
        """The trainer ranks agree on who sends which rows (`hal.sync.layout`) before the
        engines are asked to update: a layout they disagree on, or a source a rank cannot
        declare, is refused on every rank with the same error, and no engine hears of it.
        The sync itself then finds the plan made (one small all-reduce)."""
        sender = self._sharded
        declared, report = None, RankReport()
        try:
            declared = declare(local_tensors(source), sender.rank, sender.channel.world_size)
        except SyncError as exc:
            report = sync_errors.report_exception(exc, sender=True)
        except (ValueError, TypeError) as exc:
            report = RankReport(error=str(exc), kind="spec", sender=True)
        with self._channel.bounded(self.config.timeout_s):
            reports = self._channel.agree(report, "trainer ranks' declarations")
        failed = next(((r, rep) for r, rep in enumerate(reports) if rep.error), None)
        if failed is not None:
            rank, rep = failed
            return sync_errors.error_class(rep.kind)(f"trainer rank {rank}: {rep.error}", my_rank=0)
        try:
            with sender.channel.bounded(self.config.timeout_s):
                sender.layout.agree(declared)
        except SyncError as exc:  # built from every rank's declaration: the same everywhere
            return exc
        return None

    def _agree_sync(self, error: BaseException | None, versions: dict[str, str], version: int) -> tuple[BaseException | None, dict[str, str]]:
        """Every trainer rank's outcome of one attempt, on every rank: (the error every rank
        raises, None when all completed; the engines' versions as rank 0 read them)."""
        word: dict[str, Any] = {"v": versions}
        if error is not None:
            sync = error if isinstance(error, SyncError) else None
            word.update(
                e=str(error)[:_MAX_MESSAGE], t=type(error).__name__,
                s=bool(sync and sync.trainer_side), i=sync.inconsistent_ranks if sync else [], f=sync.failed_ranks if sync else [],
            )
        # the others wait here while rank 0 waits for the engines' calls and finishes them
        with self._channel.bounded(self.timeout_s + 2 * self.config.timeout_s):
            payloads = self._channel.all_gather_bytes(json.dumps(word).encode(), f"outcome of the sync of version {version}")
        try:
            words = [json.loads(p) for p in payloads]
            versions = {str(k): str(v) for k, v in dict(words[0].get("v") or {}).items()}
        except (ValueError, TypeError, AttributeError) as exc:
            return PeerError(f"sync of version {version}: a trainer rank's outcome is unreadable: {exc}"), {}
        failed = [(r, w) for r, w in enumerate(words) if w.get("e") is not None]
        if not failed:
            return None, versions
        rank, first = failed[0]  # rank 0's word first: it holds the engines' messages
        side = any(w.get("s") for _, w in failed)
        inconsistent = {int(x) for _, w in failed for x in w.get("i") or ()}
        lost = {int(x) for _, w in failed for x in w.get("f") or ()} - {0}
        reports = {0: RankReport(error=first["e"] if side else None, sender=True)}
        for worker in sorted(inconsistent | lost):
            if worker != 0:
                reports[worker] = RankReport(error="failed" if worker in lost else None, inconsistent=worker in inconsistent)
        prefix = "" if rank == 0 else f"trainer rank {rank}: "
        return _rebuild(json.dumps({"e": first["e"], "t": first.get("t")}).encode(), prefix, reports=reports), versions


def _senders_of(payloads: list[bytes]) -> tuple[list[dict[str, Any]], list[tuple[str, int]]]:
    """Every trainer rank's rendezvous and rank 0's engines, from what each rank told
    (`EveryRankSends._init_all`); the same ValueError on every rank when an entry is bad,
    rank 0 has no engines, or another rank has other ones."""
    words = []
    for rank, payload in enumerate(payloads):
        try:
            word = json.loads(payload)
            if not isinstance(word, dict) or set(word) != {"address", "port", "engines"}:
                raise ValueError("not an object of address, port, engines")
            engines = [(str(name), int(workers)) for name, workers in word["engines"]]
        except (ValueError, TypeError) as exc:
            raise ValueError(f"WeightSync.init: trainer rank {rank}'s endpoint is unreadable: {exc}") from None
        words.append((word, engines))
    sizes = words[0][1]
    if not sizes:
        raise ValueError("WeightSync.init: trainer rank 0 has no engines; it drives them: pass them there")
    for rank, (_, engines) in enumerate(words[1:], start=1):
        if engines and engines != sizes:
            raise ValueError(
                f"WeightSync.init: trainer rank {rank} was given engines {engines} (name, workers), rank 0 {sizes}: "
                "pass the same engines on every trainer rank, or none but on rank 0"
            )
    senders = [{"address": word["address"], "port": word["port"]} for word, _ in words]
    return check_senders(senders, words[0][0]["address"], words[0][0]["port"], "broadcast"), sizes


def _error_json(error: BaseException) -> bytes:
    return json.dumps({"e": str(error)[:_MAX_MESSAGE], "t": type(error).__name__}).encode()


def _rebuild(payload: bytes, prefix: str, *, reports: dict[int, RankReport] | None = None) -> BaseException:
    """The error another trainer rank told (`_error_json`), as the same class with the same
    message on every rank (`prefix` first)."""
    try:
        word = json.loads(payload)
        message, name = str(word["e"]), str(word.get("t"))
    except (ValueError, TypeError, KeyError) as exc:
        return PeerError(f"{prefix}an unreadable error report ({exc})")
    cls = _REBUILT.get(name, RuntimeError)
    if issubclass(cls, SyncError):
        return cls(prefix + message, reports=reports, my_rank=0)
    return cls(prefix + message)
