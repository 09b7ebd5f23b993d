"""Tiny transformers-5 MoE models, built locally (no hub): what hal's checkpoint layout
(hal.sync.adapters.checkpoint_layout) is tested on. transformers 5 keeps each layer's experts as 3-D
parameters (`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj` (E, H, I));
their checkpoints, and vLLM's loaders, hold one tensor per expert."""

from __future__ import annotations

import torch

COMMON = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
)
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "llama")


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer model of `family`: Qwen3-MoE (4 experts), Qwen2-MoE (4 experts and a shared
    expert), Mixtral (8 experts, renamed `block_sparse_moe` in its checkpoint), or a dense
    Llama (no conversion at all). Every tensor filled from `seed`."""
    import transformers

    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**COMMON, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16)
        model = transformers.Qwen3MoeForCausalLM(config)
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2
        )
        model = transformers.Qwen2MoeForCausalLM(config)
    elif family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2))
    elif family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    else:
        raise ValueError(f"tiny_model: unknown family {family!r}; one of {FAMILIES}")
    redraw(model, seed)
    return model.eval()


def redraw(model: torch.nn.Module, seed: int) -> None:
    """New values for every parameter and persistent buffer, in place (an optimizer step)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict(keep_vars=True).values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=g).to(tensor.dtype))
