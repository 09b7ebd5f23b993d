"""Integrations with inference engines.

What importing each module does (`import hal` and `import hal.integrations` import none
of them, and no engine):

- `hal.integrations.vllm`: the vLLM weight-transfer engine `backend="hal"` (worker side).
  Imports vLLM's weight-transfer base classes at import time (it subclasses them).
  vLLM calls its `register()` in every process through the `vllm.general_plugins` entry
  point `hal_weight_transfer` that pyproject.toml declares; importing it registers nothing.
- `hal.integrations.vllm_lora`: the LoRA engine `backend="hal-lora"`. Importing it
  registers the backend (also declared as the entry point `hal_lora_weight_transfer`).
- `hal.integrations.vllm_client`: the trainer side, driving offline `LLM`s, HTTP servers
  and vLLM's trainer factory. Imports vLLM's trainer base classes at import time.
- `hal.integrations.vllm_internals`: every private vLLM name verl-hal uses, behind a
  version check. Imports vLLM only inside its functions.
"""
