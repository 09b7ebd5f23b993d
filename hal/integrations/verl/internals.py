"""The one place verl-hal touches verl's private names, and the verl releases it was checked against.

verl's public surface for plugins (`verl.plugin.platform.PlatformBase`,
`PlatformRegistry`, `get_platform`; `verl.checkpoint_engine.CheckpointEngine`,
`CheckpointEngineRegistry`; `verl.workers.engine.EngineRegistry.register`) is used
directly elsewhere. What verl offers no public way to ask goes through this module, each
function saying what it reaches into; when verl moves one of these, this file is the one
to change. Importing this module imports no verl module.
"""

from __future__ import annotations

import functools
import sys
from importlib import metadata
from typing import Any

from hal.integrations._shared import release_of

# The verl releases (major, minor) whose plugin interfaces verl-hal was checked against.
SUPPORTED_VERL = ((0, 9),)


@functools.lru_cache(maxsize=1)
def verl_version() -> str:
    """The installed verl's version (from its distribution metadata; verl is not imported)."""
    try:
        return metadata.version("verl")
    except metadata.PackageNotFoundError:
        return "not installed"


def unsupported_verl() -> str | None:
    """None when the installed verl is one of `SUPPORTED_VERL`, else a one-line reason."""
    version = verl_version()
    if release_of(version) in SUPPORTED_VERL:
        return None
    wanted = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VERL)
    return f"verl-hal's verl plugin was checked against verl {wanted}; verl {version} is installed (see hal/integrations/verl/internals.py)"


def platform_chosen() -> bool:
    """Whether verl has chosen its platform singleton in this process: reads
    `verl.plugin.platform.platform_manager._current_platform` (verl has no public query;
    `get_platform()` would choose one)."""
    from verl.plugin.platform import platform_manager

    return platform_manager._current_platform is not None


# ---- senders "all": the training engine's own shards ------------------------------------------
# verl 0.9.1 hands a checkpoint engine's `send_weights` the generator of
# `engine.get_per_tensor_param()` (`ActorRolloutRefWorker.update_weights`,
# verl/workers/engine_workers.py:764-765; the test helper `TrainingWorkerTest.update_weights`
# alike), which for FSDP gathers every tensor on every rank
# (`param.to(device).full_tensor()`, verl/workers/engine/fsdp/transformer_impl.py:1026-1033).
# Only its own "delta_sharded" backend gets the training engine itself (engine_workers.py:759-762).
# The functions below reach the engine and its module's shards without that gather.

_MAX_CALLERS = 32


def owning_worker(checkpoint_engine: object) -> Any:
    """The verl worker whose `checkpoint_engine` attribute is `checkpoint_engine`, or None.

    verl gives a checkpoint engine no reference to its worker; it calls every method of it
    from a method of that worker on the same thread: `send_weights` from
    `update_weights` (engine_workers.py:762-765), `prepare` / `init_process_group` /
    `finalize` from `execute_checkpoint_engine` (engine_workers.py:830-839, and
    `CheckpointEngineWorker`'s in verl/checkpoint_engine/base.py). So the worker is the
    `self` of a caller on this thread's stack: read from the callers' frames
    (`sys._getframe`), at most `_MAX_CALLERS` up. Call it from the engine's method itself,
    before any `await`.
    """
    frame = sys._getframe(1)
    for _ in range(_MAX_CALLERS):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and owner is not checkpoint_engine and getattr(owner, "checkpoint_engine", None) is checkpoint_engine:
            return owner
        frame = frame.f_back
    return None


def training_engine(worker: object) -> Any:
    """A verl trainer worker's training engine, or None (a rollout worker has none):
    `TrainingWorker.engine` (engine_workers.py:136) or `ActorRolloutRefWorker.actor.engine`
    (engine_workers.py:644)."""
    for holder in (worker, getattr(worker, "actor", None)):
        engine = getattr(holder, "engine", None)
        if engine is not None and callable(getattr(engine, "get_per_tensor_param", None)):
            return engine
    return None


def training_module(engine: object) -> Any:
    """The torch module a training engine computes with (verl's FSDP engine: `engine.module`,
    transformer_impl.py), or None (an engine without one, such as verl's Megatron engine,
    whose `module` is a list of model chunks)."""
    import torch

    module = getattr(engine, "module", None)
    return module if isinstance(module, torch.nn.Module) else None


def canary_refusal(engine: object) -> str | None:
    """Why the canary cannot run the probe through `engine`'s module as verl would, or None.
    verl's FSDP engine with Ulysses sequence parallelism (`ulysses_sequence_parallel_size`
    > 1, transformer_impl.py) patches attention to expect each rank's slice of a sequence:
    a whole probe on every rank would be scored wrong, so it is refused by name."""
    if training_module(engine) is None:
        return f"the training engine {type(engine).__name__} has no torch module to run the probe through"
    size = getattr(engine, "ulysses_sequence_parallel_size", 1)
    if isinstance(size, int) and size > 1:
        return f"Ulysses sequence parallelism is on (ulysses_sequence_parallel_size={size}): the probe's forward would need verl's sequence split"
    return None


def module_on_device(engine: object) -> Any:
    """A context in which `engine`'s module holds its parameters on the device: with parameter
    offload on (`is_param_offload_enabled`; verl's `get_per_tensor_param` offloads the module
    again after reading it, transformer_impl.py), verl's own `engine.eval_mode()`, which loads
    the parameters and offloads them on exit (verl/workers/engine/base.py, `BaseEngineCtx`);
    else nothing."""
    import contextlib

    if getattr(engine, "is_param_offload_enabled", False) is True:
        return engine.eval_mode()
    return contextlib.nullcontext()


def server_adapter(worker: object) -> Any:
    """A verl rollout worker's server adapter (`CheckpointEngineWorker.server_adapter`,
    verl/checkpoint_engine/base.py: the object its `update_weights` hands
    `receive_weights` to), or None."""
    return getattr(worker, "server_adapter", None)


def is_training_engine(obj: object) -> bool:
    """Whether `obj` is a verl training engine (what verl passes to `send_weights` of
    shard-operating backends) rather than a weight generator."""
    return callable(getattr(obj, "get_per_tensor_param", None)) and not hasattr(obj, "__next__") and not hasattr(obj, "__anext__")


def shard_refusal(engine: object) -> str | None:
    """Why `engine`'s module shards are not what `get_per_tensor_param()` would yield, or None.

    The shards are `engine.module.state_dict()` under verl's names (`fsdp_shards`); verl's
    generator yields the same tensors gathered, except for: LoRA models (peft: adapters or
    merged weights), QAT (quantized on the way: `engine._qat_enabled`, set at
    transformer_impl.py:174), Transformers 5 packed MoE experts (unfused into per-expert
    tensors by `verl.workers.engine.fsdp.utils.unfuse_moe_params`, transformer_impl.py:1034,
    asked here of meta tensors of each parameter's shape), and FSDP1 modules (whose state
    dict gathers: `verl.utils.fsdp_utils.fsdp_version`). Each of these is refused by name.
    """
    from hal.integrations.megatron import verl_engine

    if verl_engine.is_megatron_engine(engine):  # verl's Megatron engine: its own reasons
        return verl_engine.refusal(engine)
    import torch
    from verl.utils.fsdp_utils import fsdp_version
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    module = getattr(engine, "module", None)
    strategy = getattr(getattr(engine, "engine_config", None), "strategy", None)
    if not isinstance(module, torch.nn.Module) or strategy not in ("fsdp", "fsdp2"):
        return f"the training engine {type(engine).__name__} (strategy {strategy!r}) is not verl's FSDP engine with one module; senders 'all' reads FSDP2 shards"
    version = fsdp_version(module)
    if version != 2:
        return f"the model is {'FSDP1-wrapped' if version == 1 else 'not FSDP-wrapped'}; senders 'all' reads FSDP2 (fully_shard) shards"
    if hasattr(getattr(module, "_fsdp_wrapped_module", module), "peft_config"):
        return "a LoRA (peft) model: verl's weight generator sends its adapters or merged weights, not its parameters"
    if getattr(engine, "_qat_enabled", False):
        return "QAT is on: verl's weight generator quantizes the weights on the way"
    model_type = getattr(getattr(getattr(engine, "model_config", None), "hf_config", None), "model_type", None)
    for name, param in fsdp_shards(engine):  # the names verl's generator unfuses from
        meta = [(name, torch.empty(tuple(param.shape), dtype=param.dtype, device="meta"))]
        unfused = [n for n, _ in unfuse_moe_params(meta, model_type)]
        if unfused != [name]:
            return f"parameter {name!r} is a packed MoE tensor that verl's weight generator unfuses into {len(unfused)} tensors"
    return None


def engine_shards(engine: object) -> Any:
    """What a training engine holds, as a sharded sync's source: an FSDP engine's shards
    (`fsdp_shards`), or a Megatron engine's under Hugging Face names
    (hal.integrations.megatron.verl_engine)."""
    from hal.integrations.megatron import verl_engine

    return verl_engine.source(engine) if verl_engine.is_megatron_engine(engine) else fsdp_shards(engine)


def fsdp_shards(engine: object) -> list[tuple[str, Any]]:
    """The FSDP engine's weights as this rank holds them: `engine.module.state_dict()` under
    verl's names, the first two steps of verl's own `get_per_tensor_param` and
    `get_per_tensor_param_shard` (transformer_impl.py:1016-1018 and 928-929:
    `convert_weight_keys(module.state_dict(), module)`), FSDP2 DTensors as they are (no
    gather, no copy, the trainer's dtype). verl's names are the `KeyMapping` adapter's
    (hal.sync.adapters: the same reversal of a model's `_checkpoint_conversion_mapping`)."""
    from hal.sync.adapters import KeyMapping, adapt

    module = engine.module
    return list(adapt(module.state_dict().items(), KeyMapping.of(getattr(module, "_fsdp_wrapped_module", module))))
