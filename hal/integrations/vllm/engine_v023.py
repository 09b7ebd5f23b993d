"""hal's vLLM engine for vLLM 0.23-0.24's weight-transfer API: the worker owns an update.

vLLM 0.23 and 0.24 (and vllm-ascend 0.23.0.post1, whose `NPUWorker` copies that worker)
split an update between the worker and the engine differently from 0.25 on:

| | vLLM 0.23-0.24, vllm-ascend 0.23 | vLLM 0.25 on |
|---|---|---|
| engine built as | `Engine(config, parallel_config, model)` in the worker's `load_model` | `Engine(config, vllm_config, device, model)` |
| `start_weight_update` | the worker's: starts vLLM's layerwise reload (`initialize_layerwise_reload`) | the engine's |
| `update_weights` | the worker's: calls `engine.receive_weights(update_info, load_weights=model.load_weights)` | the engine's |
| `finish_weight_update` | the worker's: ends the reload (`finalize_layerwise_reload`); takes no version | the engine's; vLLM records the version from 0.27 |

`HalWeightTransferEngineV023` is the same engine as `HalWeightTransferEngine` (one
receiver, `Receiver` / `ShardedReceiver`, one `Sink`: the same header checks, checksums,
versions, delta, token, tied-weight refresh, every-rank senders); only its seams to the
worker differ (`WorkerOwnedUpdates`):

- **start**: the worker has started the reload before hal sees the sync, so the engine
  starts its `LayerwiseReload` (hal.integrations.vllm.reload) in that mode: it hands buckets
  to the loader at once (it does not start vLLM's reload again), and checks the kernel
  layout against the tensors the reload keeps aside (`vllm_internals.reload_kernel_parameters`).
- **load**: through the `load_weights` the worker hands over.
- **finish**: the engine ends the reload when `receive_weights` returns or raises, and then
  refreshes tied weights, as the engine of 0.25 on does at the end of `update_weights`.
  On a failure that is necessary: vLLM 0.23's `Worker.update_weights` marks the update
  over without ending the reload (its `finish_weight_update` then refuses: "without a
  matching start"), which would leave every layer that was not loaded on the meta device;
  vllm-ascend's keeps it open until the trainer's `finish_weight_update`. On success it is
  what lets the tied head be refreshed after its owner was reloaded (the worker's finish
  runs no hal code). The worker's own `finish_weight_update` then finds nothing left to
  end: vLLM's `finalize_layerwise_reload` skips every layer whose reload already ended
  (tests/integrations/vllm/test_v023.py checks both workers' sequences).

What 0.23's API cannot carry, and what hal does instead:
- a weight version on finish (`finish_weight_update()` takes none; vLLM 0.23-0.26 keep no
  weight version at all): the version travels in `update_weights({"version": v})` and in
  hal's header; every worker checks it (an older one is refused on every rank) and keeps
  it (`state()`); the trainer's engine adapters keep the version every worker agreed on at
  the end of the sync (`hal.integrations.vllm.engine_local.weight_version`).
- nothing for the trainer side: vLLM 0.23-0.25 ship no trainer clients and no trainer
  factory (`WeightSync` drives an offline `LLM` through `OfflineEngine`; a `vllm serve`
  0.23 has only the four update routes).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from hal.integrations.vllm import internals as vllm_internals
from hal.integrations.vllm.info import HalUpdateInfo
from hal.integrations.vllm.engine import HalWeightTransferEngine
from hal.integrations.vllm.lora_engine import HalLoraWeightTransferEngine
from hal.integrations.vllm.reload import LayerwiseReload, Loader


class WorkerOwnedUpdates:
    """The seams of hal's engine to a vLLM 0.23-0.24 worker, which owns an update's lifecycle.

    A mixin in front of `HalWeightTransferEngine` (or a subclass of it): vLLM builds it as
    `Engine(config, parallel_config, model)`, the worker starts the layerwise reload, calls
    `receive_weights(update_info, load_weights)` and finishes. The module doc says how each
    seam is used.
    """

    model: torch.nn.Module
    model_config: Any
    reload: LayerwiseReload

    def __init__(self, config: WeightTransferConfig, parallel_config: Any, model: torch.nn.Module, *, vllm_config: Any = None) -> None:
        if vllm_config is None:
            vllm_config = vllm_internals.creating_worker_vllm_config(parallel_config)
        super().__init__(config, vllm_config, _device_of(model), model)  # type: ignore[call-arg]

    def _init_vllm_engine(self, config: WeightTransferConfig, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        # vLLM 0.23-0.24's engine keeps config, parallel_config and model; what the engine of
        # 0.25 on keeps besides, hal's engine reads too (the checkpoint, the dtype, LoRA's config)
        WeightTransferEngine.__init__(self, config, vllm_config.parallel_config, model)  # type: ignore[arg-type]
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.device = device

    def receive_weights(self, update_info: HalUpdateInfo, load_weights: Loader | None = None) -> None:  # type: ignore[override]
        """From the worker (`load_weights` given): the worker started the reload; this ends it.
        Without `load_weights` (`HalWorkerExtension.hal_update` drives the engine itself) it
        works as the engine of vLLM 0.25 on: the reload starts with the first bucket and
        `update_weights` ends it."""
        if load_weights is None:
            super().receive_weights(update_info)  # type: ignore[misc]
            return
        self.reload.start(self.model, self.model_config, worker_load=load_weights)
        try:
            super().receive_weights(update_info)  # type: ignore[misc]
        finally:
            # a sync refused (or failed) before a tensor was loaded puts every layer back, on purpose
            self.reload.finish()


class HalWeightTransferEngineV023(WorkerOwnedUpdates, HalWeightTransferEngine):
    """`backend="hal"` on vLLM 0.23-0.24 (and vllm-ascend 0.23.0.post1): hal's engine with the
    worker owning each update (`WorkerOwnedUpdates`)."""


class HalLoraWeightTransferEngineV023(WorkerOwnedUpdates, HalLoraWeightTransferEngine):
    """`backend="hal-lora"` on vLLM 0.23-0.24: hal's LoRA engine with the worker owning each update."""


def _device_of(model: torch.nn.Module) -> torch.device:
    """The device the model's weights live on (vLLM 0.23's engine is not told it)."""
    for tensor in model.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")
