"""hal's vLLM integration: the engines vLLM builds in its workers and the trainer's side.

What each module holds (importing this package imports none of them, and no vLLM):

- `engine`: the weight-transfer engine `backend="hal"` (worker side) and `HalWorkerExtension`;
  `info`: what a trainer sends it (`HalInitInfo`, `HalUpdateInfo`), the transports it takes,
  dtype names; `reload`: one update as vLLM's layerwise reload applies it (`LayerwiseReload`:
  start, load, finish) and what it keeps across updates; `_specs`: the checkpoint's specs;
  `engine_v023`: the same engine behind vLLM 0.23-0.24's worker. vLLM calls `register()` in every process through the
  `vllm.general_plugins` entry point `hal_weight_transfer` that pyproject.toml declares.
- `lora`, `lora_engine`, `lora_sync`: the LoRA engine `backend="hal-lora"` and its trainer side.
- A shard receive (each worker only its own pieces, `WeightSync(receive="shard")`):
  `recording` (a worker's needs, from vLLM's own loaders), `landing` (pieces landed straight
  in a layer of the reload, processed by vLLM), `shard_receive` (the worker's side: its
  word at init, its receiver and sink), `shard_sync` (the trainer's side: what it asks
  for, the needs gathered at init, the sending side over links).
- `client`: the trainer side's names (`WeightSync`, the engines it drives, vLLM's trainer
  factory), from `weight_sync` (`WeightSync`: one resend loop around a driver), `drivers`
  (one sender, gather-then-send; the engines' calls), `sharded_sync` (every trainer rank
  sends), `engines` (vLLM's clients completed, hal's adapters) and `trainer_engine`;
  `canary`: after a sync, the canary's probe through each engine's own serving path
  (`WeightSync(canary=...)`, hal.canary, docs/canary.md); `canary_default`: what the
  canary a `WeightSync` runs by default asks, and what it leaves alone.
- `internals` (a folder, the fence: `versions`, `reload`, `workers`, `lora`): every private
  vLLM name verl-hal uses, behind a version check; `needs` lists them with how hal calls them
  and in which releases. Import vLLM only inside their functions. `tied`: tied embeddings
  after an update, through the fence's accessors.

The names this package itself answers are the engine's, as `hal.integrations.vllm` has
always named them (`worker_extension_cls="hal.integrations.vllm.HalWorkerExtension"`, the
entry point `hal.integrations.vllm:register`, `from hal.integrations.vllm import
HalInitInfo`): each is looked up in the module that holds it when first asked for, so that
`hal.integrations.vllm.internals` stays importable without vLLM.
"""

from __future__ import annotations

import importlib
from typing import Any

# The engine's names, and the module of this package that holds each.
_ENGINE_NAMES = {
    "BACKEND_NAME": "engine",
    "HalWeightTransferEngine": "engine",
    "HalWorkerExtension": "extension",
    "register": "engine",
    "register_engine": "engine",
    "ENGINE_TRANSPORTS": "info",
    "HalInitInfo": "info",
    "HalUpdateInfo": "info",
    "check_rendezvous": "info",
    "dtype_from_name": "info",
    "dtype_name": "info",
}

__all__ = sorted(_ENGINE_NAMES)


def __getattr__(name: str) -> Any:
    module = _ENGINE_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # asked once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ENGINE_NAMES))
