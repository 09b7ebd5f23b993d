"""verl's checkpoint engine "hal": verl's trainer→rollout weight update on `hal.sync`.

verl 0.9.1 moves new weights from its trainer workers into its rollout workers through
a checkpoint engine chosen by name (`actor_rollout_ref.rollout.checkpoint_engine.backend`).
With `backend: hal`, `CheckpointEngineManager.update_weights()` drives this class on
every worker, in verl's order:

    prepare()                          every worker: where it is (node, current sync group)
    build_topology(...)                the driver: sync ranks, the group (reused while its
                                       members are), the transport
    init_process_group(**kwargs)       every worker: join the sync group if it is new
    send_weights(weights, global_steps)      every trainer rank, in lockstep (TrainerSync)
    receive_weights(global_steps)            every rollout worker: yields (name, tensor)
    finalize()                         every worker: buckets freed, the group kept

The sync group joins trainer rank 0 (the master, which sends) and every rollout worker;
the other trainer ranks iterate verl's weight generator in step with it (its
`full_tensor()` gathers are collectives over the trainer's group) and send nothing
(`hal.sync.TrainerSync`). `global_steps` is the weight version: a rollout worker refuses
an older one (every rank then raises `StaleVersionError`); without it the version counts
up from the last one. Every wait is bounded by `timeout_s`: a rollout worker that dies
mid-sync makes every trainer rank raise `PeerError`, and the next update builds a new
group.

Settings: verl passes `bucket_size` (`update_weights_bucket_megabytes`) and the mapping
`engine_kwargs["hal"]`, whose keys are `SyncConfig` fields (`bucket_bytes`,
`segment_bytes`, `bypass_cpu`, `wire_dtype`, `verify`, `timeout_s`, `delta`) plus this
engine's own `transport`; `delta` is true (`DeltaConfig()`), false, or a mapping of
`DeltaConfig` fields (`{"anchor_every": 16, "choose": "time"}`); any other key is refused naming the valid ones (`is_master` is verl's).
verl's default bucket size (2048 MiB) means "hal sizes the buckets" (from free device
memory); any other value is the bucket size.

The names, shapes and dtypes of a sync come from verl's generator, which declares
nothing before it yields: the first sync of an engine learns them by iterating the
generator once in full (on the master each tensor is kept in host memory until it is
sent: one copy of the weights, once), every later sync streams with that layout and
checks each tensor against it; a sync whose tensors differ fails on every rank and the
next one learns the layout again. Rollout workers accept the tensors the trainer's header
declares (verl's rollout side has no model of its own to check them against).

With `delta`, the wire carries only the changed words (docs/delta.md); each rollout worker
keeps an image of the last sync (one model at the wire dtype, on its device) and still
yields every tensor each update, rebuilt from it: verl's server adapters hand the weights
to vLLM, whose layerwise reload re-processes a layer from all its tensors.

Where each part lives: the settings (`sync_config_from`, re-exported here) in
hal.integrations.verl_settings; verl's generator as a hal source and hal's receive as
verl's generator in hal.integrations.verl_weights; the engine, its topology and one
update here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any, AsyncIterator

import torch
from verl.checkpoint_engine import CheckpointEngine

import hal
from hal import env
from hal.integrations._shared import in_daemon_thread
from hal.integrations.verl_settings import TRANSPORT_CHOICES, sync_config_from
from hal.integrations.verl_weights import GeneratorSource, HandoffSink
from hal.sync import BroadcastTransport, HierarchicalTransport, IpcTransport, Receiver, SyncError, TensorSpec, TrainerSync
from hal.sync.errors import PeerError
from hal.sync.group import LOOPBACK, SyncGroupSpec, destroy_sync_group, join_sync_group

logger = logging.getLogger(__name__)

# The sync rank of trainer ranks outside the sync group (they gather, they do not send).
NOT_IN_GROUP = -1

_TRANSPORTS = {
    "broadcast": BroadcastTransport,
    "ipc": IpcTransport,
    "hierarchical": HierarchicalTransport,
}


def _numeric_metrics(metrics: dict[str, Any]) -> dict[str, float | int]:
    """The sync's metrics as verl merges them into a step's: numbers only (verl averages
    them), dicts flattened (`segments_by_encoding/dense`), words and Nones left out."""
    out: dict[str, float | int] = {}
    for key, value in metrics.items():
        if key == "plan_reused":
            continue
        if isinstance(value, dict):
            out.update({f"checkpoint_engine/hal/{key}/{k}": v for k, v in value.items() if isinstance(v, (int, float))})
        elif isinstance(value, (int, float)):  # (bools too: delta)
            out[f"checkpoint_engine/hal/{key}"] = value
    return out


def _in_thread(fn: Any, *args: Any) -> "concurrent.futures.Future[Any]":
    """Run `fn(*args)` in a new daemon thread on this thread's device; a future of its result."""
    backend = hal.current()
    device = backend.current_device()

    def run() -> Any:
        backend.set_device(device)  # the current device is per thread on CUDA and NPU
        return fn(*args)

    return in_daemon_thread("hal-verl-sync", run)


def _node_address() -> str:
    """This node's address as Ray knows it (127.0.0.1 on a loopback-only Ray), else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except ImportError:
        pass
    return LOOPBACK


def _group_key(spec: SyncGroupSpec | None) -> tuple[str, int, int] | None:
    return None if spec is None else (spec.address, spec.port, spec.world_size)


class HalCheckpointEngine(CheckpointEngine):
    """verl's `CheckpointEngine` on hal.sync (see the module doc for the flow and settings)."""

    def __init__(self, bucket_size: int, is_master: bool = False, transport: str = "auto", **settings: Any) -> None:
        if transport not in TRANSPORT_CHOICES:
            raise ValueError(f"checkpoint engine 'hal': transport must be one of {', '.join(TRANSPORT_CHOICES)}, got {transport!r}")
        self.config = sync_config_from(bucket_size, settings)
        self.is_master = bool(is_master)
        self.transport = transport
        self.version: int | None = None
        """The weight version of the last sync this worker completed."""
        self.metrics: dict[str, Any] = {}
        """The last sync's `SyncMetrics.as_dict()` on this worker."""
        self.last_error: str | None = None
        """`"<SyncError class>: <message>"` of the last update that failed here; None after a success."""
        self._role: str | None = None
        self._rank: int | None = None
        self._spec: SyncGroupSpec | None = None
        self._group: Any = None
        self._link: Any = None  # the sync transport of this worker (trainer rank 0, rollout workers)
        self._trainer: TrainerSync | None = None
        self._receiver: Receiver | None = None
        self._layout: list[TensorSpec] | None = None

    # ---- topology ---------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """What `build_topology` needs of this worker: its node, the sync group it is in, and
        on the master where a new group's rendezvous can listen."""
        metadata: dict[str, Any] = {
            "master": self.is_master,
            "node": env.node_key(),
            "group": _group_key(self._spec),
            "rank": self._rank,
        }
        if self.is_master:
            from hal.procs import free_port

            backend = hal.current()
            address = _node_address()
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
        return metadata

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Sync rank 0 is trainer rank 0 (the master), rollout worker i is rank 1 + i; the
        other trainer ranks are outside the group. The group of the previous update is kept
        when every member still reports it under the same rank; otherwise a new one meets at
        the master (on 127.0.0.1 when every worker is on the master's node)."""
        if len(metadata) != actor_wg_world_size + rollout_world_size:
            raise ValueError(f"build_topology: {len(metadata)} metadata for {actor_wg_world_size} + {rollout_world_size} workers")
        master = metadata[0]
        if not master.get("master") or any(m.get("master") for m in metadata[1:]):
            raise ValueError("build_topology: trainer rank 0, and only it, must be the checkpoint engine's master (is_master=True)")
        members = [master, *metadata[actor_wg_world_size:]]
        world_size = len(members)
        reuse = master["group"] is not None and master["group"][2] == world_size and all(
            m["group"] == master["group"] and m["rank"] == rank for rank, m in enumerate(members)
        )
        one_node = all(m["node"] == master["node"] for m in members)
        if reuse:
            address, port, _ = master["group"]
        elif one_node:
            address, port = LOOPBACK, master["local_port"]
        else:
            address, port = master["address"], master["port"]
        spec = SyncGroupSpec(address=address, port=port, world_size=world_size)
        transport = master["transport"]
        if transport == "auto":
            if not master["host_ipc"]:
                transport = "broadcast"
            elif one_node:
                transport = "ipc"
            else:
                transport = "hierarchical" if len({m["node"] for m in members}) < world_size else "broadcast"
        common = {"spec": spec, "transport": transport, "reuse": reuse}
        actor = {
            "role": ["trainer"] * actor_wg_world_size,
            "rank": [0] + [NOT_IN_GROUP] * (actor_wg_world_size - 1),
            **{k: [v] * actor_wg_world_size for k, v in common.items()},
        }
        rollout = {
            "role": ["rollout"] * rollout_world_size,
            "rank": list(range(1, world_size)),
            **{k: [v] * rollout_world_size for k, v in common.items()},
        }
        return actor, rollout

    def init_process_group(self, *, role: str, rank: int, spec: SyncGroupSpec, transport: str, reuse: bool) -> None:
        """Join the sync group `spec` as `rank` (trainer ranks outside it only set up their
        lockstep), unless `reuse` says this worker is in it already."""
        joined = self._trainer is not None if role == "trainer" else self._receiver is not None
        if reuse and joined and (self._role, self._rank) == (role, rank):
            return  # every member keeps the group, and the trainer ranks their lockstep
        self._drop_group()
        backend = hal.current()
        self._role, self._rank = role, rank
        if rank != NOT_IN_GROUP:
            self._group = join_sync_group(spec, rank, backend=backend, timeout_s=self.config.timeout_s)
            self._spec = spec
            control = backend.control_device()
            self._link = _TRANSPORTS[transport](self._group, src=0, control_device=control)
        token = env.sync_token()
        if role == "trainer":
            self._trainer = TrainerSync(transport=self._link, config=self.config, backend=backend, token=token)
        else:
            # verl's rollout side has no model to check the trainer's tensors against: the
            # receiver takes what the header declares (still decoded and checked itself)
            self._receiver = Receiver(self._link, None, timeout_s=self.config.timeout_s, token=token, backend=backend, version=self.version)

    def _drop_group(self) -> None:
        if self._link is not None:
            self._link.close()
        if self._group is not None:
            destroy_sync_group(self._group)
        self._group = self._link = self._spec = self._trainer = self._receiver = None
        self._rank = None

    def finalize(self) -> None:
        """Free the bucket buffers (the group stays for the next update)."""
        if self._link is not None:
            self._link.close()
        hal.current().empty_cache()

    # ---- one update ---------------------------------------------------------------------------
    def _next_version(self, global_steps: int | None) -> int:
        if global_steps is None:
            return 0 if self.version is None else self.version + 1
        if isinstance(global_steps, bool) or not isinstance(global_steps, int):
            raise ValueError(f"checkpoint engine 'hal': global_steps must be an int or None, got {global_steps!r}")
        return global_steps

    def state(self) -> dict[str, Any]:
        """This worker's side, for logs and tests (through verl's `execute_checkpoint_engine`)."""
        return {
            "role": self._role,
            "sync_rank": self._rank,
            "version": self.version,
            "group": _group_key(self._spec),
            "transport": None if self._link is None else self._link.name,
            "last_error": self.last_error,
            "metrics": dict(self.metrics),
        }

    def _failed(self, exc: SyncError) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, PeerError):  # the group may be broken: the next update builds a new one
            self._drop_group()

    @torch.no_grad()
    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Every trainer rank: sync verl's weight generator as version `global_steps`.

        Returns the sync's metrics (on the master; {} on the others) for verl to merge into
        the step's metrics. Raises the sync's `SyncError` on every trainer rank."""
        if self._trainer is None:
            raise RuntimeError("checkpoint engine 'hal': send_weights before init_process_group on this trainer rank")
        version = self._next_version(global_steps)
        source = GeneratorSource(weights, self._layout, asyncio.get_running_loop(), keep=self._trainer.is_sender)
        try:
            metrics = await asyncio.wrap_future(_in_thread(lambda: self._trainer.sync(source, version=version)))
        except SyncError as exc:
            if source.changed or source.learned:
                self._layout = None
            self._failed(exc)
            raise
        self._layout = source.layout
        self.version = version
        self.metrics = metrics.as_dict()
        self.last_error = None
        if not self._trainer.is_sender:
            return {}
        return _numeric_metrics(self.metrics)

    @torch.no_grad()
    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Every rollout worker: yields each received tensor once it is whole (and checked).

        A tensor is valid until the next one is asked for: copy what you keep (verl's
        server adapters do). Raises the sync's `SyncError` at the end when it failed."""
        if self._receiver is None:
            raise RuntimeError("checkpoint engine 'hal': receive_weights before init_process_group on this rollout worker")
        loop = asyncio.get_running_loop()
        receiver = self._receiver
        handoff = HandoffSink(loop, self.config.timeout_s, receiver.backend)
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

    @staticmethod
    def _receive(receiver: Receiver, handoff: HandoffSink) -> Any:
        return receiver.receive(handoff)
