"""Every megatron-core name hal reads, in one place (the fence).

megatron-core has no stable API for what a weight sync needs: which tensor-parallel rank
this is, the model's attention shape, which global layers a pipeline stage holds. This
module reads them from megatron-core 0.16 (`parallel_state`, `TransformerConfig`,
`GPTModel` and its decoder's layers); when a release moves one, this file alone changes,
and it fails with the name it could not find rather than with an AttributeError deep in
a sync. Nothing here is imported by `import hal`; megatron-core is imported on first use.
"""

from __future__ import annotations

from typing import Any

import torch

from hal.integrations.megatron.convert import MegatronShape

SUPPORTED = "megatron-core 0.16"
# the model's buffers that travel (a parameter in Hugging Face's checkpoint, a buffer in Megatron's)
BUFFERS = ("mlp.router.expert_bias",)


def _megatron() -> Any:
    try:
        from megatron.core import parallel_state
    except ImportError as exc:
        raise ImportError(f"hal.integrations.megatron needs megatron-core ({SUPPORTED}; the [megatron] extra): {exc}") from exc
    return parallel_state


def unwrap(model: Any) -> Any:
    """The `GPTModel` inside Megatron's wrappers (DistributedDataParallel, Float16Module:
    both keep it as `.module`)."""
    seen = 0
    while not hasattr(model, "decoder") and hasattr(model, "module") and seen < 8:
        model, seen = model.module, seen + 1
    for attr in ("decoder", "config"):
        if not hasattr(model, attr):
            raise TypeError(f"not a Megatron GPTModel: a {type(model).__name__} without {attr!r} ({SUPPORTED})")
    return model


def _config(model: Any, field: str) -> Any:
    config = model.config
    if not hasattr(config, field):
        raise AttributeError(f"Megatron TransformerConfig has no {field!r}: hal reads {SUPPORTED}'s")
    return getattr(config, field)


def layer_numbers(model: Any) -> dict[int, int]:
    """Local layer index -> global layer index (0-based) of one model chunk."""
    layers = model.decoder.layers
    return {i: int(layer.layer_number) - 1 for i, layer in enumerate(layers)}


def shape_of(model: Any, hf_vocab_size: int | None) -> MegatronShape:
    """The model's shape and this rank's place in its parallel groups."""
    ps = _megatron()
    heads = int(_config(model, "num_attention_heads"))
    groups = _config(model, "num_query_groups") or heads
    hidden = int(_config(model, "hidden_size"))
    head_dim = _config(model, "kv_channels") or hidden // heads
    experts = _config(model, "num_moe_experts")
    vocab = int(model.vocab_size)
    return MegatronShape(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(groups),
        head_dim=int(head_dim),
        ffn_hidden_size=int(_config(model, "ffn_hidden_size")),
        vocab_size=vocab,
        hf_vocab_size=vocab if hf_vocab_size is None else int(hf_vocab_size),
        gated=bool(_config(model, "gated_linear_unit")),
        tied=bool(model.share_embeddings_and_output_weights),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        layers=layer_numbers(model),
        moe_ffn_hidden_size=_config(model, "moe_ffn_hidden_size") if experts else None,
        num_experts=int(experts) if experts else None,
        ep_rank=ps.get_expert_model_parallel_rank() if experts else 0,
        ep_size=ps.get_expert_model_parallel_world_size() if experts else 1,
        expert_tp_rank=ps.get_expert_tensor_parallel_rank() if experts else 0,
        expert_tp_size=ps.get_expert_tensor_parallel_world_size() if experts else 1,
    )


def local_named(model: Any) -> list[tuple[str, torch.Tensor]]:
    """The chunk's parameters and the buffers that travel, as this rank holds them, out of autograd."""
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    named += [(n, b.detach()) for n, b in model.named_buffers() if n.endswith(BUFFERS)]
    return named
