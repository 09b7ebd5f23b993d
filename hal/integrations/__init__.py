"""Integrations with inference engines. Each module imports its engine lazily.

- `hal.integrations.vllm`: the vLLM weight-transfer engine `backend="hal"` (worker side),
  registered through the `vllm.general_plugins` entry point.
- `hal.integrations.vllm_client`: the trainer side, driving offline `LLM`s and HTTP servers.
- `hal.integrations.tiny_model`: tiny local Llama models for the demo, tests and benchmark.
"""
