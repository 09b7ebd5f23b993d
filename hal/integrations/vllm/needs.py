"""Every vLLM name verl-hal relies on, with how hal calls it: `VLLM_NEEDS`.

Private names (used through the fence, hal.integrations.vllm.internals) and public ones
(imported by hal.integrations.vllm.engine, .engines, .trainer_engine, .lora*).
tests/hosts/ checks the table against the sources of the installed vLLM (in every
release's environment of `make test-vllm-versions` too) and of the wheels of other
releases (never importing them), and that it covers every vLLM name the fence uses
(tests/hosts/sources.py has the target syntax; hal.host_needs the fields). `optional`: hal
looks it up with a fallback; `since` / `before`: the releases in which hal relies on it
there (vLLM 0.32 moved the RL routes and added the engine shutdown). The constants come
from the fence, so the table and the code cannot name different things. Imports no vLLM.
"""

from __future__ import annotations

from hal.host_needs import Call, Need
from hal.integrations.vllm.internals import (
    DERIVED_ATTR,
    EMBEDDING_METHOD,
    LAYERWISE_LOGGER,
    LAYERWISE_MODULE,
    EXPERTS_BASE,
    EXPERTS_SETUP_ONCE_SINCE,
    UNQUANTIZED_MOE_METHOD,
    LORA_VALIDATORS,
    QUANT_METHOD_ATTR,
    RPC_FAILURE_LOGS,
    CLIENTS_SINCE,
    DEFAULT_MODEL_SINCE,
    ENGINE_OWNS_UPDATES_SINCE,
    RENAME_MAPPER_SINCE,
    LORA_RELOAD_SINCE,
    SHUTDOWN_SINCE,
    UNSTACKED_MAPPER_SINCE,
    WEIGHT_VERSIONS_SINCE,
)
from hal.integrations.vllm.internals import (  # issue 41: `hal plan`'s model on paper
    MODEL_LOADER_UTILS_MODULE,
    PARALLEL_GROUPS,
    PARALLEL_SIZES,
    PARALLEL_STATE_MODULE,
)
from hal.integrations.vllm.internals import (  # issue 41: recording each worker's needs, landing pieces in its layers
    LOADABLE_NUMEL_ATTR,
    LOADER_ATTR,
    OWN_PROCESSING_ATTR,
    RELOAD_META_MODULE,
    RELOAD_UTILS_MODULE,
    SKIP_LOAD_TENSORS_SINCE,
    TORCHAO_FLAGS,
)

_OWNS = {"since": ENGINE_OWNS_UPDATES_SINCE}  # the engine of 0.25 on (hal.integrations.vllm.needs_v023 has 0.23-0.24's)
_CLIENTS = {"since": CLIENTS_SINCE}
_VERSIONS = {"since": WEIGHT_VERSIONS_SINCE}

_WT = "vllm.distributed.weight_transfer"
VLLM_NEEDS: tuple[Need, ...] = (
    Need(target="vllm:__version__", why="vllm_version"),
    # weight-transfer API (public): the engine hal implements, the factories it registers in
    Need(target=f"{_WT}.base:WeightTransferEngine", call=Call(4), implemented_by="hal.integrations.vllm.engine:HalWeightTransferEngine",
         why="HalWeightTransferEngine(config, vllm_config, device, model) completes vLLM's engine", **_OWNS),
    Need(target=f"{_WT}.base:WeightTransferEngine.parallel_config", why="HalWeightTransferEngine.group_rank"),
    Need(target="vllm.config.parallel:ParallelConfig.enable_eplb", why="HalWeightTransferEngine.shard_word: EPLB takes whole tensors"),
    Need(target=f"{_WT}.base:WeightTransferEngine.model_config", why="HalWeightTransferEngine.init_transfer_engine", **_OWNS),
    Need(target=f"{_WT}.base:WeightTransferEngine.vllm_config", why="HalLoraWeightTransferEngine (lora_config)", **_OWNS),
    Need(target=f"{_WT}.base:WeightTransferEngine.model", why="HalWeightTransferEngine.apply"),
    Need(target=f"{_WT}.base:WeightTransferEngine._default_model", why="lora_manager", since=DEFAULT_MODEL_SINCE),
    Need(target=f"{_WT}.base:WeightTransferEngine.parse_init_info", call=Call(1), why="HalWorkerExtension.hal_init"),
    Need(target=f"{_WT}.base:WeightTransferInitInfo", why="HalInitInfo"),
    Need(target=f"{_WT}.base:WeightTransferUpdateInfo", why="HalUpdateInfo"),
    Need(target=f"{_WT}.base:TrainerInitInfo", why="HalTrainerInitInfo (hal.integrations.vllm.trainer_engine)", **_VERSIONS),
    Need(target=f"{_WT}.base:TrainerWeightTransferEngine", call=Call(0, "client", "source", "is_sender"),
         implemented_by="hal.integrations.vllm.trainer_engine:HalTrainerWeightTransferEngine", why="HalTrainerWeightTransferEngine",
         **_VERSIONS),
    Need(target=f"{_WT}.factory:WeightTransferEngineFactory.register_engine", call=Call(3), why="register_engine"),
    Need(target=f"{_WT}.factory:WeightTransferEngineFactory._registry", why="registered, registered_class"),
    Need(target=f"{_WT}.factory:WeightTransferTrainerFactory.register_engine", call=Call(3), why="register (trainer side)", **_VERSIONS),
    Need(target=f"{_WT}.factory:WeightTransferTrainerFactory._registry", why="registered (trainer side)", **_VERSIONS),
    Need(target="vllm.config.weight_transfer:WeightTransferConfig", call=Call(0, "backend"), why="HalWorkerExtension"),
    Need(target="vllm.config.parallel:ParallelConfig.data_parallel_index", why="HalWeightTransferEngine.group_rank"),
    Need(target="vllm.config.parallel:ParallelConfig.world_size", why="HalWeightTransferEngine.group_rank, OfflineEngine"),
    Need(target="vllm.config.parallel:ParallelConfig.rank", why="HalWeightTransferEngine.group_rank"),
    Need(target="vllm.lora.request:LoRARequest", why="hal.integrations.vllm.lora"),
    # vLLM's trainer-side clients, which WeightSync drives (hal.integrations.vllm.engine_clients.ClientEngine)
    Need(target=f"{_WT}.base:VLLMWeightSyncClient", why="ClientEngine, as_engine (the clients' protocol)", **_CLIENTS),
    *(Need(target=f"{_WT}.base:VLLMWeightSyncClient.{method}", call=Call(n), why="ClientEngine", **_CLIENTS) for method, n in (
        ("init_weight_transfer_engine", 1), ("start_weight_update", 0), ("update_weights", 1))),
    Need(target=f"{_WT}.base:VLLMWeightSyncClient.finish_weight_update", call=Call(1), why="ClientEngine", **_VERSIONS),
    Need(target=f"{_WT}.base:VLLMWeightSyncClient.finish_weight_update", call=Call(0), since=CLIENTS_SINCE,
         before=WEIGHT_VERSIONS_SINCE, why="ClientEngine (no version: RecordedVersion)"),
    Need(target=f"{_WT}.clients:HTTPVLLMWeightSyncClient.base_url", why="ClientEngine (its name, ServerRoutes)", **_CLIENTS),
    Need(target=f"{_WT}.clients:HTTPVLLMWeightSyncClient.timeout", why="ClientEngine (ServerRoutes' timeout)", **_CLIENTS),
    Need(target=f"{_WT}.clients:RayVLLMWeightSyncClient.handles", why="ClientEngine (one actor, ActorMethods)", **_CLIENTS),
    *(Need(target=f"{_WT}.clients:{client}.shutdown_weight_transfer_engine", call=Call(0), optional=True,
           since=SHUTDOWN_SINCE, why="ClientEngine.shutdown_weight_transfer_engine")
      for client in ("HTTPVLLMWeightSyncClient", "RayVLLMWeightSyncClient")),
    # offline LLM (public)
    *(Need(target=f"vllm:LLM.{method}", call=Call(n), why="OfflineEngine") for method, n in (
        ("init_weight_transfer_engine", 1), ("start_weight_update", 0), ("update_weights", 1), ("reset_prefix_cache", 0))),
    *(Need(target=f"vllm:LLM.{method}", call=Call(n), why="OfflineEngine, weight_version", **_VERSIONS) for method, n in (
        ("finish_weight_update", 1), ("update_weight_version", 1), ("get_weight_version", 0))),
    Need(target="vllm:LLM.finish_weight_update", call=Call(0), before=WEIGHT_VERSIONS_SINCE,
         why="OfflineEngine (no version: RecordedVersion; and closing a failed update)"),
    Need(target="vllm:LLM.shutdown_weight_transfer_engine", call=Call(0), since=SHUTDOWN_SINCE,
         why="OfflineEngine (none before 0.32: engines_can_be_shut_down)"),
    Need(target="vllm:LLM.collective_rpc", call=Call(1, "kwargs"), why="ExtensionEngine"),
    # the canary's engine side (hal.integrations.vllm.canary): the probe through the engine's own serving path
    Need(target="vllm:SamplingParams", call=Call(0, "max_tokens", "prompt_logprobs", "temperature", "detokenize"),
         why="canary.sampling_params"),
    Need(target="vllm:SamplingParams", call=Call(0, "max_tokens", "logprobs", "temperature", "allowed_token_ids", "detokenize"),
         why="canary.forced_params"),
    Need(target="vllm.outputs:CompletionOutput.logprobs", why="canary.generate_logprobs (forced decode steps)"),
    Need(target="vllm.outputs:CompletionOutput.token_ids", why="canary.generate_logprobs (forced decode steps)"),
    Need(target="vllm.outputs:RequestOutput.outputs", why="canary.generate_logprobs (forced decode steps)"),
    Need(target="vllm:LLM.generate", call=Call(2, "use_tqdm", "lora_request"), why="canary.llm_prompt_logprobs"),
    Need(target="vllm:LLM.get_tokenizer", call=Call(0), why="canary.engine_vocab_limit"),
    Need(target="vllm.outputs:RequestOutput.prompt_logprobs", why="canary.prompt_values"),
    Need(target="vllm.logprobs:Logprob.logprob", why="canary.prompt_values"),
    Need(target="vllm.entrypoints.openai.completion.protocol:CompletionRequest.prompt_logprobs", since=(0, 32),
         why="canary.http_prompt_logprobs (POST /v1/completions)"),
    Need(target="vllm.entrypoints.openai.completion.protocol:CompletionResponseChoice.prompt_logprobs", since=(0, 32),
         why="canary.http_prompt_logprobs"),
    # the routes of `vllm serve` hal posts to itself (vLLM's HTTP client posts the four phases);
    # 0.32 moved them from the development router to the RL one
    *(Need(target=router, text=f"/{route}", why="ServerRoutes (hal.integrations.vllm.engines)", **releases)
      for route in ("update_weight_version", "weight_info")
      for router, releases in (("vllm.entrypoints.serve.dev.rlhf.api_router", {**_VERSIONS, "before": (0, 32)}),
                               ("vllm.entrypoints.rl.online.api_router", {"since": (0, 32)}))),
    Need(target="vllm.entrypoints.serve.dev.cache.api_router", text="/reset_prefix_cache", why="ServerRoutes.reset_prefix_cache"),
    # private, through the functions of this module
    Need(target="vllm.model_executor.model_loader.reload:initialize_layerwise_reload", call=Call(1), why="initialize_layerwise_reload"),
    Need(target="vllm.model_executor.model_loader.reload:finalize_layerwise_reload", call=Call(2), why="finalize_layerwise_reload"),
    Need(target=f"{LAYERWISE_MODULE}:LAYERWISE_INFO", why="retain_deferred_loads (every release; reload_kernel_parameters too)"),
    Need(target="vllm.model_executor.model_loader.reload.types:LayerReloadingInfo.loaded_weights",
         why="retain_deferred_loads (the (name, inspect.BoundArguments) of each load a layer holds until it is processed)"),
    Need(target=LAYERWISE_MODULE, text="param",
         why="retain_deferred_loads (the loader's parameter argument, which vLLM itself sets anew: args.arguments['param'])"),
    # reprocess_experts_on_reload: vLLM's unquantized fused-MoE method and its experts kernel's post-load step
    Need(target=":".join(UNQUANTIZED_MOE_METHOD) + ".process_weights_after_loading", call=Call(1),
         why="reprocess_experts_on_reload (the method's own processing, then the experts')"),
    Need(target=":".join(UNQUANTIZED_MOE_METHOD) + "._setup_kernel", call=Call(3), since=EXPERTS_SETUP_ONCE_SINCE,
         why="reprocess_experts_on_reload: it runs the experts' step only when the kernel is first set up (read in 0.28-0.32)"),
    Need(target=":".join(UNQUANTIZED_MOE_METHOD) + ".moe_kernel", since=EXPERTS_SETUP_ONCE_SINCE, why="reprocess_experts_on_reload"),
    Need(target=":".join(EXPERTS_BASE) + ".process_weights_after_loading", call=Call(1), since=EXPERTS_SETUP_ONCE_SINCE,
         why="reprocess_experts_on_reload (a kernel that keeps the base's no-op is left alone)"),
    Need(target="vllm.model_executor.layers.fused_moe.modular_kernel:FusedMoEKernel.fused_experts", since=EXPERTS_SETUP_ONCE_SINCE,
         why="reprocess_experts_on_reload (moe_kernel.fused_experts)"),
    Need(target=LAYERWISE_LOGGER, text="%s: Failed to load weights",
         why="_ComputedBufferWarningFilter (the logger LAYERWISE_LOGGER and its message)"),
    *(Need(target=logger, text=message, why="quiet_refused_syncs (RPC_FAILURE_LOGS: the logger and its message)")
      for logger, message in RPC_FAILURE_LOGS),
    Need(target="vllm.model_executor.layers.rotary_embedding:RotaryEmbedding", why="_ComputedBufferWarningFilter (layer names)"),
    Need(target=f"{EMBEDDING_METHOD[0]}:ParallelLMHead", why="_ComputedBufferWarningFilter (layer names)"),
    Need(target="vllm.model_executor.model_loader.mtp_validation:disable_mtp_completeness_check", call=Call(0), optional=True,
         why="no_mtp_completeness_check"),
    Need(target=":".join(EMBEDDING_METHOD) + ".process_weights_after_loading",
         call=Call(1), why="tied.refresh_tied_weights (embedding_method, has_own_processing, rerun_processing)"),
    Need(target=f"{EMBEDDING_METHOD[0]}:VocabParallelEmbedding.{QUANT_METHOD_ATTR}",
         why="tied.refresh_tied_weights (quant_method_of: QUANT_METHOD_ATTR)"),
    Need(target="vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm", sets=DERIVED_ATTR,
         why="tied.refresh_tied_weights (derived_linear, share_derived_linear: DERIVED_ATTR, set there)"),
    Need(target="vllm.entrypoints.llm:LLM.llm_engine", why="shutdown_llm, OfflineEngine"),
    Need(target="vllm.v1.engine.llm_engine:LLMEngine.engine_core", why="shutdown_llm"),
    Need(target="vllm.v1.engine.llm_engine:LLMEngine.vllm_config", why="OfflineEngine, logprobs_mode"),
    Need(target="vllm.v1.engine.llm_engine:LLMEngine.is_sleeping", call=Call(0),
         why="canary_default.asleep (the default canary does not ask an engine that is asleep)"),
    Need(target="vllm.config.vllm:VllmConfig.model_config", why="logprobs_mode"),
    Need(target="vllm.config.model:ModelConfig.logprobs_mode", why="logprobs_mode (hal.integrations.vllm.canary)"),
    Need(target="vllm.config.vllm:VllmConfig.lora_config", why="lora_enabled (hal.integrations.vllm.canary)"),
    Need(target="vllm.v1.engine.core_client:EngineCoreClient.shutdown", call=Call(0, "timeout"), why="shutdown_llm"),
    # engine_process_ids: the processes whose leftovers shutdown_llm removes
    Need(target="vllm.v1.engine.core_client:MPClient.resources", why="engine_process_ids"),
    Need(target="vllm.v1.engine.core_client:BackgroundResources.engine_manager", why="engine_process_ids"),
    Need(target="vllm.v1.engine.utils:CoreEngineProcManager.processes", why="engine_process_ids"),
    Need(target="vllm.v1.engine.core_client:InprocClient.engine_core", why="engine_process_ids"),
    Need(target="vllm.v1.engine.core:EngineCore.model_executor", why="engine_process_ids"),
    Need(target="vllm.v1.executor.multiproc_executor:MultiprocExecutor.workers", why="engine_process_ids"),
    Need(target="vllm.v1.executor.multiproc_executor:WorkerProcHandle.proc", why="engine_process_ids"),
    Need(target="vllm.v1.worker.gpu_worker:Worker.model_runner", why="worker_model, reload_weights, HalWorkerExtension"),
    Need(target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.get_model", call=Call(0), why="worker_model"),
    Need(target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights", call=Call(0, "weights_iterator"), why="reload_weights"),
    Need(target="vllm.lora.model_manager:LoRAModelManager.supported_lora_modules", why="lora_target_modules"),
    Need(target="vllm.lora.model_manager:LoRAModelManager.packed_modules_mapping", why="lora_target_modules"),
    Need(target="vllm.lora.model_manager:LoRAModelManager.model", why="build_lora_model"),
    Need(target="vllm.lora.model_manager:LoRAModelManager.list_adapters", call=Call(0), why="loaded_lora_ids"),
    Need(target="vllm.lora.model_manager:LoRAModelManager.__init__", sets="lora_manager",
         why="lora_manager (the manager sets model.lora_manager)"),
    *(Need(target=f"vllm.lora.model_manager:LoRAModelManager.{check}", call=Call(1), optional=True, why="validate_lora_model")
      for check in LORA_VALIDATORS),
    Need(target="vllm.lora.peft_helper:PEFTHelper.from_dict", call=Call(1), why="peft_helper"),
    Need(target="vllm.lora.lora_model:LoRAModel.from_lora_tensors",
         call=Call(0, "lora_model_id", "tensors", "peft_helper", "device", "dtype", "model_vocab_size", "weights_mapper", "skip_prefixes"),
         why="build_lora_model"),
    Need(target="vllm.model_executor.models.interfaces:SupportsQuant.hf_to_vllm_mapper", why="build_lora_model"),
    Need(target="vllm.model_executor.models.utils:WeightsMapper.get_rename_mapper", call=Call(0),
         why="build_lora_model (_lora_weights_mapper)", since=RENAME_MAPPER_SINCE),
    Need(target="vllm.model_executor.models.utils:WeightsMapper.get_unstacked_mapper", call=Call(0),
         why="build_lora_model (_lora_weights_mapper)", since=UNSTACKED_MAPPER_SINCE, before=RENAME_MAPPER_SINCE),
    Need(target="vllm.lora.layers.base:BaseLayerWithLoRA.load_weights", call=Call(1), since=LORA_RELOAD_SINCE,
         why="reloads_lora_models (hal-lora's base syncs load through it)"),
    Need(target="vllm.lora.worker_manager", text="lora_skip_prefixes", optional=True,
         why="build_lora_model (read as vLLM's own adapter loader reads it)"),
    # issue 41: loaders_on_meta, the layerwise-reload state a recording of each worker's needs runs in
    *(Need(target=f"{LAYERWISE_MODULE}:{name}", call=Call(n), why=f"loaders_on_meta ({why})") for name, n, why in (
        ("_get_original_loader", 1, "each loadable tensor's loader without vLLM's online_process_loader"),
        ("_place_kernel_tensors", 2, "every layer gets its kernel tensors back"))),
    Need(target=f"{LAYERWISE_MODULE}:default_weight_loader",
         why="loaders_on_meta (_get_original_loader answers it for a tensor without a loader of its own)"),
    Need(target="vllm.model_executor.model_loader.weight_utils:default_weight_loader", call=Call(2),
         why="loaders_on_meta (what a norm's loader is)"),
    *(Need(target=f"{LAYERWISE_MODULE}:initialize_layerwise_reload", sets=flag, why="loaders_on_meta (TORCHAO_FLAGS, put back)")
      for flag in TORCHAO_FLAGS),
    Need(target=f"{RELOAD_UTILS_MODULE}:get_layer_tensors", call=Call(1), why="loaders_on_meta (a layer's parameters and buffers)"),
    Need(target=f"{RELOAD_META_MODULE}:SKIP_LOAD_TENSORS", since=SKIP_LOAD_TENSORS_SINCE,
         why="_skip_load_names (tensors no loader writes; SKIP_TENSORS adds bias, which stays live)"),
    Need(target=f"{RELOAD_META_MODULE}:SKIP_TENSORS", before=SKIP_LOAD_TENSORS_SINCE,
         why="_skip_load_names (tensors no loader writes; bias goes to meta before 0.27)"),
    *(Need(target=f"vllm.model_executor.model_loader.reload.types:LayerReloadingInfo.{member}", why="loaders_on_meta, reload_in_progress", **call)
      for member, call in (("can_load", {"call": Call(0)}), ("reset", {"call": Call(0)}), ("kernel_tensors", {}))),
    Need(target=f"vllm.model_executor.parameter:BasevLLMParameter.{LOADER_ATTR}",
         why="loaders_on_meta (LOADER_ATTR: a property with a setter on vLLM's parameters, an attribute on plain ones)"),
    Need(target=":".join(UNQUANTIZED_MOE_METHOD) + ".create_weights", sets=LOADABLE_NUMEL_ATTR, optional=True,
         why="loaders_on_meta (LOADABLE_NUMEL_ATTR: a target's declared padding; none before it)"),
    # issue 41: `hal plan` builds vLLM's model class at a worker of an engine that does not exist
    Need(target="vllm.engine.arg_utils:EngineArgs",
         call=Call(0, "model", "skip_tokenizer_init", "dtype", "enforce_eager", "hf_overrides"), why="meta_vllm_config"),
    Need(target="vllm.engine.arg_utils:EngineArgs.create_engine_config", call=Call(0), why="meta_vllm_config"),
    *(Need(target=f"{PARALLEL_STATE_MODULE}:{name}", why="pretend_worker (a group the model's layers ask for, put back after)")
      for name in PARALLEL_GROUPS),
    *(Need(target=f"{PARALLEL_STATE_MODULE}:GroupCoordinator.{member}", why="PretendGroup (answers it as vLLM's group does)")
      for member in ("world_size", "rank_in_group", "ranks", "rank", "local_rank", "device_group", "cpu_group", "unique_name",
                     "is_first_rank", "is_last_rank")),
    *(Need(target=f"vllm.config.parallel:ParallelConfig.{name}", why="pretend_worker (the engine's sizes, put back after)")
      for name in PARALLEL_SIZES),
    Need(target="vllm.config.vllm:VllmConfig.parallel_config", why="pretend_worker"),
    Need(target="vllm.config.vllm:VllmConfig.compilation_config", why="build_model (a fresh registry of attention layers)"),
    Need(target="vllm.config.compilation:CompilationConfig.static_forward_context", why="build_model"),
    Need(target="vllm.config.model:ModelConfig.hf_text_config", why="build_model (hf_overrides for one build)"),
    Need(target=f"{MODEL_LOADER_UTILS_MODULE}:initialize_model", call=Call(0, "vllm_config"), why="build_model"),
    # issue 41: landing a shard receive's pieces in a layer of the reload (hal.integrations.vllm.landing)
    Need(target=f"{RELOAD_META_MODULE}:materialize_layer", call=Call(2), why="materialize_layer (vLLM's staging of one layer)"),
    Need(target=f"{LAYERWISE_MODULE}:_layerwise_process", call=Call(2),
         why="process_layer (one layer's processing and copy into its kernel tensors, nothing buffered)"),
    Need(target=f"vllm.model_executor.layers.attention.attention:Attention.{OWN_PROCESSING_ATTR}", call=Call(1),
         why="processed_at_end (OWN_PROCESSING_ATTR: the layers vLLM's reload processes only at its end have their own)"),
)
