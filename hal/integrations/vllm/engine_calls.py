"""The engines one `WeightSync` drives (`EngineCalls`): where their workers sit in a sync
group, and every call a sync makes on all of them, each bounded; and what a driver is told
(`Settings`). Imports vLLM only through hal.integrations.vllm.info.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from hal import env
from hal.integrations.vllm.engines import Engine
from hal.integrations.vllm.info import HalInitInfo, dtype_name
from hal.sync import AuthError, SyncConfig, SyncError
from hal.sync.config import WaitBounds
from hal.sync.errors import PeerError
from hal.sync.wire import init_proof
from hal.threads import in_daemon_thread, result_within

logger = logging.getLogger("hal.integrations.vllm.weight_sync")

# What an engine holding some tensors of a failed sync and old ones for the rest reports
# as its weight version, followed by the last version it held completely.
INCONSISTENT_PREFIX = "inconsistent:"
LATE_CALL_BOUND_S = 10.0  # an engine's call after a failure or at close (label_inconsistent, shut_down)

Calls = list[tuple[str, "concurrent.futures.Future[Any]"]]  # (what, the call running in its own thread)


@dataclass(kw_only=True)
class Settings:
    """What one `WeightSync`'s driver is told (its arguments, as `WeightSync` checked them)."""

    config: SyncConfig
    master_address: str
    master_port: int | None
    timeout_s: float
    transport: str
    """A transport name (hal.sync.endpoints.TRANSPORTS), or "auto" until `init` picks one."""
    token: str | None
    trainer_group: Any
    receive: str = "whole"
    """How the user asked the engine workers to take each sync (hal.sync.plan.exchange.RECEIVE)."""
    asked: str = "whole"
    """What the engines are asked for at init (`shard_sync.asked_receive`), set by `join`."""

    @property
    def bounds(self) -> WaitBounds:
        """The waits of init and of each engine call (`timeout_s`); a sync's own are `config.bounds`."""
        return WaitBounds(self.timeout_s)

    @property
    def outcome_bound_s(self) -> float:
        """How long trainer ranks wait for a sync's outcome while trainer rank 0 waits for
        the engines' calls (`timeout_s`) after a sync that may itself wait behind another
        group (`config.bounds.behind_s`)."""
        return self.timeout_s + self.config.bounds.behind_s


def fold_engine_errors(error: BaseException | None, problems: list[str]) -> BaseException | None:
    """The error a sync attempt ends with, given the engines' failed calls (`problems`,
    each "<engine>: <call>: <message>"; their message is usually the precise one): the
    sync's own `SyncError` with them appended, or a `SyncError` of them alone."""
    if not problems:
        return error
    detail = " | ".join(problems)
    if isinstance(error, SyncError):
        return type(error)(f"{error} | {detail}", reports=error.reports, my_rank=error.my_rank)
    return SyncError(detail)


class EngineCalls:
    """The engines one `WeightSync` drives, where their workers sit in a sync group, and
    every call a sync makes on all of them (each call on its own thread where it blocks)."""

    def __init__(self, engines: list[Engine], settings: Settings) -> None:
        self.engines = engines
        self.settings = settings
        self.sizes: list[tuple[str, int]] = [(e.name, e.num_workers) for e in engines]
        """(name, workers) of every engine, in group-rank order (another trainer rank's, when learned)."""
        self.ranks: dict[str, range] = {}
        """Each engine's workers' ranks in the sync group."""
        self.connected: set[str] = set()
        """Engines whose init returned: only those are shut down."""
        self.place(self.sizes)

    @property
    def world_size(self) -> int:
        """Ranks in a sync group: the sending trainer rank and every engine's workers."""
        return 1 + sum(n for _, n in self.sizes)

    def place(self, sizes: list[tuple[str, int]]) -> None:
        """Every engine's workers' ranks, after the sending trainer rank (0)."""
        self.sizes, self.ranks, offset = list(sizes), {}, 1
        for name, workers in self.sizes:
            self.ranks[name] = range(offset, offset + workers)
            offset += workers

    def ask_to_join(self, port: int, rendezvous: list[dict[str, Any]] | None = None) -> Calls:
        """Ask every engine, each in a thread of its own, to join (`init_weight_transfer_engine`):
        the group at `port` of this process, or with `rendezvous` (every trainer rank sends)
        one group per trainer rank."""
        settings, calls = self.settings, []
        for engine in self.engines:
            info = HalInitInfo(
                master_address=settings.master_address,
                master_port=port,
                rank_offset=self.ranks[engine.name].start,
                world_size=self.world_size,
                wire_dtype=dtype_name(settings.config.wire_dtype),
                timeout_s=settings.config.timeout_s,
                transport=settings.transport,
                rendezvous=rendezvous,
                receive=settings.asked,
            )
            if settings.token is not None:  # bound to every field, this engine's rank offset and every rendezvous included
                info.auth = init_proof(settings.token, **info.proven())
            payload = asdict(info)
            what = f"{engine.name}: init_weight_transfer_engine"
            calls.append((what, in_daemon_thread(f"hal-{what}", lambda e=engine, p=payload: e.init_weight_transfer_engine(p))))
        return calls

    def join(self, group_call: "concurrent.futures.Future[Any]", calls: Calls, port: int) -> Any:
        """Wait for this rank's group and every engine's init; the group. An engine that
        refuses (bad init info, a wrong token, already connected) fails the init at once."""
        timeout_s = self.settings.timeout_s
        deadline = time.monotonic() + timeout_s
        pending = {group_call, *(f for _, f in calls)}
        while not group_call.done() and time.monotonic() < deadline:
            for what, call in calls:
                if call.done():
                    self.init_result(call, what)
            pending = concurrent.futures.wait(pending, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)[1]
        try:
            group = result_within(group_call, "trainer: join the weight-sync group", max(0.0, deadline - time.monotonic()))
        except Exception as exc:
            for what, call in calls:
                if call.done():
                    self.init_result(call, what)  # an engine-side error explains the failure better
            raise PeerError(f"trainer could not join the weight-sync group at {self.settings.master_address}:{port}: {exc}") from exc
        for (what, call), engine in zip(calls, self.engines):
            self.init_result(call, what, timeout_s)
            self.connected.add(engine.name)
        return group

    @staticmethod
    def init_result(call: "concurrent.futures.Future[Any]", what: str, timeout: float = 0.0) -> Any:
        """The result of an engine's init call `what`; a refusal of the token (`AuthError`)
        stays one even where a process boundary passed on only its message."""
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

    def start(self, version: int, *, problems: list[str] | None = None) -> Calls:
        """Every engine's `start_weight_update`, then its `update_weights` in a thread.
        With `problems`, an engine whose start fails is recorded there and left out;
        without, its error is raised before anything else is asked."""
        started = []
        for engine in self.engines:
            try:
                engine.start_weight_update()
            except Exception as exc:  # noqa: BLE001 - recorded when asked to, else raised as is
                if problems is None:
                    raise
                problems.append(f"{engine.name}: start_weight_update: {exc}")
                continue
            started.append(engine)
        return [
            (f"{e.name}: update_weights", in_daemon_thread(f"hal-{e.name}-update", lambda e=e: e.update_weights({"version": version})))
            for e in started
        ]

    def wait(self, calls: Calls) -> list[str]:
        """Wait for every call (each within `timeout_s`); what each that failed said."""
        problems = []
        for what, call in calls:
            try:
                result_within(call, what, self.settings.timeout_s)
            except BaseException as exc:  # noqa: BLE001 - the engines' message is usually the precise one
                problems.append(f"{what}: {exc}")
        return problems

    def finish(self, version: int) -> dict[str, str]:
        """After a complete sync: each engine records the version, drops KV computed with the
        old weights and reads the version back."""
        versions = {}
        for engine in self.engines:
            engine.finish_weight_update(str(version))
            # KV computed with the old weights must not be reused (prefix caching)
            engine.reset_prefix_cache()
            versions[engine.name] = engine.get_weight_version()
        return versions

    def holding_part_of(self, exc: BaseException) -> set[str]:
        """The engines some of whose workers hold, or may hold, part of the failed sync
        `exc`: workers that reported so; or every engine when no agreement was reached
        because a peer died or fell silent part-way (`PeerError` without reports: what each
        worker applied is not known)."""
        if isinstance(exc, PeerError) and not exc.reports:
            return set(self.ranks)
        ranks = set(exc.inconsistent_ranks) if isinstance(exc, SyncError) else set()
        return {name for name, held in self.ranks.items() if ranks.intersection(held)}

    def label_inconsistent(self, names: set[str], last_version: int | None) -> None:
        """Make each of `names` report `inconsistent:<last complete version>` as its weight version."""
        label = f"{INCONSISTENT_PREFIX}{'none' if last_version is None else last_version}"
        for engine in self.engines:
            if engine.name not in names:
                continue
            try:  # an engine that lost a worker may have died
                self._late_call(engine, "update_weight_version", lambda e=engine: e.update_weight_version(label))
            except Exception as version_exc:  # noqa: BLE001 - the sync's own error is the one to raise
                logger.warning("engine %s: could not set its weight version to %r: %s", engine.name, label, version_exc)

    def shut_down(self) -> None:
        """Every engine that joined lets go of this trainer's group(s); the engines keep
        serving. Each call is bounded (`_late_call`); a live engine lets go of a group in
        milliseconds."""
        for engine in self.engines:
            if engine.name not in self.connected:
                continue  # never connected to us (a refused init): it may serve another trainer
            self.connected.discard(engine.name)
            try:
                self._late_call(engine, "shutdown_weight_transfer_engine", engine.shutdown_weight_transfer_engine)
            except Exception as exc:  # noqa: BLE001 - best effort at teardown
                logger.warning("hal weight sync: %s: shutdown_weight_transfer_engine did not complete at close: %s", engine.name, exc)

    def _late_call(self, engine: Engine, what: str, call: Callable[[], Any]) -> Any:
        """`call` on `engine` after a failure or at close, within `LATE_CALL_BOUND_S` (or
        `timeout_s` if shorter), in a daemon thread: vLLM 0.32's client can wait forever on
        an engine that died meanwhile (a worker killed part-way through a sync), and the
        thread then stays blocked until the process exits."""
        return result_within(in_daemon_thread(f"hal-{engine.name}-{what}", call), f"{engine.name}: {what}",
                             min(LATE_CALL_BOUND_S, self.settings.timeout_s))
