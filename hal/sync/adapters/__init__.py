"""Trainer tensors as the checkpoint holds them: names and layouts.

- `checkpoint_layout`: a transformers model's tensors as `save_pretrained` writes them (its
  3-D expert parameters as per-expert views), from transformers' own conversion mapping.

Issue 40 (item 5) makes these one contract, a state-dict adapter, composable; Megatron's
rules (hal.integrations.megatron.convert), peft's merge (hal.sync.lora.peft) and wrapper
prefixes (hal.sync.source.unwrapped_name) become implementations of it. Imports nothing of
hal.sync but its base vocabulary.
"""

from hal.sync.adapters.checkpoint_layout import checkpoint_layout

__all__ = [
    "checkpoint_layout",
]
