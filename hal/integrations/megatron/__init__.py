"""A Megatron-core trainer as a source of hal's M-to-N sync: every tensor- and
pipeline-parallel rank sends its own shards, under Hugging Face names, and nothing is
gathered (docs/megatron.md).

    source = MegatronSource(model)                    # on every TP x PP rank, its GPTModel (or its chunks)
    sender = ShardedSender(transport, trainer_group=dist.group.WORLD)
    sender.sync(source, version=step)                 # metrics.bytes: this rank's shards

    # or through vLLM's engine: WeightSync(engines, trainer_group=..., senders="all").sync(source, version=step)

Each rank declares what it holds of each Hugging Face tensor (hal.integrations.megatron.convert:
rows of `q_proj`/`k_proj`/`v_proj` de-interleaved from its `linear_qkv` shard, rows of
`gate_proj`/`up_proj`, columns of `o_proj`/`down_proj`, its vocab rows, whole norms),
and hal's plan (hal.sync.plan.shards) checks that the blocks tile every tensor exactly once
and tells each rank what it sends: its own blocks, and its part of the tensors it holds
with other ranks (a norm every TP rank of a stage holds).
"""

from __future__ import annotations

from hal.integrations.megatron.convert import MegatronShape, assemble, hf_state, hf_tensors
from hal.integrations.megatron.source import MegatronSource

__all__ = ["MegatronShape", "MegatronSource", "assemble", "hf_state", "hf_tensors"]
