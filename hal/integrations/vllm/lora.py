"""LoRA-only weight sync into a live vLLM engine: `WeightTransferConfig(backend="hal-lora")`.

The engine keeps its base weights; a sync sends the adapter's tensors through hal and the
engine serves the new adapter under one fixed LoRA id:

    from hal.integrations.vllm import lora as vllm_lora
    vllm_lora.register()      # in every process that builds the engine (see "Registration")
    llm = LLM(model=base_dir, enable_lora=True, max_lora_rank=r,
              weight_transfer_config=WeightTransferConfig(backend="hal-lora"))
    sync = vllm_lora.LoraWeightSync([OfflineEngine(llm)], adapter_config(peft_model),
                                    sleep_level=1, free_cache_engine=True)
    sync.init()
    result = sync.sync(peft_model, version=step)   # result.decision.parts: ("base", "adapter") first,
                                                   # then ("adapter",) while the engine keeps its base
    llm.generate(prompts, params, lora_request=sync.lora_request())
    sync.engine_lost_weights()                     # when the engine reports it freed its weights

What travels is decided by `hal.sync.lora.policy.decide_lora_sync` (through `BaseWeightTracker`):
base and adapter on the first sync and after the engine lost its weights (sleep level 2
with `free_cache_engine`), the adapter alone otherwise.

Worker side (`HalLoraWeightTransferEngine`, a subclass of the "hal" engine): the receiver
accepts the engine's checkpoint specs plus the adapter specs computed from the engine's
own base shapes and the adapter config (`hal.sync.lora.peft.adapter_specs`), never from the
trainer's model, and refuses a sync that carries only part of the adapter before anything
is applied. Base tensors go through the "hal" engine's layerwise reload. Adapter tensors
are copied out of the receive buckets and built into a vLLM `LoRAModel`
(`LoRAModel.from_lora_tensors` with a `PEFTHelper` from the adapter config, checked
against the engine's LoRA config) while the sync is in progress, so an adapter vLLM would
refuse fails the sync on every rank.

How the engine then serves it follows from vLLM 0.32 itself: when a weight update
finishes, the worker drops every loaded adapter (`finish_weight_update` calls
`reset_lora_state`: adapters are treated as invalid once the base changed), and a request
naming an adapter that is not loaded makes the worker load it from the request's path.
So after a completed sync each worker publishes the adapter in peft's layout
(`adapter_model.safetensors`, `adapter_config.json`, each file replaced atomically) in
`adapter_dir`, a directory on the engine's node, and `LoRARequest(lora_name, lora_int_id,
adapter_dir)` makes the next request load it with vLLM's own loader and checks. A
refused sync publishes nothing: the engine keeps serving the previous adapter. The
adapter bytes cross the trainer->engine link once through hal; the directory is the
engine-local hand-over (on a tmpfs such as /dev/shm, a memory copy).

Compare verl, which ships the tensors inside a `LoRARequest` subclass through a remote
call and patches the worker's `_load_adapter`; here the tensors come through hal's
receiver (any transport, any backend) and nothing in vLLM is patched.

Registration: an installed verl-hal declares the `vllm.general_plugins` entry point
`hal_lora_weight_transfer = "hal.integrations.vllm.lora:register"` (pyproject.toml), and
vLLM runs general plugins in every process it starts (API server, engine core, workers),
so every process knows "hal-lora" without user code. Importing this module also registers
it (`register()`, idempotent; an import-time side effect on purpose, for a checkout that is
not installed). `worker_extension_cls="hal.integrations.vllm.lora.HalLoraWorkerExtension"`
adds the worker-side queries (`hal_lora_loaded_adapter_ids`, `hal_lora_adapter_version`)
reachable through `collective_rpc`; importing it in a worker process registers the
backend there too.

A sharded trainer (FSDP2) sends from every rank: `LoraWeightSync(..., trainer_group=g,
senders="all")` on every rank of `g`; each rank sends its rows of what travels and each
worker receives from all of them (hal.integrations.vllm.lora_sync, docs/vllm.md).

Where each part lives: the worker side (`HalLoraInitInfo`, `HalLoraWeightTransferEngine`)
in hal.integrations.vllm.lora_engine, the trainer side (`LoraWeightSync`, `LoraEngine`,
`lora_request`) in hal.integrations.vllm.lora_sync; this module re-exports both and holds
the registration.

Nothing here is specific to a device: the group and synchronisation come from
`hal.current()`, as in the "hal" engine.
"""

from __future__ import annotations

from hal.integrations.vllm import internals as vllm_internals
from hal.integrations.vllm.engine import register_engine
from hal.integrations.vllm.lora_engine import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    BACKEND_NAME,
    DEFAULT_LORA_ID,
    DEFAULT_LORA_NAME,
    HalLoraInitInfo,
    HalLoraWeightTransferEngine,
)
from hal.integrations.vllm.lora_sync import LoraEngine, LoraSyncResult, LoraWeightSync, default_adapter_dir, lora_request

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "BACKEND_NAME",
    "DEFAULT_LORA_ID",
    "DEFAULT_LORA_NAME",
    "HalLoraInitInfo",
    "HalLoraWeightTransferEngine",
    "HalLoraWorkerExtension",
    "LoraEngine",
    "LoraSyncResult",
    "LoraWeightSync",
    "default_adapter_dir",
    "lora_request",
    "register",
]


class HalLoraWorkerExtension:
    """`worker_extension_cls="hal.integrations.vllm.lora.HalLoraWorkerExtension"`: makes
    "hal-lora" known in every worker process without the plugin entry point (vLLM imports
    this module in each worker before it builds the weight-transfer engine, and importing
    it registers the backend), and answers queries through `collective_rpc` by name.
    """

    def hal_lora_loaded_adapter_ids(self) -> list[int]:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, HalLoraWeightTransferEngine):
            raise RuntimeError(
                f"hal-lora: this worker's weight-transfer engine is {type(engine).__name__}; "
                f"start vLLM with WeightTransferConfig(backend={BACKEND_NAME!r})"
            )
        return engine.loaded_adapter_ids()

    def hal_lora_adapter_version(self) -> int | None:
        engine = getattr(self, "weight_transfer_engine", None)
        return engine.adapter_version if isinstance(engine, HalLoraWeightTransferEngine) else None


def register() -> None:
    """Make `backend="hal-lora"` known to vLLM's engine factory (idempotent; any process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    register_engine(WeightTransferEngineFactory, BACKEND_NAME, *LORA_ENGINE_CLASS[vllm_internals.engine_owns_updates()])


# The engine class for "hal-lora", by API generation (as hal.integrations.vllm.engine.ENGINE_CLASS).
LORA_ENGINE_CLASS = {
    True: ("hal.integrations.vllm.lora", "HalLoraWeightTransferEngine"),
    False: ("hal.integrations.vllm.engine_v023", "HalLoraWeightTransferEngineV023"),
}


# Importing this module is how a worker learns the backend when the engine names
# `HalLoraWorkerExtension` (see its docstring); registering is idempotent.
register()
