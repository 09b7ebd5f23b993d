"""What hal's engine for vLLM 0.23-0.24's API relies on: `VLLM_V023_NEEDS`, and vllm-ascend's: `VLLM_ASCEND_NEEDS`.

In vLLM 0.23 and 0.24 the worker owns an update (hal.integrations.vllm.engine_v023 says how
hal's engine meets it); vllm-ascend 0.23.0.post1's `NPUWorker` copies that worker. These
tables hold what that engine and the trainer's adapters rely on in those releases beyond
`VLLM_NEEDS` (whose entries say which of them hold before 0.25): the three-argument engine,
the worker whose `vllm_config` the engine reads, the worker's three lifecycle methods, the
reload state the engine reads while the worker's reload runs. tests/hosts/ reads them from
each release's sources like `VLLM_NEEDS` (vLLM 0.23.0 and 0.24.0 wheels; vllm-ascend's
source distribution), and checks there, by reading the worker's code, that its start
begins vLLM's layerwise reload, its update hands `model.load_weights` to
`receive_weights` and its finish ends the reload. Imports no vLLM.
"""

from __future__ import annotations

from hal.host_needs import Call, Need
from hal.integrations.vllm.internals import LAYERWISE_MODULE, ENGINE_OWNS_UPDATES_SINCE

_WT = "vllm.distributed.weight_transfer"
_WORKER = "vllm.v1.worker.gpu_worker:Worker"
_BEFORE = {"before": ENGINE_OWNS_UPDATES_SINCE}

VLLM_V023_NEEDS: tuple[Need, ...] = (
    Need(target=f"{_WT}.base:WeightTransferEngine", call=Call(3), implemented_by="hal.integrations.vllm.engine_v023:HalWeightTransferEngineV023",
         why="HalWeightTransferEngineV023(config, parallel_config, model) completes vLLM 0.23's engine", **_BEFORE),
    Need(target=f"{_WT}.base:WeightTransferEngine", call=Call(3),
         implemented_by="hal.integrations.vllm.engine_v023:HalLoraWeightTransferEngineV023",
         why="HalLoraWeightTransferEngineV023 (hal-lora)", **_BEFORE),
    Need(target=f"{_WT}.base:WeightTransferEngine.receive_weights", call=Call(1, "load_weights"),
         why="the worker's update_weights calls receive_weights(update_info, load_weights=...)", **_BEFORE),
    Need(target=f"{_WT}.factory:WeightTransferEngineFactory.create_engine", call=Call(3),
         why="how the worker builds the engine: (config, parallel_config, model)", **_BEFORE),
    Need(target="vllm.config:get_current_vllm_config_or_none", call=Call(0), why="creating_worker_vllm_config", **_BEFORE),
    # the worker: its config (creating_worker_vllm_config; vllm-ascend's NPUWorker has it from
    # the same WorkerBase) and the three calls LLM makes on it
    Need(target=f"{_WORKER}.vllm_config", why="creating_worker_vllm_config", **_BEFORE),
    Need(target="vllm.v1.worker.worker_base:WorkerBase.vllm_config", why="creating_worker_vllm_config (NPUWorker's)", **_BEFORE),
    Need(target=f"{_WORKER}.start_weight_update", call=Call(0, "is_checkpoint_format"), why="LLM.start_weight_update", **_BEFORE),
    Need(target=f"{_WORKER}.update_weights", call=Call(0, "update_info"), why="LLM.update_weights", **_BEFORE),
    Need(target=f"{_WORKER}.finish_weight_update", call=Call(0), why="LLM.finish_weight_update", **_BEFORE),
    # which worker runs an offline LLM's engine: vLLM's own end a failed update, NPUWorker does not
    Need(target="vllm.config.parallel:ParallelConfig.worker_cls", why="worker_closes_failed_updates", **_BEFORE),
    # the reload's per-layer state, read while the worker's reload runs (reload_kernel_parameters)
    Need(target=f"{LAYERWISE_MODULE}:LAYERWISE_INFO", why="reload_kernel_parameters", **_BEFORE),
    Need(target="vllm.model_executor.model_loader.reload.types:LayerReloadingInfo.can_load", call=Call(0),
         why="reload_kernel_parameters", **_BEFORE),
    Need(target="vllm.model_executor.model_loader.reload.types:LayerReloadingInfo.kernel_tensors",
         why="reload_kernel_parameters", **_BEFORE),
)

# vllm-ascend 0.23.0.post1's worker, which builds and drives hal's engine as vLLM 0.23's does
# (docs/ascend.md). Read from its source distribution (tests/hosts/); no release ranges:
# one vllm-ascend release is read.
_NPU_WORKER = "vllm_ascend.worker.worker:NPUWorker"
VLLM_ASCEND_NEEDS: tuple[Need, ...] = (
    # NPUWorker's vllm_config is set by vLLM's WorkerBase (outside this source): tests/hosts/
    # reads load_model's create_engine(..., self.vllm_config.parallel_config, ...) call instead
    Need(target=f"{_NPU_WORKER}.load_model", call=Call(0), why="builds the engine: create_engine(config, parallel_config, model)"),
    Need(target=f"{_NPU_WORKER}.init_weight_transfer_engine", call=Call(0, "init_info"), why="LLM.init_weight_transfer_engine"),
    Need(target=f"{_NPU_WORKER}.start_weight_update", call=Call(0, "is_checkpoint_format"), why="LLM.start_weight_update"),
    Need(target=f"{_NPU_WORKER}.update_weights", call=Call(0, "update_info"), why="LLM.update_weights"),
    Need(target=f"{_NPU_WORKER}.finish_weight_update", call=Call(0),
         why="LLM.finish_weight_update; OfflineEngine closes a failed update with it (NPUWorker keeps one open)"),
    Need(target="vllm_ascend.envs", text="VLLM_ASCEND_ENABLE_NZ",
         why="docs/ascend.md: start_weight_update refuses while NZ is on (set VLLM_ASCEND_ENABLE_NZ=0)"),
    Need(target=f"{_NPU_WORKER}.wake_up", call=Call(0),
         why="HalWeightTransferEngine.validate refuses a sync after wake_up laid MoE weights out anew"),
    Need(target="vllm_ascend.distributed.weight_transfer", why="vllm-ascend's own engines (hccl, npu_ipc): no name of hal's"),
    # its own fused-MoE processing, whole at every processing (no skip on updates, unlike vLLM
    # 0.28+'s method, which reprocess_experts_on_reload completes): left to run as it is
    Need(target="vllm_ascend.ops.fused_moe.fused_moe:AscendUnquantizedFusedMoEMethod.process_weights_after_loading",
         call=Call(1), why="docs/ascend.md: transposes and NZ-casts w13/w2 every time a reload processes the layer"),
)
