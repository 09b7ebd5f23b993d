"""Synthetic weight sets shaped like real decoder-only models, for the sync benchmark.

Only names, shapes and dtypes matter to a transfer, so a preset is a model config
(the numbers from the model's published `config.json`) that expands into the list of
parameters a Qwen2-architecture checkpoint holds, in checkpoint order:

    qwen2.5-0.5b   290 tensors, 0.92 GiB bf16 (the embedding alone is 272 MB > 256 MiB)
    qwen2.5-1.5b   338 tensors, 2.88 GiB bf16
    moe-16k        16,347 tensors, 1.0 GiB bf16: a Qwen3-MoE layout (per layer a router
                   and 224 experts of gate/up/down, q/k norms, no biases) scaled down so
                   that it fits here, with the tensor count of the MoE models RL runs on
                   (Qwen3-30B-A3B: about 18,900 tensors)
    tiny           26 tensors, 0.27 MiB bf16 (for tests: seconds, not minutes)
    split-<n>      64 MiB of bf16 in n equal tensors (n = 64, 1024, 4096, 16384): the same
                   bytes in more and more tensors, so that what a sync costs per tensor,
                   not per byte, is the difference between them (issue 19's measurement)
    split-<n>-1g   the same at 1 GiB (n = 64, 16384): issue 30's target compares the two

With tied embeddings (both Qwen2.5 sizes here) `lm_head.weight` is the embedding and is
not a separate tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hal.sync.spec import TensorSpec

# One parameter as the transfer sees it: described exactly like any sync's tensors.
Param = TensorSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Preset:
    """A Qwen2-architecture model's shape-defining config."""

    name: str
    """The `--preset` value."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_embeddings: bool = True
    """When False, `lm_head.weight` is a tensor of its own (vocab x hidden)."""
    attention_bias: bool = True
    """q/k/v biases (Qwen2); Qwen3 has none and normalizes q and k per head instead."""
    num_experts: int = 0
    """0: a dense MLP. Otherwise a Qwen3-MoE block: a router `mlp.gate.weight` (experts x
    hidden) and `mlp.experts.<e>.{gate,up,down}_proj.weight` of `moe_intermediate_size`."""
    moe_intermediate_size: int = 0
    dtype: torch.dtype = torch.bfloat16
    description: str = ""

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"preset {self.name!r}: {field} must be a positive integer, got {value!r}")
        if self.num_experts < 0 or (self.num_experts > 0) != (self.moe_intermediate_size > 0):
            raise ValueError(
                f"preset {self.name!r}: num_experts ({self.num_experts}) and moe_intermediate_size "
                f"({self.moe_intermediate_size}) must both be positive (MoE) or both 0 (dense)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"preset {self.name!r}: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    def params(self) -> list[Param]:
        """Every parameter, in the order a checkpoint lists them."""
        h, dt = self.hidden_size, self.dtype
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        out = [Param("model.embed_tokens.weight", (self.vocab_size, h), dt)]
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            out += [Param(p + "self_attn.q_proj.weight", (q_out, h), dt)]
            out += [Param(p + "self_attn.q_proj.bias", (q_out,), dt)] if self.attention_bias else []
            out += [Param(p + "self_attn.k_proj.weight", (kv_out, h), dt)]
            out += [Param(p + "self_attn.k_proj.bias", (kv_out,), dt)] if self.attention_bias else []
            out += [Param(p + "self_attn.v_proj.weight", (kv_out, h), dt)]
            out += [Param(p + "self_attn.v_proj.bias", (kv_out,), dt)] if self.attention_bias else []
            out += [Param(p + "self_attn.o_proj.weight", (h, q_out), dt)]
            if not self.attention_bias:  # Qwen3: per-head q/k norms
                out += [Param(p + "self_attn.q_norm.weight", (self.head_dim,), dt), Param(p + "self_attn.k_norm.weight", (self.head_dim,), dt)]
            if self.num_experts:
                m = self.moe_intermediate_size
                out.append(Param(p + "mlp.gate.weight", (self.num_experts, h), dt))
                for e in range(self.num_experts):
                    q = f"{p}mlp.experts.{e}."
                    out += [
                        Param(q + "gate_proj.weight", (m, h), dt),
                        Param(q + "up_proj.weight", (m, h), dt),
                        Param(q + "down_proj.weight", (h, m), dt),
                    ]
            else:
                out += [
                    Param(p + "mlp.gate_proj.weight", (self.intermediate_size, h), dt),
                    Param(p + "mlp.up_proj.weight", (self.intermediate_size, h), dt),
                    Param(p + "mlp.down_proj.weight", (h, self.intermediate_size), dt),
                ]
            out += [Param(p + "input_layernorm.weight", (h,), dt), Param(p + "post_attention_layernorm.weight", (h,), dt)]
        out.append(Param("model.norm.weight", (h,), dt))
        if not self.tie_embeddings:
            out.append(Param("lm_head.weight", (self.vocab_size, h), dt))
        return out

    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.params())


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitPreset:
    """`total_bytes` of bf16 in `tensors` equal 1-D tensors named `w.<i>`."""

    name: str
    tensors: int
    bytes_total: int = 64 << 20
    dtype: torch.dtype = torch.bfloat16

    @property
    def description(self) -> str:
        return f"{self.bytes_total >> 20} MiB of bf16 in {self.tensors:,} tensors"

    def params(self) -> list[Param]:
        numel = self.bytes_total // self.tensors // self.dtype.itemsize
        return [Param(f"w.{i}", (numel,), self.dtype) for i in range(self.tensors)]

    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.params())


SPLIT_COUNTS = (64, 1024, 4096, 16384)
SPLIT_1G_COUNTS = (64, 16384)

PRESETS: dict[str, Preset | SplitPreset] = {
    p.name: p
    for p in (
        # Qwen/Qwen2.5-0.5B config.json: 494M parameters.
        Preset(
            name="qwen2.5-0.5b",
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_layers=24,
            num_heads=14,
            num_kv_heads=2,
            head_dim=64,
            description="Qwen2.5-0.5B: 290 bf16 tensors, 0.92 GiB",
        ),
        # Qwen/Qwen2.5-1.5B config.json: 1.54B parameters.
        Preset(
            name="qwen2.5-1.5b",
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_layers=28,
            num_heads=12,
            num_kv_heads=2,
            head_dim=128,
            description="Qwen2.5-1.5B: 338 bf16 tensors, 2.88 GiB",
        ),
        # Qwen3-30B-A3B's layout (router, experts, q/k norms, untied head) with its tensor
        # count (~18,900) in reach but its size cut to about 1 GiB: 24 layers of 224 experts
        # (Qwen3-30B-A3B: 48 of 128) of hidden 384 and expert width 80. The per-tensor cost
        # of a sync shows here as nowhere else (issue 19).
        Preset(
            name="moe-16k",
            vocab_size=32768,
            hidden_size=384,
            intermediate_size=80,
            num_layers=24,
            num_heads=8,
            num_kv_heads=2,
            head_dim=48,
            tie_embeddings=False,
            attention_bias=False,
            num_experts=224,
            moe_intermediate_size=80,
            description="Qwen3-MoE layout scaled down: 16,347 bf16 tensors, 1.0 GiB",
        ),
        # Small enough for a unit test; its embedding (128 KiB) is still the largest tensor,
        # so a bucket below that exercises chunking.
        Preset(
            name="tiny",
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            description="a toy Qwen2 shape for tests: 26 bf16 tensors",
        ),
    )
} | {f"split-{n}": SplitPreset(name=f"split-{n}", tensors=n) for n in SPLIT_COUNTS} | {
    f"split-{n}-1g": SplitPreset(name=f"split-{n}-1g", tensors=n, bytes_total=1 << 30) for n in SPLIT_1G_COUNTS
}


def get_preset(name: str) -> Preset | SplitPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}") from None
