"""`WeightSync`: push a trainer's weights into one or more live vLLM engines through hal.

    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from hal.integrations.vllm.client import OfflineEngine, WeightSync
    sync = WeightSync([OfflineEngine(llm), HTTPVLLMWeightSyncClient("http://127.0.0.1:8000")])
    sync.init()                                   # once: the group is reused by every sync
    result = sync.sync(model, version=step)       # start / update (+ send) / finish / reset cache
    sync.close()

Each engine is driven through vLLM's native weight-update API: through vLLM's own clients
(`HTTPVLLMWeightSyncClient`, `RayVLLMWeightSyncClient`, or any `VLLMWeightSyncClient`)
or, where vLLM has none, hal's adapters (hal.integrations.vllm.engines). The engine-side
`update_weights` call blocks until the workers have received and applied everything, so it
runs in a background thread while this thread runs the hal `Sender`; both are bounded by a
timeout and any failure on either side fails the sync with an error that names the engine.

Who sends is `senders` (hal.sync.SENDING): "one", this process; a sharded trainer (FSDP2)
either gathers and sends from one rank ("gather", the default with `trainer_group=g`: this
process sends, the other ranks follow with `TrainerSync`), or sends from every rank ("all",
`trainer_group=g`, on every rank): each rank sends only its own rows over a group of its
own with every engine worker, and the workers put whole tensors together
(`hal.sync.send.sharded`; docs/vllm.md, "Every trainer rank sends").

The weight version is the trainer's step: the engine reports it afterwards
(`get_weight_version`), and a version older than the engine's is refused. A sync that
fails part-way leaves each engine tensor with its old or its new bytes; an engine left
holding some of each reports the weight version `inconsistent:<last complete version>`
until a complete sync lands, and `WeightSync.sync` resends once by default when the
failure was the trainer's own (its source raised; `resend_after_failure`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from hal import env
from hal.integrations._shared import SyncResult, keep_stdout
from hal.integrations.vllm.canary import check_after_sync
from hal.integrations.vllm.drivers import Driver, GatherThenSend, OneSender
from hal.integrations.vllm.engine_calls import INCONSISTENT_PREFIX, EngineCalls, Settings
from hal.integrations.vllm.engines import Engine, as_engine
from hal.integrations.vllm.info import ENGINE_TRANSPORTS
from hal.integrations.vllm.sharded_sync import EveryRankSends
from hal.sync import SENDING, Sender, SyncConfig, SyncError
from hal.canary import DEFAULT, Canary, as_canary
from hal.sync.config import ALL, GATHER, ONE
from hal.sync.errors import check_version
from hal.sync.plan.exchange import AUTO, SHARD, check_receive
from hal.integrations.vllm.shard_sync import shard_problem
from hal.sync.wire import GroupChannel
from hal.sync.source import as_source

logger = logging.getLogger(__name__)

__all__ = ["INCONSISTENT_PREFIX", "SENDERS", "SyncResult", "WeightSync"]

SENDERS = SENDING  # who sends: this process ("one"), one rank of a sharded trainer ("gather"), every rank ("all")
DRIVERS: dict[str, type[Driver]] = {ONE: OneSender, GATHER: GatherThenSend, ALL: EveryRankSends}


class WeightSync:
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

    Who sends is `senders` (hal.sync.SENDING; None: "gather" with a `trainer_group`, else
    "one"). A sharded trainer: `trainer_group=g` (`senders="gather"`) makes this process its
    sending rank (the others call `TrainerSync(transport=None, ...)`); `trainer_group=g,
    senders="all"`, made and called the same way on every rank of `g`, makes every rank send its own rows
    (`hal.sync.ShardedSender`) over a group of its own with every engine worker: each rank
    serves that group's rendezvous on its own `master_address` (and `master_port`, else a
    free one), trainer rank 0 alone drives the engines, and `init`, `sync` and `close`
    return or raise the same on every rank. The other ranks pass the same `engines` (never
    called: checked against rank 0's names and sizes) or none, `[]` (they learn them from
    rank 0 at `init`). Over the "broadcast" transport only.

    `receive` (hal.sync.plan.exchange.RECEIVE): how each engine worker takes a sync.
    "auto" (the default): "shard" for engines of several workers that all recorded their
    needs, over the "broadcast" transport with senders "one" or "all", else "whole"
    (`receive_why` says why). "shard": each worker only its own pieces, point to point from
    the trainer rank(s) that hold them, landed straight in its layers
    (hal.integrations.vllm.shard_receive); refused at `init` by name where an engine
    worker's loaders cannot be recorded. "whole": every tensor whole, its engine's loaders
    cut out its shard (every sync before issue 41).
    docs/topologies.md says when each is used.

    `canary` (a `hal.canary.policy.CanaryConfig` or `Canary`; None: off): every few completed
    syncs, the engines' log-probs on a fixed probe are compared with the trainer's
    (hal.integrations.vllm.canary, docs/canary.md); the result is `SyncResult.canary`, and in
    "enforce" mode an engine that differs raises `CanaryError`. Not given, it is on
    (`Canary.default()`): "log" mode, the first sync and every 100th after it, of a source
    that is a module, asking the engines in this process that are awake; what it does not
    check it says once, in the log, and it never fails a sync (hal.integrations.vllm.canary_default).
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
        senders: str | None = None,
        canary: Any = DEFAULT,
        receive: str = AUTO,
    ) -> None:
        if transport != "auto" and transport not in ENGINE_TRANSPORTS:
            raise ValueError(f"transport must be 'auto' or one of {sorted(ENGINE_TRANSPORTS)}, got {transport!r}")
        if senders is None:
            senders = ONE if trainer_group is None else GATHER
        if senders not in SENDERS:
            raise ValueError(f"senders must be one of {list(SENDERS)}, got {senders!r}")
        if senders == ONE and trainer_group is not None:
            raise ValueError(
                "senders='one' sends from this process alone: with trainer_group=... pass senders='gather' (this rank "
                "sends what every rank gathers) or 'all' (every rank sends its own rows)"
            )
        if senders != ONE and trainer_group is None:
            raise ValueError(f"senders={senders!r} needs trainer_group=...: the ranks that hold the model")
        if senders == ALL:
            if transport not in ("auto", "broadcast"):
                raise ValueError(f"senders='all' sends over the 'broadcast' transport (a group per trainer rank), got transport={transport!r}")
        check_receive(receive, "receive")
        problem = shard_problem(sending=senders, transport="broadcast" if transport == "auto" else transport, delta=config is not None and config.delta is not None)
        if receive == SHARD and problem is not None:
            raise ValueError(f"receive='shard': {problem}")
        if not engines and senders != ALL:  # with senders="all" the ranks but 0 may learn them from rank 0
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
        self.token = token if token is not None else env.sync_token()
        self.resend_after_failure = resend_after_failure
        self.trainer_group = trainer_group
        """The sharded trainer's own group, when the trainer is several ranks: with
        senders="gather" this process is its sending rank, and every other rank calls
        `TrainerSync(transport=None, ...).sync` with the same source and version in lockstep
        (docs/topologies.md); with senders="all", every rank of it sends."""
        self.senders = senders
        """Who sends (hal.sync.SENDING): "one", this process; "gather", this rank of
        `trainer_group` after every rank gathered; "all", every rank of it its own rows."""
        self._settings = Settings(
            config=self.config, master_address=master_address, master_port=master_port, timeout_s=timeout_s,
            transport=transport, token=self.token, trainer_group=trainer_group, receive=receive,
        )
        self._engines = EngineCalls(engines, self._settings)
        self._driver: Driver = DRIVERS[senders](self._settings, self._engines)
        self._attempt = 0
        self.version: int | None = None
        self.inconsistent: set[str] = set()
        """Engines holding part of a failed sync (some tensors new, some old), or that may
        (a peer died or fell silent part-way, and no worker could report), by name."""
        self.canary: Canary | None = as_canary(canary)
        """The canary (hal.canary): `Canary.default()` unless told otherwise; None when off."""

    @property
    def transport(self) -> str:
        """"auto" until `init` picks: "ipc" when every engine is on this node and the backend
        shares memory between processes (`supports_ipc`), else "broadcast"."""
        return self._settings.transport

    @property
    def receive(self) -> str:
        """How the engine workers take each sync (after `init`): "shard", each only its own
        pieces; "whole", every tensor whole (`receive_why` says why, where "auto" chose it)."""
        return "shard" if self._driver.shard else "whole"

    @property
    def receive_why(self) -> str:
        """Why the engine workers take whole tensors ("" under a shard receive, or before `init`)."""
        choice = self._driver.receive_choice
        return "" if choice is None or choice.shard else choice.why

    @property
    def world_size(self) -> int:
        """Ranks in the sync group (of each trainer rank's, with senders="all"): 1 + every engine's workers."""
        return self._engines.world_size

    @property
    def sender(self) -> Sender:
        """The hal `Sender` this sync drives (after `init`): it holds `self.config` itself."""
        sender = self._driver.core_sender
        if sender is None:
            raise RuntimeError("WeightSync.sender before init()")
        return sender

    @property
    def trainer_channel(self) -> GroupChannel | None:
        """senders="all": the trainer group's channel (after `init`), for agreements of the
        caller's own (`LoraWeightSync` agrees there on what travels); None otherwise."""
        return self._driver.trainer_channel

    @property
    def trainer_rank(self) -> int:
        """This process's rank in `trainer_group` with senders="all" (after `init`); 0 otherwise."""
        return self._driver.trainer_rank

    def init(self) -> None:
        """Join every engine's workers into one group with this process (once). With
        senders="all", on every trainer rank: each joins a group of its own with them."""
        with keep_stdout():
            self._driver.init()

    def sync(self, source: Any, version: int) -> SyncResult:
        """Send `source` (a module, a hal source, a dict or list of pairs) as `version`.

        Returns when every engine serves the new weights and reports `version`. Raises the
        sync's `SyncError` otherwise, after resending a trainer-side failure that left an
        engine inconsistent (see the class doc); `self.inconsistent` then names the engines
        that hold part of it, and they report `inconsistent:<version>` as weight version.
        With senders="all", on every trainer rank: each returns or raises the same.
        With a canary (`canary=`) due at this sync, its report is `result.canary`; in
        "enforce" mode an engine that computes other log-probs than the trainer raises
        `CanaryError` after the sync completed (the engines hold the new version).
        """
        if self._driver.sender is None:
            raise RuntimeError("WeightSync.sync before init()")
        check_version(version)
        source = as_source(source)
        start = time.perf_counter()
        attempt = self._attempt = 0
        while True:
            try:
                metrics, versions = self._driver.attempt(source, version, self._resends)
                break
            except SyncError as exc:
                self._mark_inconsistent(exc)
                if self._resends(exc):
                    attempt = self._attempt = attempt + 1
                    logger.warning(
                        "hal sync of version %d failed on the trainer and left %s inconsistent; sending it again (%d of %d): %s",
                        version, sorted(self.inconsistent), attempt, self.resend_after_failure, exc,
                    )
                    continue
                raise
        self.version = version
        self.inconsistent.clear()
        result = SyncResult(version=version, seconds=time.perf_counter() - start, metrics=metrics, engine_versions=versions, resent=attempt > 0)
        self.check_canary(source, version, result)  # after the sync, not timed in it
        return result

    def check_canary(self, source: Any, version: int, result: SyncResult, *, canary: Canary | None = None, lora_request: Any = None) -> None:
        """The canary's check after a completed sync of `source` as `version`, if `canary`
        (default: this sync's own) is due: its report into `result.canary`; `CanaryError`
        (carrying `result`) in "enforce" mode when an engine differs. `lora_request`: the
        engines compute with that adapter (hal-lora's `LoraWeightSync`, which holds its own
        canary and whose source is the peft model). With senders="all", on every trainer
        rank (every rank runs the forward; rank 0 asks the engines, through the driver's
        trainer channel)."""
        check_after_sync(
            self.canary if canary is None else canary, self.engines, source=source, version=version, result=result,
            wire_dtype=self.config.wire_dtype, timeout_s=self.timeout_s, channel=self._driver.trainer_channel,
            gathering=self.senders == GATHER, lora_request=lora_request,
        )

    def _resends(self, exc: SyncError) -> bool:
        """Whether a failed attempt is sent again: the trainer's own failure that left an
        engine holding part of it, with attempts left (the same on every trainer rank)."""
        return self._attempt < self.resend_after_failure and exc.trainer_side and bool(exc.inconsistent_ranks)

    def _mark_inconsistent(self, exc: SyncError) -> None:
        """Record, and make each engine report (where this rank drives them), that it holds part of a failed sync."""
        marked = self._engines.holding_part_of(exc)
        self.inconsistent |= marked
        if self._driver.drives_engines:
            self._engines.label_inconsistent(marked, self.version)

    def close(self) -> None:
        """Release the group on both sides; the engines keep serving. With senders="all", on
        every trainer rank (rank 0 shuts the engines' side down, each rank its own group)."""
        self._engines.shut_down()
        self._driver.close()

    def __enter__(self) -> "WeightSync":
        if self._driver.sender is None:
            self.init()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
