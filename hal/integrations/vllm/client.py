"""Trainer side: push a trainer's weights into one or more live vLLM engines through hal.

    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from hal.integrations.vllm.client import OfflineEngine, WeightSync

    sync = WeightSync([OfflineEngine(llm), HTTPVLLMWeightSyncClient("http://127.0.0.1:8000")])
    sync.init()                                   # once: the group is reused by every sync
    result = sync.sync(model, version=step)       # start / update (+ send) / finish / reset cache
    sync.close()

The names a trainer uses, from the modules that hold them:

- hal.integrations.vllm.weight_sync: `WeightSync` (one group, every sync), `SyncResult`,
  `INCONSISTENT_PREFIX`;
- hal.integrations.vllm.engines: what a sync drives. vLLM's own clients
  (`HTTPVLLMWeightSyncClient`, `RayVLLMWeightSyncClient`, any `VLLMWeightSyncClient`),
  completed by `ClientEngine` with version read-back and the prefix-cache reset; hal's
  adapters where vLLM has no client: `OfflineEngine` (an offline `LLM` here) and
  `ExtensionEngine` (through hal's worker extension); the `Engine` protocol;
- hal.integrations.vllm.trainer_engine: `HalTrainerInitInfo` and
  `HalTrainerWeightTransferEngine`, hal behind vLLM's `WeightTransferTrainerFactory` (vLLM
  0.27 on; `weight_version(llm)` reads an offline engine's version on every release).

Importing this module registers "hal" in vLLM's engine and trainer factories.
"""

from __future__ import annotations

from hal.integrations.vllm import internals as vllm_internals
from hal.integrations.vllm.engine_clients import ClientEngine
from hal.integrations.vllm.engines import Engine, as_engine
from hal.integrations.vllm.engine_local import ExtensionEngine, OfflineEngine, weight_version
from hal.integrations.vllm.weight_sync import INCONSISTENT_PREFIX, SyncResult, WeightSync

if vllm_internals.keeps_weight_versions():  # vLLM's trainer-side engine of hal's shape: 0.27 on
    from hal.integrations.vllm.trainer_engine import HalTrainerInitInfo, HalTrainerWeightTransferEngine

__all__ = [
    "INCONSISTENT_PREFIX",
    "ClientEngine",
    "Engine",
    "ExtensionEngine",
    "OfflineEngine",
    "SyncResult",
    "WeightSync",
    "as_engine",
    "weight_version",
]
if vllm_internals.keeps_weight_versions():
    __all__ += ["HalTrainerInitInfo", "HalTrainerWeightTransferEngine"]
