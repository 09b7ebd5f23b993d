"""vLLM's LoRA manager as the "hal-lora" engine reaches it: the manager of the engine's
model, its target modules and checks, and a `LoRAModel` built from received tensors as vLLM's
own loader builds one from disk.
"""

from __future__ import annotations

from typing import Any

import torch

from hal.integrations.vllm.internals.versions import RENAME_MAPPER_SINCE, UNSTACKED_MAPPER_SINCE, vllm_release

# ---- LoRA manager internals -----------------------------------------------------------------
# The first release whose engine keeps the model it was built for apart from the one an
# update targets (`_default_model`); before it (0.23-0.25) the engine has one model, `engine.model`.
DEFAULT_MODEL_SINCE = (0, 26)


def lora_manager(engine: Any) -> Any:
    """The LoRA manager of a weight-transfer engine's default model (`engine._default_model`,
    set by vLLM's `WeightTransferEngine.__init__`; `engine.model` before vLLM 0.26), or None
    without LoRA."""
    model = engine.model if vllm_release() < DEFAULT_MODEL_SINCE else getattr(engine, "_default_model", None)
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
    release = vllm_release()
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
    return vllm_release() >= LORA_RELOAD_SINCE


def loaded_lora_ids(manager: Any) -> list[int]:
    return sorted(manager.list_adapters())
