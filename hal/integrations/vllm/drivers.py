"""How `WeightSync` sends: its drivers, over the engines it drives (hal.integrations.vllm.engine_calls).

A `WeightSync` holds one driver, by which trainer ranks send (hal.sync.endpoints.SENDING):

- `OneSender` ("one"): this process joins one group with every engine worker and sends;
- `GatherThenSend` ("gather"): the same group, and the trainer's other ranks gather in
  lockstep with this one (they call `TrainerSync(transport=None, ...)`);
- `EveryRankSends` ("all", hal.integrations.vllm.sharded_sync): every trainer rank joins a
  group of its own with every engine worker and sends its own rows.

Each is a `Driver`, which says only what differs: how its rank joins its group with the
engines (`join`, a `hal.sync.TrainerSide`), and one try of one sync (`attempt`: the
engines' start / update / finish around this rank's `SyncSender.sync`) where that is not
the common one. `WeightSync.sync` owns the one resend loop around `attempt`;
`fold_engine_errors` (engine_calls) is the one place an engine's failed call is joined to
the sync's error. Imports vLLM only through hal.integrations.vllm.info.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import hal
from hal.backends.interface import Backend
from hal.integrations.vllm import internals as vllm_internals
from hal.integrations.vllm import shard_sync
from hal.integrations.vllm.engine_calls import EngineCalls, Settings, fold_engine_errors
from hal.procs import free_port
from hal.sync import Sender, SyncError, SyncMetrics, SyncSender, TrainerSide
from hal.sync.config import GATHER, ONE
from hal.sync.plan.exchange import ReceiveChoice
from hal.sync.wire import GroupChannel, SyncGroupSpec, destroy_sync_group


def release_group(group: Any) -> None:
    """Destroy a sync group at teardown; a failure is no reason to fail the close."""
    try:
        destroy_sync_group(group)
    except Exception:  # noqa: BLE001 - best effort at teardown
        pass


class Driver:
    """What every driver of a `WeightSync` is (see the module doc). Each subclass says who
    sends (`sending`, hal.sync.endpoints.SENDING) and how this rank joins its sync group with
    the engines (`join`); and, where one try of a sync differs, `attempt`.

    `init` joins, then makes this rank's sending side (a `SyncSender`) over the group
    (`TrainerSide.open`); `close` releases both (`WeightSync` shuts the engines down)."""

    sending: ClassVar[str]
    trainer_channel: GroupChannel | None = None
    """The trainer group's channel, where the trainer ranks agree (every rank sends, after `init`)."""

    def __init__(self, settings: Settings, engines: EngineCalls) -> None:
        self.settings = settings
        self.engines = engines
        self.group: Any = None
        self.sender: SyncSender | None = None
        """This rank's sending side (hal.sync.endpoints.make_sender, or over links:
        hal.integrations.vllm.shard_sync) after `init`."""
        self.gathering: Any = None
        """The engine workers' needs, gathered in this rank's group while they initialise (`join`)."""
        self.receive_choice: ReceiveChoice | None = None
        """Whether the workers receive only their shards (after `init`), or whole tensors and why."""

    @property
    def shard(self) -> bool:
        """Whether each engine worker receives only its own pieces (after `init`)."""
        return self.receive_choice is not None and self.receive_choice.shard

    @property
    def trainer_rank(self) -> int:
        """This process's rank in the trainer group (0 where only this process drives the sync)."""
        return self.trainer_channel.rank if self.trainer_channel is not None else 0

    @property
    def drives_engines(self) -> bool:
        """Whether this rank calls the engines (trainer rank 0 only)."""
        return self.trainer_rank == 0

    @property
    def core_sender(self) -> Sender | None:
        """The hal `Sender` that holds this rank's transport (after `init`)."""
        return self.sender

    def init(self) -> None:
        settings = self.settings
        if self.group is not None or self.trainer_channel is not None:
            raise RuntimeError("WeightSync.init called twice")
        vllm_internals.require_supported_vllm()
        backend = hal.current()
        side = self.join(backend)
        self.group = side.group
        choice = self.receive_choice = shard_sync.choice_of(self.gathering, settings.asked, timeout_s=settings.timeout_s)
        if choice.shard:
            self.sender = shard_sync.link_sender(self.sending, side.group, choice.needs, settings, backend)
            return
        self.sender = side.open(
            self.sending, settings.transport, config=settings.config, trainer_group=settings.trainer_group, token=settings.token
        )

    def join(self, backend: Backend) -> TrainerSide:
        """This rank's side of its sync group, joined with every engine's workers."""
        raise NotImplementedError

    def send(self, source: Any, version: int, resend: Callable[[SyncError], bool]) -> SyncMetrics:
        """This rank's part of one try (`resend`: whether a failed try is sent again)."""
        return self.sender.sync(source, version=version)

    def attempt(self, source: Any, version: int, resend: Callable[[SyncError], bool]) -> tuple[SyncMetrics, dict[str, str]]:
        """One try: the engines start (a refusal raises before anything is sent), update in
        threads while this process sends, and finish; (metrics, the engines' versions).
        Raises the sync's error with what the engines said folded in."""
        engines = self.engines
        calls = engines.start(version)
        try:
            metrics = self.send(source, version, resend)
        except SyncError as exc:
            raise fold_engine_errors(exc, engines.wait(calls)) from exc  # the engines fail the same sync
        failed = fold_engine_errors(None, engines.wait(calls))
        if failed is not None:
            raise failed
        return metrics, engines.finish(version)

    def close(self) -> None:
        """Release this rank's transport and group (the engines are shut down by `WeightSync`)."""
        group, sender = self.group, self.sender
        self.group, self.sender, self.trainer_channel = None, None, None
        if sender is not None:
            sender.close()
        if group is not None:
            release_group(group)


class OneSender(Driver):
    """This process sends ("one"): one group with every engine worker, this process its rank 0."""

    sending = ONE

    def join(self, backend: Backend) -> TrainerSide:
        settings, engines = self.settings, self.engines
        if settings.transport == "auto":
            local = all(e.same_node for e in engines.engines) and settings.receive != shard_sync.SHARD
            settings.transport = "ipc" if local and backend.supports_ipc else "broadcast"
        settings.asked = shard_sync.asked_receive(settings.receive, sending=self.sending, transport=settings.transport,
                                                  sizes=engines.sizes, delta=settings.config.delta is not None)
        port = settings.master_port or free_port(settings.master_address)
        # rank 0 serves the rendezvous on master_address only (vLLM's helper, which the
        # workers use to join, would listen on every interface: hal.sync.wire.group), from now on
        spec = SyncGroupSpec(address=settings.master_address, port=port, world_size=engines.world_size)
        side = TrainerSide(spec, backend=backend, timeout_s=settings.timeout_s)
        calls = engines.ask_to_join(port)
        joining = side.join()
        self.gathering = shard_sync.gather_needs(joining, self.settings, backend=backend, rank=self.trainer_rank)
        try:
            engines.join(joining, calls, port)
        except BaseException:
            # an engine refused or the join failed: close the rendezvous, so that the join
            # thread ends now and the port is free, instead of both lasting until the timeout
            side.close()
            raise
        return side

    @property
    def core_sender(self) -> Sender | None:
        return self.sender.sender if self.shard and self.sender is not None else self.sender

    def attempt(self, source: Any, version: int, resend: Callable[[SyncError], bool]) -> tuple[SyncMetrics, dict[str, str]]:
        """As `Driver.attempt`; over links the plan is made first: a source the plan cannot be
        made of (a tensor the workers need missing, another dtype) is refused before any
        engine hears of the sync."""
        if not self.shard:
            return super().attempt(source, version, resend)
        agreed = self.sender.agree_shares(source)
        if agreed.refused is not None:
            raise agreed.refused
        return super().attempt(agreed, version, resend)

    def send(self, source: Any, version: int, resend: Callable[[SyncError], bool]) -> SyncMetrics:
        if self.shard:  # `source` is the plan agreed in `attempt`
            return self.sender.send(source, version=version)
        return super().send(source, version, resend)


class GatherThenSend(OneSender):
    """The trainer's ranks gather in lockstep and this one sends ("gather"); the others call
    `TrainerSync(transport=None, ...).sync` with the same source and version."""

    sending = GATHER

    def send(self, source: Any, version: int, resend: Callable[[SyncError], bool]) -> SyncMetrics:
        return self.sender.sync(source, version=version, resend=resend)  # the other ranks learn of a resend

    @property
    def core_sender(self) -> Sender | None:
        return None if self.sender is None else self.sender.sender
