"""The one place verl-hal touches vLLM's private names: this folder, the fence.

vLLM's public surface for weight transfer (`WeightTransferEngine`, the factories'
`register_engine`, `WeightTransferConfig`, `LLM`'s weight-update methods, `LoRARequest`)
is used directly elsewhere. Everything else verl-hal needs from vLLM, internal modules,
underscore attributes and logger names, goes through these modules, which first check
that the installed vLLM is one these uses were written against (`SUPPORTED_VLLM`) and
otherwise fail with one line naming the installed and supported versions.

- `versions`: the gate (`require_supported_vllm`), the releases that differ (`*_SINCE`,
  `engine_owns_updates`, ...), the weight-transfer factories' registry, vLLM's clients;
- `reload`: vLLM's layerwise reload (start, end, what it keeps aside, deferred loads, its
  warnings), fused MoE experts after a reload, the tied embeddings' derived state;
- `recording`: the layerwise-reload state a recording of each worker's needs runs in
  (each loadable tensor's original loader wrapped, everything put back on exit), and a
  layer of a reload staged and processed for landing pieces in it;
- `workers`: engines and workers (an offline `LLM`'s processes and settings, a worker's
  model, the config of the worker building an engine), vLLM's tracebacks of refused syncs;
- `lora`: the LoRA manager's internals;
- `meta`: vLLM's model class built at a worker of an engine that does not exist (its
  config of an engine, a pretended parallel state), for `hal plan`.

Each function says what it reaches into; when vLLM moves one of these, its module is the
one to change, and where supported releases differ, the branch is there
(`engines_can_be_shut_down`). `VLLM_NEEDS` (hal.integrations.vllm.needs) lists every vLLM
name verl-hal relies on, with how it calls each; tests/hosts/ reads every module of this
folder against it. Callers use this package (`from hal.integrations.vllm import internals
as vllm_internals`), which re-exports every name. Importing it imports no vLLM module.
"""

from __future__ import annotations

from hal.integrations.vllm.internals.versions import (  # noqa: F401 - re-exported
    CLIENTS_SINCE,
    ENGINE_OWNS_UPDATES_SINCE,
    RENAME_MAPPER_SINCE,
    SHUTDOWN_SINCE,
    SUPPORTED_VLLM,
    UNSTACKED_MAPPER_SINCE,
    UNSUPPORTED_VLLM,
    WEIGHT_VERSIONS_SINCE,
    UnsupportedVllmError,
    engine_owns_updates,
    engines_can_be_shut_down,
    has_weight_sync_clients,
    keeps_weight_versions,
    registered,
    registered_class,
    require_supported_vllm,
    unsupported_message,
    vllm_release,
    vllm_version,
    weight_sync_clients,
)
from hal.integrations.vllm.internals.workers import (  # noqa: F401 - re-exported
    RPC_FAILURE_LOGS,
    SERVER_FAILURE_LOG,
    creating_worker_vllm_config,
    engine_process_ids,
    logprobs_mode,
    lora_enabled,
    quiet_refused_syncs,
    reload_weights,
    record_llm_processes,
    shutdown_llm,
    worker_closes_failed_updates,
    worker_model,
)
from hal.integrations.vllm.internals.reload import (  # noqa: F401 - re-exported
    DERIVED_ATTR,
    EMBEDDING_METHOD,
    EXPERTS_BASE,
    EXPERTS_SETUP_ONCE_SINCE,
    LAYERWISE_LOGGER,
    LAYERWISE_MODULE,
    QUANT_METHOD_ATTR,
    UNQUANTIZED_MOE_METHOD,
    derived_linear,
    embedding_method,
    finalize_layerwise_reload,
    has_own_processing,
    initialize_layerwise_reload,
    no_mtp_completeness_check,
    quant_method_of,
    quiet_computed_buffer_warnings,
    reload_kernel_parameters,
    reprocess_experts_on_reload,
    rerun_processing,
    restoring_every_layer,
    retain_deferred_loads,
    share_derived_linear,
)
from hal.integrations.vllm.internals.recording import (  # noqa: F401 - re-exported
    LOADABLE_NUMEL_ATTR,
    LOADER_ATTR,
    RELOAD_META_MODULE,
    RELOAD_UTILS_MODULE,
    SKIP_LOAD_TENSORS_SINCE,
    OWN_PROCESSING_ATTR,
    TORCHAO_FLAGS,
    ReloadTarget,
    layer_in_reload,
    loaders_on_meta,
    materialize_layer,
    process_layer,
    processed_at_end,
    reload_in_progress,
)
from hal.integrations.vllm.internals.meta import (  # noqa: F401 - re-exported
    MODEL_LOADER_UTILS_MODULE,
    PARALLEL_GROUPS,
    PARALLEL_SIZES,
    PARALLEL_STATE_MODULE,
    PretendGroup,
    build_model,
    meta_vllm_config,
    pretend_worker,
)
from hal.integrations.vllm.internals.lora import (  # noqa: F401 - re-exported
    DEFAULT_MODEL_SINCE,
    LORA_RELOAD_SINCE,
    LORA_VALIDATORS,
    build_lora_model,
    loaded_lora_ids,
    lora_manager,
    lora_target_modules,
    peft_helper,
    reloads_lora_models,
    validate_lora_model,
)
