"""`WeightSync`: push a trainer's weights into one or more live vLLM engines through hal.

    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from hal.integrations.vllm_client import OfflineEngine, WeightSync
    sync = WeightSync([OfflineEngine(llm), HTTPVLLMWeightSyncClient("http://127.0.0.1:8000")])
    sync.init()                                   # once: the group is reused by every sync
    result = sync.sync(model, version=step)       # start / update (+ send) / finish / reset cache
    sync.close()

Each engine is driven through vLLM's native weight-update API: through vLLM's own clients
(`HTTPVLLMWeightSyncClient`, `RayVLLMWeightSyncClient`, or any `VLLMWeightSyncClient`)
or, where vLLM has none, hal's adapters (hal.integrations.vllm_engines). The engine-side
`update_weights` call blocks until the workers have received and applied everything, so it
runs in a background thread while this thread runs the hal `Sender`; both are bounded by a
timeout and any failure on either side fails the sync with an error that names the engine.

A sharded trainer (FSDP2) either gathers and sends from one rank (`trainer_group=g`: this
process sends, the other ranks follow with `TrainerSync`), or sends from every rank
(`trainer_group=g, senders="all"`, on every rank): each rank sends only its own rows over
a group of its own with every engine worker, and the workers put whole tensors together
(`hal.sync.sharded`; docs/vllm.md, "Every trainer rank sends").

The weight version is the trainer's step: the engine reports it afterwards
(`get_weight_version`), and a version older than the engine's is refused. A sync that
fails part-way leaves each engine tensor with its old or its new bytes; an engine left
holding some of each reports the weight version `inconsistent:<last complete version>`
until a complete sync lands, and `WeightSync.sync` resends once by default when the
failure was the trainer's own (its source raised; `resend_after_failure`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import asdict
from typing import Any, Sequence

import hal
from hal import env
from hal.integrations import vllm_internals
from hal.integrations._shared import SyncResult, in_daemon_thread, keep_stdout, result_within
from hal.integrations.vllm import TRANSPORTS, HalInitInfo, dtype_name
from hal.integrations.vllm_canary import CanaryChecks
from hal.integrations.vllm_engines import Engine, as_engine
from hal.integrations.vllm_sharded_sync import EveryRankSends
from hal.procs import free_port
from hal.sync import AuthError, Sender, ShardedSender, SyncConfig, SyncError, SyncMetrics
from hal.sync.auth import init_proof
from hal.sync.errors import PeerError
from hal.sync.group import RendezvousServer, SyncGroupSpec, destroy_sync_group, join_sync_group
from hal.sync.protocol import GroupChannel
from hal.sync.source import as_source
from hal.sync.trainer import TrainerSync

logger = logging.getLogger(__name__)

# What an engine holding some tensors of a failed sync and old ones for the rest reports
# as its weight version, followed by the last version it held completely.
INCONSISTENT_PREFIX = "inconsistent:"

SENDERS = ("one", "all")  # this process (the others follow: TrainerSync), or every trainer rank its own rows


class WeightSync(EveryRankSends, CanaryChecks):
    """Drives hal syncs from this (trainer) process into `engines`.

    Each of `engines` is a vLLM weight-sync client (`HTTPVLLMWeightSyncClient(base_url)`,
    `RayVLLMWeightSyncClient(actor)`: taken as an engine of one worker; wrap it in
    `ClientEngine(client, num_workers=...)` for more) or an `Engine` (`OfflineEngine(llm)`,
    `ExtensionEngine(llm)`, `ClientEngine`, your own); anything else is refused naming what
    to pass. The trainer is rank 0 of one group that joins it with every worker of every engine;
    the group's collective backend is `hal.current().dist_backend`. `config` is passed to
    the `Sender` as given (bucket size from free memory and the largest tensor when it
    says None). `token` (default: `VERL_HAL_SYNC_TOKEN`) is proven to engines started
    with one. After a sync that failed on the trainer's side (its source raised, a pack
    failed) and left some engine holding part of it, the sync is sent again up to
    `resend_after_failure` times (0: raise the first failure as it is).

    A sharded trainer: `trainer_group=g` alone makes this process its sending rank (the
    others call `TrainerSync(transport=None, ...)`); `trainer_group=g, senders="all"`, made
    and called the same way on every rank of `g`, makes every rank send its own rows
    (`hal.sync.ShardedSender`) over a group of its own with every engine worker: each rank
    serves that group's rendezvous on its own `master_address` (and `master_port`, else a
    free one), trainer rank 0 alone drives the engines, and `init`, `sync` and `close`
    return or raise the same on every rank. The other ranks pass the same `engines` (never
    called: checked against rank 0's names and sizes) or none, `[]` (they learn them from
    rank 0 at `init`). Over the "broadcast" transport only.

    `canary` (a `hal.sync.canary.CanaryConfig` or `Canary`; off by default): every few
    completed syncs, the engines' log-probs on a fixed probe are compared with the
    trainer's (hal.integrations.vllm_canary, docs/canary.md); the result is
    `SyncResult.canary`, and in "enforce" mode an engine that differs raises `CanaryError`.
    """

    def __init__(
        self,
        engines: Sequence[Any],
        *,
        config: SyncConfig | None = None,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        timeout_s: float = 120.0,
        transport: str = "auto",
        token: str | None = None,
        resend_after_failure: int = 1,
        trainer_group: Any = None,
        senders: str = "one",
        canary: Any = None,
    ) -> None:
        if transport != "auto" and transport not in TRANSPORTS:
            raise ValueError(f"transport must be 'auto' or one of {sorted(TRANSPORTS)}, got {transport!r}")
        if senders not in SENDERS:
            raise ValueError(f"senders must be one of {list(SENDERS)}, got {senders!r}")
        if senders == "all":
            if trainer_group is None:
                raise ValueError("senders='all' needs trainer_group=...: the ranks that hold the model, each of which sends its own rows")
            if transport not in ("auto", "broadcast"):
                raise ValueError(f"senders='all' sends over the 'broadcast' transport (a group per trainer rank), got transport={transport!r}")
        if not engines and senders != "all":  # with senders="all" the ranks but 0 may learn them from rank 0
            raise ValueError("WeightSync needs at least one engine")
        engines = [as_engine(e) for e in engines]
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        if isinstance(resend_after_failure, bool) or not isinstance(resend_after_failure, int) or resend_after_failure < 0:
            raise ValueError(f"resend_after_failure must be an int >= 0, got {resend_after_failure!r}")
        if config is not None and not isinstance(config, SyncConfig):
            raise TypeError(f"config must be a SyncConfig, got {type(config).__name__}")
        self.engines: list[Engine] = engines
        self.config = config if config is not None else SyncConfig()
        self.master_address = master_address
        self.master_port = master_port
        self.timeout_s = timeout_s
        self.transport = transport
        """"auto": "ipc" when every engine is on this node and the backend shares memory
        between processes (`supports_ipc`), else "broadcast"."""
        self.token = token if token is not None else env.sync_token()
        self.resend_after_failure = resend_after_failure
        self.trainer_group = trainer_group
        """The sharded trainer's own group, when the trainer is several ranks: this process is
        its sending rank, and every other rank calls `TrainerSync(transport=None, ...).sync`
        with the same source and version in lockstep (docs/topologies.md); with
        senders="all", every rank of it sends."""
        self.senders = senders
        """"one": this process sends; "all": every rank of `trainer_group` sends its own rows."""
        self._trainer: TrainerSync | None = None
        self._sharded: ShardedSender | None = None
        self._channel: GroupChannel | None = None  # senders="all": the trainer group, for init's and each sync's agreements
        self._attempt = 0
        self._group: Any = None
        self._sender: Sender | None = None
        self._ranks: dict[str, range] = {}
        self._sizes: list[tuple[str, int]] | None = None  # senders="all": every engine's (name, workers), as rank 0 has them
        self._connected: set[str] = set()  # engines whose init returned: only those are shut down by close()
        self.version: int | None = None
        self.inconsistent: set[str] = set()
        """Engines holding part of a failed sync (some tensors new, some old), by name."""
        self._set_canary(canary)  # hal.integrations.vllm_canary

    @property
    def world_size(self) -> int:
        """Ranks in the sync group (of each trainer rank's, with senders="all"): 1 + every engine's workers."""
        sizes = self._sizes if self._sizes is not None else [(e.name, e.num_workers) for e in self.engines]
        return 1 + sum(n for _, n in sizes)

    @property
    def sender(self) -> Sender:
        """The hal `Sender` this sync drives (after `init`): it holds `self.config` itself."""
        if self._sender is None:
            raise RuntimeError("WeightSync.sender before init()")
        return self._sender

    @property
    def trainer_rank(self) -> int:
        """This process's rank in `trainer_group` with senders="all" (after `init`); 0 otherwise."""
        return self._channel.rank if self._channel is not None else 0

    def init(self) -> None:
        """Join every engine's workers into one group with this process (once). With
        senders="all", on every trainer rank: each joins a group of its own with them."""
        with keep_stdout():
            if self.senders == "all":
                self._init_all()
            else:
                self._init()

    def _init(self) -> None:
        if self._group is not None:
            raise RuntimeError("WeightSync.init called twice")
        vllm_internals.require_supported_vllm()
        backend = hal.current()
        if self.transport == "auto":
            local = all(e.same_node for e in self.engines)
            self.transport = "ipc" if local and backend.supports_ipc else "broadcast"
        port = self.master_port or free_port(self.master_address)
        # rank 0 serves the rendezvous on master_address only (vLLM's helper, which the
        # workers use to join, would listen on every interface: hal.sync.group), from now on
        spec = SyncGroupSpec(address=self.master_address, port=port, world_size=self.world_size)
        server = RendezvousServer(spec, timeout_s=self.timeout_s)
        calls = self._init_engines(port)
        group_call = in_daemon_thread(
            "hal-trainer: join the weight-sync group",
            lambda: join_sync_group(spec, 0, backend=backend.dist_backend, timeout_s=self.timeout_s, server=server),
        )
        try:
            self._join(group_call, calls, port)
        except BaseException:
            # an engine refused or the join failed: close the rendezvous, so that the join
            # thread ends now and the port is free, instead of both lasting until the timeout
            server.close()
            raise
        control = backend.control_device()
        transport = TRANSPORTS[self.transport](self._group, src=0, control_device=control)
        if self.trainer_group is not None:
            self._trainer = TrainerSync(transport=transport, config=self.config, trainer_group=self.trainer_group, token=self.token)
            self._sender = self._trainer.sender
        else:
            self._sender = Sender(transport, self.config, token=self.token)

    def _init_engines(self, port: int, senders: list[dict[str, Any]] | None = None) -> list:
        """Ask every engine, each in a thread of its own, to join (`init_weight_transfer_engine`);
        the (what, future) of each call."""
        calls = []
        offset = 1
        for engine in self.engines:
            info = HalInitInfo(
                master_address=self.master_address,
                master_port=port,
                rank_offset=offset,
                world_size=self.world_size,
                wire_dtype=dtype_name(self.config.wire_dtype),
                timeout_s=self.config.timeout_s,
                transport=self.transport,
                senders=senders,
            )
            if self.token is not None:  # bound to every field, this engine's rank offset and the senders included
                info.auth = init_proof(self.token, **info.proven())
            self._ranks[engine.name] = range(offset, offset + engine.num_workers)
            offset += engine.num_workers
            payload = asdict(info)
            what = f"{engine.name}: init_weight_transfer_engine"
            calls.append((what, in_daemon_thread(f"hal-{what}", lambda e=engine, p=payload: e.init_weight_transfer_engine(p))))
        return calls

    def _finish(self, version: int) -> dict[str, str]:
        """After a complete sync: each engine records the version, drops KV computed with the
        old weights and reads the version back."""
        versions = {}
        for engine in self.engines:
            engine.finish_weight_update(str(version))
            # KV computed with the old weights must not be reused (prefix caching)
            engine.reset_prefix_cache()
            versions[engine.name] = engine.get_weight_version()
        return versions

    def _join(self, group_call: "concurrent.futures.Future[Any]", calls: list, port: int) -> None:
        """Wait for the group and every engine's init. An engine that refuses (bad init info,
        a wrong token, already connected) fails the init at once."""
        deadline = time.monotonic() + self.timeout_s
        pending = {group_call, *(f for _, f in calls)}
        while not group_call.done() and time.monotonic() < deadline:
            for what, call in calls:
                if call.done():
                    self._engine_result(call, what)
            pending = concurrent.futures.wait(pending, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)[1]
        try:
            self._group = result_within(group_call, "trainer: join the weight-sync group", max(0.0, deadline - time.monotonic()))
        except Exception as exc:
            for what, call in calls:
                if call.done():
                    self._engine_result(call, what)  # an engine-side error explains the failure better
            raise PeerError(f"trainer could not join the weight-sync group at {self.master_address}:{port}: {exc}") from exc
        for (what, call), engine in zip(calls, self.engines):
            self._engine_result(call, what, self.timeout_s)
            self._connected.add(engine.name)

    @staticmethod
    def _engine_result(call: "concurrent.futures.Future[Any]", what: str, timeout: float = 0.0) -> Any:
        try:
            return result_within(call, what, timeout)
        except SyncError:
            raise
        except Exception as exc:
            # Through collective_rpc or HTTP the type is lost: vLLM's worker processes pass on
            # only the message, and every init refusal (check_init_proof) names the variable.
            text = f"{type(exc).__name__}: {exc}"
            if "AuthError" in text or env.VERL_HAL_SYNC_TOKEN in text:
                raise AuthError(f"{what}: {exc}") from exc
            raise

    def sync(self, source: Any, version: int) -> SyncResult:
        """Send `source` (a module, a hal source, a dict or list of pairs) as `version`.

        Returns when every engine serves the new weights and reports `version`. Raises the
        sync's `SyncError` otherwise, after resending a trainer-side failure that left an
        engine inconsistent (see the class doc); `self.inconsistent` then names the engines
        that hold part of it, and they report `inconsistent:<version>` as weight version.
        With a canary (`canary=`) due at this sync, its report is `result.canary`; in
        "enforce" mode an engine that computes other log-probs than the trainer raises
        `CanaryError` after the sync completed (the engines hold the new version).
        """
        if self._sender is None:
            raise RuntimeError("WeightSync.sync before init()")
        if not isinstance(version, int) or isinstance(version, bool):
            raise TypeError(f"version must be an int (the trainer step), got {version!r}")
        source = as_source(source)
        start = time.perf_counter()
        if self._sharded is not None:  # every trainer rank sends (hal.integrations.vllm_sharded_sync)
            metrics, versions, attempt = self._sync_all(source, version)
            self.version = version
            self.inconsistent.clear()
            result = SyncResult(version=version, seconds=time.perf_counter() - start, metrics=metrics, engine_versions=versions, resent=attempt > 0)
            self._check_canary(source, version, result)  # hal.integrations.vllm_canary: after the sync, not timed in it
            return result
        attempt = self._attempt = 0
        while True:
            try:
                metrics = self._sync_once(source, version)
                break
            except SyncError as exc:
                if self._resends(exc):
                    attempt = self._attempt = attempt + 1
                    logger.warning(
                        "hal sync of version %d failed on the trainer and left %s inconsistent; sending it again (%d of %d): %s",
                        version, sorted(self.inconsistent), attempt, self.resend_after_failure, exc,
                    )
                    continue
                raise
        versions = self._finish(version)
        self.version = version
        self.inconsistent.clear()
        result = SyncResult(version=version, seconds=time.perf_counter() - start, metrics=metrics, engine_versions=versions, resent=attempt > 0)
        self._check_canary(source, version, result)  # hal.integrations.vllm_canary: after the sync, not timed in it
        return result

    def _resends(self, exc: SyncError) -> bool:
        """Whether a failed attempt is sent again: the trainer's own failure that left an
        engine holding part of it, with attempts left."""
        return self._attempt < self.resend_after_failure and exc.trainer_side and bool(exc.inconsistent_ranks)

    def _sync_once(self, source: Any, version: int) -> SyncMetrics:
        for engine in self.engines:
            engine.start_weight_update()
        calls = [
            (f"{e.name}: update_weights", in_daemon_thread(f"hal-{e.name}-update", lambda e=e: e.update_weights({"version": version})))
            for e in self.engines
        ]
        try:
            if self._trainer is not None:
                metrics = self._trainer.sync(source, version=version, resend=self._resends)
            else:
                metrics = self._sender.send(source, version=version)
        except SyncError as exc:
            # the engines fail the same sync; their message is usually the precise one
            problems = []
            for what, call in calls:
                try:
                    result_within(call, what, self.timeout_s)
                except BaseException as engine_exc:  # noqa: BLE001
                    problems.append(f"{what}: {engine_exc}")
            self._mark_inconsistent(exc)
            if problems:
                raise type(exc)(f"{exc} | " + " | ".join(problems), reports=exc.reports, my_rank=exc.my_rank) from exc
            raise
        for what, call in calls:
            result_within(call, what, self.timeout_s)
        return metrics

    def _mark_inconsistent(self, exc: BaseException, *, call_engines: bool = True) -> None:
        """Record, and make each engine report, that it holds part of a failed sync."""
        ranks = set(exc.inconsistent_ranks) if isinstance(exc, SyncError) else set()
        marked = {name for name, held in self._ranks.items() if ranks.intersection(held)}
        self.inconsistent |= marked
        if not call_engines:
            return
        for engine in self.engines:
            if engine.name not in marked:
                continue
            label = f"{INCONSISTENT_PREFIX}{'none' if self.version is None else self.version}"
            try:
                engine.update_weight_version(label)
            except Exception as version_exc:  # noqa: BLE001 - the sync's own error is the one to raise
                logger.warning("engine %s: could not set its weight version to %r: %s", engine.name, label, version_exc)

    def close(self) -> None:
        """Release the group on both sides; the engines keep serving. With senders="all", on
        every trainer rank (rank 0 shuts the engines' side down, each rank its own group)."""
        group, sender = self._group, self._sender
        self._group, self._sender = None, None
        self._sharded, self._trainer, self._channel = None, None, None
        for engine in self.engines:
            if engine.name not in self._connected:
                continue  # never connected to us (a refused init): it may serve another trainer
            self._connected.discard(engine.name)
            try:
                engine.shutdown_weight_transfer_engine()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        if sender is not None:
            sender.transport.close()
        if group is not None:
            try:
                destroy_sync_group(group)
            except Exception:  # noqa: BLE001
                pass

    def __enter__(self) -> "WeightSync":
        if self._group is None:
            self.init()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

