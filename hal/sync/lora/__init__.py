"""LoRA: what a LoRA sync sends (`policy`: `decide_lora_sync`, `BaseWeightTracker`) and a
`peft.PeftModel` read by its names (`peft`)."""

from hal.sync.lora.peft import (
    MergedSource,
    PEFT_PREFIX,
    adapter_config,
    adapter_specs,
    adapter_tensors,
    adapter_weight_name,
    base_tensors,
    base_weight_name,
    merged_tensors,
)
from hal.sync.lora.policy import BaseWeightTracker, LoraSyncDecision, SLEEP_LEVELS, decide_lora_sync

__all__ = [
    "BaseWeightTracker",
    "LoraSyncDecision",
    "MergedSource",
    "PEFT_PREFIX",
    "SLEEP_LEVELS",
    "adapter_config",
    "adapter_specs",
    "adapter_tensors",
    "adapter_weight_name",
    "base_tensors",
    "base_weight_name",
    "decide_lora_sync",
    "merged_tensors",
]
