"""Integrations with inference engines.

What importing each module does (`import hal` and `import hal.integrations` import none
of them, and no engine):

- `hal.integrations.vllm`: the vLLM weight-transfer engine `backend="hal"` (worker side),
  with `vllm_info` (its init and update info, transports, dtype names) and `_reload`.
  Imports vLLM's weight-transfer base classes at import time (it subclasses them).
  vLLM calls its `register()` in every process through the `vllm.general_plugins` entry
  point `hal_weight_transfer` that pyproject.toml declares; importing it registers nothing.
- `hal.integrations.vllm_lora`: the LoRA engine `backend="hal-lora"`. Importing it
  registers the backend (also declared as the entry point `hal_lora_weight_transfer`).
- `hal.integrations.vllm_client`: the trainer side (`WeightSync`), driving vLLM's own
  weight-sync clients (HTTP servers, Ray actors), offline `LLM`s, and vLLM's trainer
  factory; it gathers the names of vllm_weight_sync, vllm_engines and
  vllm_trainer_engine. Imports vLLM's trainer base classes and clients at import time.
- `hal.integrations.ray`: Ray placement and tear-down (ray_placement, ray_scope). Imports
  no Ray until called.
- `hal.integrations.verl_plugin`: verl's platform and checkpoint engine "hal"
  (verl_platform, verl_checkpoint with verl_settings, verl_weights and verl_topology: the
  sync groups of one update, one per sending trainer rank with `senders: all`). Imports verl.
- `hal.integrations.megatron`: a Megatron-core trainer as a source of the M-to-N sync
  (`MegatronSource`: each TP x PP rank's shards under Hugging Face names; `convert`: the
  rules; `_internals`: every megatron-core name read; `verl_engine`: verl's Megatron
  engine). Imports neither megatron-core nor verl until called (docs/megatron.md).
- `hal.integrations.vllm_internals`: every private vLLM name verl-hal uses, behind a
  version check; `vllm_needs` lists them with how hal calls them and in which releases
  (tests/hosts/ reads them against real vLLM sources). Imports vLLM only inside its functions.
"""
