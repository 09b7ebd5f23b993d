"""verl 0.9.1's Megatron training engine as a source of hal's checkpoint engine with
`senders: all` (docs/megatron.md, "verl's Megatron engine").

verl's `MegatronEngine` (verl/workers/engine/megatron/transformer_impl.py) keeps its model
as a list of Megatron chunks, `engine.module` (line 581: `self._build_megatron_module()`),
and its weight generator `get_per_tensor_param` (lines 1033-1063) exports whole Hugging Face
tensors through Megatron-Bridge (`bridge.export_hf_weights`), which gathers every tensor
across TP, PP and EP. With `senders: all` hal reads the chunks instead: each rank's own
shards under Hugging Face names (`MegatronSource`), nothing gathered.

What verl's generator does on the way and these shards cannot stand for is refused by
name, as for the FSDP engine (hal.integrations.verl.internals.shard_refusal): LoRA
(`engine.peft_cls`, line 435: the generator sends adapters or merged weights), QAT
(`engine._qat_enabled`, line 211: quantized on the way), offloaded parameters
(`engine._is_offload_param`, line 197: the generator loads them first), and model types
whose Hugging Face names hal's rules do not cover.

Every name read from verl is here; nothing imports verl or megatron-core at import time.
"""

from __future__ import annotations

from typing import Any

STRATEGY = "megatron"  # verl's McoreEngineConfig.strategy (verl/workers/config/engine.py:211)
# the Hugging Face model types whose names and layouts hal.integrations.megatron.convert writes
MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe")


def is_megatron_engine(engine: object) -> bool:
    """Whether `engine` is verl's Megatron training engine (its config's strategy)."""
    return getattr(getattr(engine, "engine_config", None), "strategy", None) == STRATEGY


def _hf_config(engine: object) -> Any:
    return getattr(getattr(engine, "model_config", None), "hf_config", None)


def refusal(engine: object) -> str | None:
    """Why this Megatron engine's shards are not what its weight generator would yield, or None."""
    module = getattr(engine, "module", None)
    if not isinstance(module, (list, tuple)) or not module:
        return f"the Megatron engine {type(engine).__name__} has no list of model chunks (`engine.module`)"
    if getattr(engine, "peft_cls", None) is not None:
        return "a LoRA (Megatron peft) model: verl's weight generator sends its adapters or merged weights, not its parameters"
    if getattr(engine, "_qat_enabled", False):
        return "QAT is on: verl's weight generator quantizes the weights on the way"
    if getattr(engine, "_is_offload_param", False):
        return "param_offload is on: the parameters are in host memory between steps (verl's generator loads them back first)"
    model_type = getattr(_hf_config(engine), "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model type {model_type!r}: hal's Megatron name rules cover {list(MODEL_TYPES)}"
    return None


def source(engine: object) -> Any:
    """This rank's shards of the engine's model under Hugging Face names (no gather); the
    Hugging Face vocabulary cuts Megatron's padding rows."""
    from hal.integrations.megatron.source import MegatronSource

    vocab = getattr(_hf_config(engine), "vocab_size", None)
    return MegatronSource(list(engine.module), hf_vocab_size=vocab)
