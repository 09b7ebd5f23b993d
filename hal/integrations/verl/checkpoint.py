"""verl's checkpoint engine "hal": verl's trainer→rollout weight update on `hal.sync`.

verl 0.9.1 moves new weights from its trainer workers into its rollout workers through
a checkpoint engine chosen by name (`actor_rollout_ref.rollout.checkpoint_engine.backend`).
With `backend: hal`, `CheckpointEngineManager.update_weights()` drives this class on
every worker, in verl's order:

    prepare()                          every worker: where it is (node, current sync groups)
    build_topology(...)                the driver: sync ranks, the groups (reused while their
                                       members are), the transports (hal.integrations.verl.topology)
    init_process_group(**kwargs)       every worker: join its sync group(s) if they are new
    send_weights(weights, global_steps)      every trainer rank
    receive_weights(global_steps)            every rollout worker: yields (name, tensor)
    finalize()                         every worker: the canary when due (engine_kwargs["hal"]["canary"],
                                       hal.integrations.verl.canary); buckets freed, the groups kept

Who sends is `engine_kwargs["hal"]["senders"]`, in hal.sync's words (hal.sync.SENDING):

- `"gather"` (default; `"master"`, its former name, is still taken): one sync group joins
  trainer rank 0 (verl's master, which sends) and every rollout worker; the other trainer
  ranks iterate verl's weight generator in step with it (its `full_tensor()` gathers are
  collectives over the trainer's group) and send nothing (`hal.sync.TrainerSync`).
- `"all"`: every trainer rank sends its own FSDP2 shard (`hal.sync.ShardedSender`) over a
  sync group of its own with every rollout worker; each rollout worker receives from all
  of them at once and yields whole tensors (`hal.sync.ShardedReceiver`). Nothing is
  gathered: the source is the training engine's shards (hal.integrations.verl.shards;
  docs/megatron.md for verl's Megatron engine).

Either way a trainer rank holds one `hal.sync.SyncSender` and calls its `sync`; only the
source differs. `global_steps` is the weight version: a rollout worker refuses an older one
(every rank then raises `StaleVersionError`); without it the version counts up from the
last one. Every wait is bounded by `timeout_s`: a rollout worker that dies mid-sync makes
every trainer rank raise `PeerError`, and the next update builds new groups.

With `senders: gather` the names, shapes and dtypes of a sync come from verl's generator,
which declares nothing before it yields: the first sync of an engine learns them by
iterating the generator once in full (on the master each tensor is kept in host memory
until it is sent: one copy of the weights, once), every later sync streams with that
layout and checks each tensor against it; a sync whose tensors differ fails on every rank
and the next one learns the layout again. With `"all"` the trainer ranks declare their
shards from metadata each sync (`hal.sync.plan.shards`). Rollout workers accept the tensors
the trainer's header declares (verl's rollout side has no model of its own to check them
against).

With `delta`, the wire carries only the changed words (docs/delta.md); each rollout worker
keeps an image of the last sync (one model at the wire dtype, on its device) and still
yields every tensor each update, rebuilt from it: verl's server adapters hand the weights
to vLLM, whose layerwise reload re-processes a layer from all its tensors.

Where each part lives: the settings (`engine_kwargs["hal"]`; `sync_config_from`, re-exported
here) in hal.integrations.verl.settings; the topology in hal.integrations.verl.topology;
verl's generator as a hal source and hal's receive as verl's generator in
hal.integrations.verl.weights; the training engine's shards in hal.integrations.verl.shards;
the canary after an update in hal.integrations.verl.canary (`CanaryDuty`); verl's
contract and one update here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any, AsyncIterator, Callable

import torch
from verl.checkpoint_engine import CheckpointEngine

import hal
from hal import env
from hal.canary import DEFAULT, Canary, CanaryError, CanaryReport
from hal.integrations.verl import internals as verl_internals
from hal.integrations.verl.canary import CanaryDuty
from hal.integrations.verl.settings import (
    TRANSPORT_CHOICES,
    CanarySettings,
    canary_settings,
    choice,
    numeric_metrics,
    senders_setting,
    sync_config_from,
)
from hal.integrations.verl.shards import ShardSending
from hal.integrations.verl.topology import NOT_IN_GROUP, build, group_key, node_address
from hal.integrations.verl.weights import GeneratorSource, HandoffSink
from hal.sync import SyncError, SyncReceiver, SyncSender, TensorSpec, make_receiver, make_sender, open_transport
from hal.sync.config import ALL, GATHER
from hal.sync.errors import PeerError
from hal.sync.wire import LOOPBACK, SyncGroupSpec, destroy_sync_group, join_sync_group
from hal.threads import in_daemon_thread

logger = logging.getLogger(__name__)

__all__ = ["HalCheckpointEngine", "NOT_IN_GROUP", "sync_config_from"]


def _in_thread(fn: Any, *args: Any) -> "concurrent.futures.Future[Any]":
    """Run `fn(*args)` in a new daemon thread on this thread's device; a future of its result."""
    backend = hal.current()
    device = backend.current_device()

    def run() -> Any:
        backend.set_device(device)  # the current device is per thread on CUDA and NPU
        return fn(*args)

    return in_daemon_thread("hal-verl-sync", run)


class HalCheckpointEngine(CheckpointEngine):
    """verl's `CheckpointEngine` on hal.sync (see the module doc for the flow and settings)."""

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        transport: str = "auto",
        senders: str = GATHER,
        canary: Any = DEFAULT,
        **settings: Any,
    ) -> None:
        self.transport = choice("transport", transport, TRANSPORT_CHOICES)
        self.senders = senders_setting(senders)
        """Who sends (hal.sync.SENDING): "gather" or "all"."""
        self.config = sync_config_from(bucket_size, settings)
        self.canary_duty = CanaryDuty(canary_settings(canary), self.config)
        """The canary after each update (hal.integrations.verl.canary)."""
        self.is_master = bool(is_master)
        self.version: int | None = None
        """The weight version of the last sync this worker completed."""
        self.metrics: dict[str, Any] = {}
        """The last sync's `SyncMetrics.as_dict()` on this worker."""
        self.reported: dict[str, float | int] = {}
        """What the last `send_weights` returned to verl (on the trainer rank that reports)."""
        self.last_error: str | None = None
        """`"<error class>: <message>"` of the last update that failed here; None after a success."""
        self._role: str | None = None
        self._rank: int | None = None
        self._specs: list[SyncGroupSpec] = []  # the sync groups this worker is in ("all": a rollout worker's, one per trainer rank)
        self._groups: list[Any] = []
        self._links: list[Any] = []  # their transports
        self._sender: SyncSender | None = None  # every trainer rank
        self._receiver: SyncReceiver | None = None  # every rollout worker
        self._learned_specs: list[TensorSpec] | None = None  # "gather": the layout of verl's generator
        self._shards = ShardSending()  # "all": the training engine whose shards this trainer rank sends

    @property
    def canary(self) -> Canary | None:
        """The canary's state across updates (trainer ranks count and judge; rollout workers answer); None when off."""
        return self.canary_duty.canary

    @property
    def canary_settings(self) -> CanarySettings:
        """`engine_kwargs["hal"]["canary"]` (hal.integrations.verl.settings.CanarySettings)."""
        return self.canary_duty.settings

    @property
    def canary_report(self) -> CanaryReport | None:
        """The last check's report on a trainer rank (hal.integrations.verl.canary)."""
        return self.canary_duty.report

    # ---- topology ---------------------------------------------------------------------
    def _group_report(self) -> Any:
        if not self._specs:
            return None
        if self.senders == GATHER:
            return group_key(self._specs[0])
        return tuple(group_key(s) for s in self._specs)

    def prepare(self) -> dict[str, Any]:
        """What `build_topology` needs of this worker: its node, the sync groups it is in, and
        on a sender (the master; with senders "all" every worker, since only the driver knows
        which are trainers) where a new group's rendezvous can listen."""
        metadata: dict[str, Any] = {
            "master": self.is_master,
            "senders": self.senders,
            "node": env.node_key(),
            "group": self._group_report(),
            "rank": self._rank,
        }
        if self.is_master or self.senders == ALL:
            from hal.procs import free_port

            backend = hal.current()
            address = node_address()
            metadata.update(
                address=address,
                port=free_port(address),
                local_port=free_port(LOOPBACK),
                transport=self.transport,
                # Shared memory in host files (cpu, sim) works between any processes of a
                # node; device IPC between Ray actors needs every actor to see every device
                # (RAY_EXPERIMENTAL_NOSET_*), which verl's trainer workers do not: opt in.
                host_ipc=bool(backend.supports_ipc and not backend.supports_device_memory_ipc()),
            )
        if self.senders == ALL:
            engine = verl_internals.training_engine(verl_internals.owning_worker(self))
            metadata["refused"] = self._shards.check(engine) if engine is not None else None
        return metadata

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """The sync groups, ranks and transports (hal.integrations.verl.topology): with senders
        "gather" trainer rank 0 and every rollout worker; with "all" one group per trainer
        rank with every rollout worker. Kept while every member still reports them under the
        same rank; a new group meets at its sender (on 127.0.0.1 when all its members are on
        that node). A refusal `prepare` found ("all") is raised here, naming the trainer rank."""
        return build(actor_wg_world_size, rollout_world_size, metadata)

    def init_process_group(
        self,
        *,
        role: str,
        rank: int,
        reuse: bool,
        spec: SyncGroupSpec | None = None,
        transport: str | None = None,
        specs: list[SyncGroupSpec] | None = None,
        transports: list[str] | None = None,
    ) -> None:
        """Join the sync group(s) as `rank`, unless `reuse` says this worker is in them already:
        `spec` / `transport` with senders "gather" (trainer ranks other than 0 only set up
        their lockstep), `specs` / `transports` with "all" (a trainer rank its own group, a
        rollout worker one per trainer rank, in trainer-rank order)."""
        if specs is None:
            specs, transports = ([] if rank == NOT_IN_GROUP else [spec]), [transport]
        joined = (self._sender if role == "trainer" else self._receiver) is not None
        if reuse and joined and (self._role, self._rank) == (role, rank):
            return  # every member keeps its groups, and the trainer ranks their lockstep
        self._drop_group()
        backend = hal.current()
        self._role, self._rank = role, rank
        control = backend.control_device()
        for group_spec, name in zip(specs, transports):  # in one order on every worker: each join waits for its group
            self._groups.append(join_sync_group(group_spec, rank, backend=backend, timeout_s=self.config.timeout_s))
            self._specs.append(group_spec)
            self._links.append(open_transport(name, self._groups[-1], control_device=control))
        token = env.sync_token()
        if role == "trainer":
            # "gather": trainer rank 0 sends what every trainer rank gathers with it (the others: no transport)
            link = self._links[0] if self._links else None
            self._sender = make_sender(self.senders, link, config=self.config, backend=backend, token=token)
        else:
            # verl's rollout side has no model to check the trainers' tensors against: the
            # receiver takes what the headers declare (each still decoded and checked itself);
            # a stale version stays refused across new groups
            self._receiver = make_receiver(
                self.senders, self._links, None, timeout_s=self.config.timeout_s, token=token, backend=backend, version=self.version
            )

    def _drop_group(self) -> None:
        for link in self._links:
            link.close()
        for group in self._groups:
            destroy_sync_group(group)
        self._groups, self._links, self._specs = [], [], []
        self._sender = self._receiver = None
        self._rank = None

    def finalize(self) -> None:
        """After a completed update (verl calls it on every worker once every trainer rank
        sent and every rollout worker's server adapter loaded the weights): the canary, when
        on and due (hal.integrations.verl.canary); then free the bucket buffers (the groups
        stay for the next update). In "enforce" mode a canary that fires raises
        `CanaryError` here on every trainer rank, naming the rollout worker."""
        try:
            worker = verl_internals.owning_worker(self)  # on verl's thread: it reads the callers
            rollouts = self._links[0].channel if self._links else None
            self.canary_duty.check(self._role, rollouts, worker=worker, engine=self._shards.found(worker))
        except CanaryError as exc:
            self.last_error = f"CanaryError: {exc}"
            raise
        finally:
            for link in self._links:
                link.close()
            hal.current().empty_cache()

    # ---- one update ---------------------------------------------------------------------------
    def _next_version(self, global_steps: int | None) -> int:
        if global_steps is None:
            return 0 if self.version is None else self.version + 1
        if isinstance(global_steps, bool) or not isinstance(global_steps, int):
            raise ValueError(f"checkpoint engine 'hal': global_steps must be an int or None, got {global_steps!r}")
        return global_steps

    def state(self) -> dict[str, Any]:
        """This worker's side, for logs and tests (through verl's `execute_checkpoint_engine`).
        With senders "all", `group` and `transport` are tuples, one per sync group."""
        names = tuple(link.name for link in self._links)
        return {
            "role": self._role,
            "senders": self.senders,
            "sync_rank": self._rank,
            "version": self.version,
            "group": self._group_report(),
            "transport": names if self.senders == ALL else (names[0] if names else None),
            "last_error": self.last_error,
            "metrics": dict(self.metrics),
            "reported": dict(self.reported),
            "canary": self.canary_report.as_dict() if self.canary_report is not None else None,
        }

    def _failed(self, exc: SyncError) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, PeerError):  # a group may be broken: the next update builds new ones
            self._drop_group()

    @torch.no_grad()
    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Every trainer rank: sync the weights as version `global_steps`: with senders
        "gather" verl's weight generator, with "all" this rank's shards of the training
        engine (`weights` when verl passes the engine, else its worker's; the generator is
        closed unread, so nothing is gathered).

        Returns the sync's metrics (on the master; {} on the others) for verl to merge into
        the step's metrics. Raises the sync's `SyncError` on every trainer rank."""
        engine = self._shards.engine_of(weights, verl_internals.owning_worker(self)) if self.senders == ALL else None
        sender = self._sender
        if sender is None:
            raise RuntimeError("checkpoint engine 'hal': send_weights before init_process_group on this trainer rank")
        version = self._next_version(global_steps)
        learning: GeneratorSource | None = None
        if engine is not None:  # "all": every rank reads its shards; the master reports
            try:
                source: Callable[[], Any] = self._shards.source(engine, weights)
            except ValueError as exc:
                self.last_error = f"ValueError: {exc}"
                raise
            report = self.is_master
        else:  # "gather": the rank in the sync group sends, and keeps what it learns until it has sent it
            sends = bool(self._links)
            learning = GeneratorSource(weights, self._learned_specs, asyncio.get_running_loop(), keep=sends)
            source, report = (lambda: learning), sends

        def sync() -> Any:
            with torch.no_grad():
                return sender.sync(source(), version=version)

        try:
            metrics = await asyncio.wrap_future(_in_thread(sync))
        except SyncError as exc:
            if learning is not None and (learning.changed or learning.learned):
                self._learned_specs = None
            self._failed(exc)
            raise
        if learning is not None:
            self._learned_specs = learning.specs
        return self._completed(version, metrics, report)

    def _completed(self, version: int, metrics: Any, report: bool) -> dict[str, Any]:
        self.version = version
        self.metrics = metrics.as_dict()
        self.last_error = None
        self.canary_duty.completed(version)
        if not report:
            return {}
        # verl drops what finalize() returns: the last canary check's numbers come with the next update's
        out = {**numeric_metrics(self.metrics), **self.canary_duty.take_metrics()}
        self.reported = out
        return out

    @torch.no_grad()
    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Every rollout worker: yields each received tensor once it is whole (and checked;
        with senders "all", once every trainer rank's rows of it are here).

        A tensor is valid until the next one is asked for: copy what you keep (verl's
        server adapters do). Raises the sync's `SyncError` at the end when it failed."""
        if self._receiver is None:
            raise RuntimeError("checkpoint engine 'hal': receive_weights before init_process_group on this rollout worker")
        loop = asyncio.get_running_loop()
        receiver = self._receiver
        handoff = HandoffSink(loop, self.config.timeout_s, hal.current())
        done = _in_thread(self._receive, receiver, handoff)
        done.add_done_callback(handoff.finish)
        try:
            async for batch in handoff.batches():
                for pair in batch:
                    yield pair
        finally:
            handoff.close()
            try:
                metrics = await asyncio.wrap_future(done)
            except SyncError as exc:
                self._failed(exc)
                raise
        self.version = receiver.version
        self.metrics = metrics.as_dict()
        self.last_error = None
        self.canary_duty.completed(self.version)

    @staticmethod
    def _receive(receiver: SyncReceiver, handoff: HandoffSink) -> Any:
        return receiver.receive(handoff)
