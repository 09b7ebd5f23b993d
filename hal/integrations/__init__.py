"""Integrations with the hosts a weight sync runs in, one package per host.

What importing each does (`import hal` and `import hal.integrations` import none of them,
and no host):

- `hal.integrations.vllm`: vLLM's weight-transfer engines `backend="hal"` and "hal-lora"
  (worker side) and the trainer side that drives them (`vllm.client`: `WeightSync`, over
  vLLM's own HTTP and Ray clients). Importing the package imports no vLLM; its modules say
  what they import. vLLM calls `register()` in every process through the
  `vllm.general_plugins` entry points pyproject.toml declares; on vLLM 0.23-0.24 (and
  vllm-ascend 0.23.0.post1), where the worker owns each update, it registers the engines of
  `vllm.engine_v023`.
- `hal.integrations.verl`: verl's platform and checkpoint engine "hal"; `verl.plugin` is
  the `verl.plugins` entry point (imports verl).
- `hal.integrations.ray`: Ray placement and tear-down. Imports no Ray until called.
- `hal.integrations.megatron`: a Megatron-core trainer as a source of the M-to-N sync
  (`MegatronSource`: each TP x PP rank's shards under Hugging Face names; `convert`: the
  rules; `_internals`: every megatron-core name read; `verl_engine`: verl's Megatron
  engine). Imports neither megatron-core nor verl until called (docs/megatron.md).
- `_shared`: small helpers the hosts' packages share (threads, results, version strings).

Every private vLLM or verl name verl-hal uses is behind one fenced module per host
(`vllm.internals`, `verl.internals`), version-checked; `vllm.needs` and `vllm.needs_v023`
list them with the releases they hold in (tests/hosts/ reads them against real sources);
every megatron-core name read is in `megatron._internals`.
"""
