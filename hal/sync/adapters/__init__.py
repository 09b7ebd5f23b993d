"""Trainer tensors as checkpoint tensors: the state-dict adapter, one contract for the names
and layouts a sync sends under (`base`: `StateDictAdapter`, its `Rule`s, `Chain`, `adapt`).

Its implementations, each one mapping:
- `names`: `Unwrap` (wrapper prefixes), `Rename` (a caller's function), `KeyMapping`
  (transformers 4's `_checkpoint_conversion_mapping`; verl's `convert_weight_keys`);
- `checkpoint_layout`: a transformers 5 model's packed experts as the checkpoint's
  per-expert tensors, views of the 3-D parameters (`CheckpointLayout`);
- `peft`: a peft model's base (`PeftBase`), adapter (`PeftAdapter`) or merged weights
  (`PeftMerge`);
- Megatron-core's fused and tensor-parallel shards as Hugging Face blocks:
  hal.integrations.megatron.convert (`MegatronLayout`).

Imports nothing of hal.sync but its base vocabulary.
"""

from hal.sync.adapters.base import PLAIN, Chain, Derived, NameAdapter, Renamed, Rule, StateDictAdapter, adapt, stand_in
from hal.sync.adapters.checkpoint_layout import CheckpointLayout, checkpoint_layout
from hal.sync.adapters.names import WRAPPER_COMPONENTS, KeyMapping, Rename, Unwrap, unwrapped_name
from hal.sync.adapters.peft import PeftAdapter, PeftBase, PeftMerge

__all__ = [
    "PLAIN",
    "WRAPPER_COMPONENTS",
    "Chain",
    "CheckpointLayout",
    "Derived",
    "KeyMapping",
    "NameAdapter",
    "PeftAdapter",
    "PeftBase",
    "PeftMerge",
    "Rename",
    "Renamed",
    "Rule",
    "StateDictAdapter",
    "Unwrap",
    "adapt",
    "checkpoint_layout",
    "stand_in",
    "unwrapped_name",
]
