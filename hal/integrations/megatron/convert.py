"""Megatron-core's names and layouts to Hugging Face's, one tensor-parallel shard at a time.

A state-dict adapter (`MegatronLayout`, hal.sync.adapters) of pure functions of a rank's
local tensor and the model's shape (`MegatronShape`); nothing here imports megatron-core (hal.integrations.megatron._internals reads the model) and
nothing is gathered: every rule maps a rank's own shard to its own blocks of one or more
Hugging Face tensors (`hal.sync.plan.declare.Block`), and a tensor every tensor-parallel rank
holds whole (a norm) stays a plain tensor, which the ranks holding it split between them.

| Megatron (local name, per pipeline stage)             | Hugging Face (global layer index)                    | a TP rank's part                                      |
|-------------------------------------------------------|------------------------------------------------------|-------------------------------------------------------|
| `embedding.word_embeddings.weight`                    | `model.embed_tokens.weight`                          | rows: its vocab range                                 |
| `decoder.layers.i.input_layernorm.weight` (or `self_attention.linear_qkv.layer_norm_weight`) | `model.layers.L.input_layernorm.weight` | whole (replicated)                 |
| `decoder.layers.i.self_attention.linear_qkv.weight` / `.bias` | `model.layers.L.self_attn.{q,k,v}_proj.weight` / `.bias` | rows of each: its query groups, de-interleaved |
| `decoder.layers.i.self_attention.q_layernorm.weight`, `k_layernorm` | `model.layers.L.self_attn.q_norm.weight`, `k_norm` | whole (replicated)                         |
| `decoder.layers.i.self_attention.linear_proj.weight`  | `model.layers.L.self_attn.o_proj.weight`             | columns                                               |
| `decoder.layers.i.pre_mlp_layernorm.weight` (or `mlp.linear_fc1.layer_norm_weight`) | `model.layers.L.post_attention_layernorm.weight` | whole (replicated)                   |
| `decoder.layers.i.mlp.linear_fc1.weight`              | `model.layers.L.mlp.gate_proj.weight`, `up_proj`     | rows of each: the shard is `[gate_r; up_r]`           |
| `decoder.layers.i.mlp.linear_fc2.weight`              | `model.layers.L.mlp.down_proj.weight`                | columns                                               |
| `decoder.final_layernorm.weight`                      | `model.norm.weight`                                  | whole (replicated)                                    |
| `output_layer.weight`                                 | `lm_head.weight` (none when tied to the embedding)   | rows: its vocab range                                 |
| MoE: `decoder.layers.i.mlp.router.weight`             | `model.layers.L.mlp.gate.weight`                     | whole (replicated)                                    |
| MoE: `decoder.layers.i.mlp.router.expert_bias` (a buffer) | `model.layers.L.mlp.gate.e_score_correction_bias` | whole (replicated)                                   |
| MoE: `...mlp.experts.local_experts.e.linear_fc1.weight` | `model.layers.L.mlp.experts.E.gate_proj.weight`, `up_proj` (E: the global expert) | rows of each             |
| MoE: `...mlp.experts.local_experts.e.linear_fc2.weight` | `model.layers.L.mlp.experts.E.down_proj.weight`    | columns                                               |

`L` is the global layer index (Megatron restarts its local `i` at 0 on every pipeline
stage; `MegatronShape.layers` maps one to the other). Fused `linear_qkv` rows are grouped
per query group as `[q_0 .. q_{hpg-1}, k, v]` of `head_dim` rows each, and tensor
parallelism splits by whole groups, so a rank's shard is rows of each of q, k and v.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from hal.sync.adapters import Derived, Renamed, Rule, StateDictAdapter
from hal.sync.plan import Block


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronShape:
    """What the rules need to know of the model and of this rank (read from Megatron by
    hal.integrations.megatron._internals, or given in tests)."""

    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    """Rows of Megatron's embedding (padded to a multiple of the TP size, perhaps more)."""
    hf_vocab_size: int
    """Rows of the Hugging Face embedding: rows past it (Megatron's padding) are not sent."""
    gated: bool = True
    tied: bool = False
    """`lm_head` shares the embedding: the last stage's `output_layer` copy is not sent."""
    tp_rank: int = 0
    tp_size: int = 1
    layers: dict[int, int] = field(default_factory=dict)
    """Local layer index -> global layer index (Megatron's `layer_number - 1`)."""
    moe_ffn_hidden_size: int | None = None
    num_experts: int | None = None
    ep_rank: int = 0
    ep_size: int = 1
    expert_tp_size: int = 1
    expert_tp_rank: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.num_attention_heads % self.num_query_groups:
            problems.append(f"num_attention_heads {self.num_attention_heads} is not a multiple of num_query_groups {self.num_query_groups}")
        if self.num_query_groups % self.tp_size:
            problems.append(f"num_query_groups {self.num_query_groups} is not a multiple of the tensor-parallel size {self.tp_size}")
        if self.ffn_hidden_size % self.tp_size or self.vocab_size % self.tp_size:
            problems.append(f"ffn_hidden_size {self.ffn_hidden_size} or vocab_size {self.vocab_size} is not a multiple of the TP size {self.tp_size}")
        if self.hf_vocab_size > self.vocab_size:
            problems.append(f"hf_vocab_size {self.hf_vocab_size} exceeds Megatron's vocab_size {self.vocab_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            problems.append(f"tp_rank {self.tp_rank} is outside a tensor-parallel group of {self.tp_size}")
        if self.num_experts is not None and self.num_experts % self.ep_size:
            problems.append(f"num_experts {self.num_experts} is not a multiple of the expert-parallel size {self.ep_size}")
        if problems:
            raise ValueError("Megatron model shape: " + "; ".join(problems))

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


Held = tuple[str, "torch.Tensor | Block"]

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")
_REPLICATED = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
}


class MegatronLayout(StateDictAdapter):
    """Megatron's names and layouts as Hugging Face's, for one model chunk on one rank (its
    `MegatronShape`): a state-dict adapter (hal.sync.adapters) whose rules are the table of
    the module doc. A replicated tensor is renamed whole; a tied `output_layer` is left out;
    every other tensor is a `Derived` rule that makes this rank's blocks, views of its shard
    (de-interleaved `linear_qkv`, `[gate; up]` rows, columns, vocab rows). A name no rule
    knows is refused by name when the rules are made, before any tensor is read."""

    def __init__(self, shape: MegatronShape) -> None:
        self.shape = shape

    def rules(self, names: list[str], tensors: list[torch.Tensor]) -> dict[str, Rule]:
        return {name: rule_of(name, self.shape) for name in names}

    def __eq__(self, other: object) -> bool:
        return type(other) is MegatronLayout and other.shape == self.shape

    __hash__ = None  # type: ignore[assignment]  # a shape holds its layer map (a dict)

    def __repr__(self) -> str:
        return f"MegatronLayout(tp_rank={self.shape.tp_rank}, layers={self.shape.layers})"


class _Shards(Derived):
    """One Megatron tensor's Hugging Face blocks on this rank: `make(hf_name_or_prefix, name, tensor, shape)`."""

    __slots__ = ("make", "target", "name", "shape")

    def __init__(self, make: Any, target: str, name: str, shape: MegatronShape) -> None:
        self.make, self.target, self.name, self.shape = make, target, name, shape

    def apply(self, tensor: torch.Tensor) -> list[Held]:
        return self.make(self.target, self.name, tensor, self.shape)

    def __repr__(self) -> str:
        return f"{self.make.__name__.lstrip('_')}({self.name!r} -> {self.target!r})"


def rule_of(name: str, shape: MegatronShape) -> Rule:
    """The rule of Megatron's local `name` on this rank (the module doc's table). ValueError
    naming the parameter when no rule knows it."""
    if name == "embedding.word_embeddings.weight":
        return _Shards(_vocab_rows, "model.embed_tokens.weight", name, shape)
    if name == "output_layer.weight":
        return Renamed(None) if shape.tied else _Shards(_vocab_rows, "lm_head.weight", name, shape)
    if name == "decoder.final_layernorm.weight":
        return Renamed("model.norm.weight")
    match = _LAYER.fullmatch(name)
    if match is None:
        raise ValueError(f"Megatron parameter {name!r}: no Hugging Face name rule knows it (hal.integrations.megatron.convert)")
    local, rest = int(match.group(1)), match.group(2)
    if local not in shape.layers:
        raise ValueError(f"Megatron parameter {name!r}: local layer {local} is not among this stage's layers {sorted(shape.layers)}")
    prefix = f"model.layers.{shape.layers[local]}."
    if rest in _REPLICATED:
        return Renamed(prefix + _REPLICATED[rest])
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        return _Shards(_qkv, prefix, name, shape)
    if rest == "self_attention.linear_proj.weight":
        return _Shards(_o_proj, prefix + "self_attn.o_proj.weight", name, shape)
    if rest == "mlp.linear_fc1.weight":
        return _Shards(_dense_gate_up, prefix + "mlp.", name, shape)
    if rest == "mlp.linear_fc2.weight":
        return _Shards(_dense_down, prefix + "mlp.down_proj.weight", name, shape)
    expert = _EXPERT.fullmatch(rest)
    if expert is not None and shape.num_experts is not None and shape.moe_ffn_hidden_size is not None:
        per_rank = shape.num_experts // shape.ep_size
        local_expert = int(expert.group(1))
        if not 0 <= local_expert < per_rank:
            raise ValueError(f"Megatron parameter {name!r}: local expert {local_expert} of {per_rank} per expert-parallel rank")
        base = f"{prefix}mlp.experts.{shape.ep_rank * per_rank + local_expert}."
        if expert.group(2) == "linear_fc1":
            return _Shards(_expert_gate_up, base, name, shape)
        return _Shards(_expert_down, base + "down_proj.weight", name, shape)
    raise ValueError(f"Megatron parameter {name!r}: no Hugging Face name rule knows {rest!r} (hal.integrations.megatron.convert)")


def hf_tensors(name: str, tensor: torch.Tensor, shape: MegatronShape) -> list[Held]:
    """The Hugging Face tensors (or blocks of them) that Megatron's local `name` holds on this
    rank; empty when it maps to none (a tied `output_layer`). ValueError naming the
    parameter when no rule knows it or its shape is not the one its rule expects."""
    rule = rule_of(name, shape)
    if rule.whole:
        return [] if rule.name is None else [(rule.name, tensor)]
    return rule.apply(tensor)


def _o_proj(hf: str, name: str, tensor: torch.Tensor, shape: MegatronShape) -> list[Held]:
    width = shape.num_attention_heads * shape.head_dim
    return [_columns(hf, name, tensor, (shape.hidden_size, width), shape.tp_rank, shape.tp_size)]


def _dense_gate_up(prefix: str, name: str, tensor: torch.Tensor, shape: MegatronShape) -> list[Held]:
    return _gate_up(prefix, name, tensor, shape.ffn_hidden_size, shape.hidden_size, shape.tp_rank, shape.tp_size, shape.gated)


def _dense_down(hf: str, name: str, tensor: torch.Tensor, shape: MegatronShape) -> list[Held]:
    return [_columns(hf, name, tensor, (shape.hidden_size, shape.ffn_hidden_size), shape.tp_rank, shape.tp_size)]


def _expert_gate_up(prefix: str, name: str, tensor: torch.Tensor, shape: MegatronShape) -> list[Held]:
    ffn = shape.moe_ffn_hidden_size
    return _gate_up(prefix, name, tensor, ffn, shape.hidden_size, shape.expert_tp_rank, shape.expert_tp_size, shape.gated)


def _expert_down(hf: str, name: str, tensor: torch.Tensor, shape: MegatronShape) -> list[Held]:
    full = (shape.hidden_size, shape.moe_ffn_hidden_size)
    return [_columns(hf, name, tensor, full, shape.expert_tp_rank, shape.expert_tp_size)]


def _expect(name: str, tensor: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"Megatron parameter {name!r}: expected a local shard of shape {expected} ({what}), got {tuple(tensor.shape)}")


def _vocab_rows(hf: str, name: str, tensor: torch.Tensor, shape: MegatronShape) -> list[Held]:
    rows = shape.vocab_size // shape.tp_size
    _expect(name, tensor, (rows, shape.hidden_size), f"vocab {shape.vocab_size} / TP {shape.tp_size} rows of hidden {shape.hidden_size}")
    lo = min(shape.tp_rank * rows, shape.hf_vocab_size)
    hi = min(lo + rows, shape.hf_vocab_size)  # Megatron's padding rows are not Hugging Face's
    return [(hf, Block(tensor[: hi - lo], (shape.hf_vocab_size, shape.hidden_size), (lo, 0)))]


def _qkv(prefix: str, name: str, tensor: torch.Tensor, shape: MegatronShape) -> list[Held]:
    kind = name.rpartition(".")[2]
    groups = shape.num_query_groups // shape.tp_size
    hpg, hd = shape.heads_per_group, shape.head_dim
    tail = (shape.hidden_size,) if kind == "weight" else ()
    _expect(name, tensor, (groups * (hpg + 2) * hd, *tail), f"{groups} query groups of [{hpg} q, k, v] x head_dim {hd}")
    per_group = tensor.view(groups, hpg + 2, hd, *tail)  # de-interleaved here, from this rank's own shard
    q = per_group[:, :hpg].reshape(groups * hpg * hd, *tail)
    k = per_group[:, hpg].reshape(groups * hd, *tail)
    v = per_group[:, hpg + 1].reshape(groups * hd, *tail)
    rank = shape.tp_rank
    zeros = (0,) * len(tail)
    return [
        (f"{prefix}self_attn.q_proj.{kind}", Block(q, (shape.num_attention_heads * hd, *tail), (rank * q.shape[0], *zeros))),
        (f"{prefix}self_attn.k_proj.{kind}", Block(k, (shape.num_query_groups * hd, *tail), (rank * k.shape[0], *zeros))),
        (f"{prefix}self_attn.v_proj.{kind}", Block(v, (shape.num_query_groups * hd, *tail), (rank * v.shape[0], *zeros))),
    ]


def _gate_up(prefix: str, name: str, tensor: torch.Tensor, ffn: int, hidden: int, rank: int, size: int, gated: bool) -> list[Held]:
    rows = ffn // size
    if not gated:
        raise ValueError(f"Megatron parameter {name!r}: a linear_fc1 without gated_linear_unit has no Llama/Qwen2 name (up_proj alone)")
    _expect(name, tensor, (2 * rows, hidden), f"[gate; up] of {rows} rows each")
    return [
        (prefix + "gate_proj.weight", Block(tensor[:rows], (ffn, hidden), (rank * rows, 0))),
        (prefix + "up_proj.weight", Block(tensor[rows:], (ffn, hidden), (rank * rows, 0))),
    ]


def _columns(hf: str, name: str, tensor: torch.Tensor, full: tuple[int, int], rank: int, size: int) -> Held:
    cols = full[1] // size
    _expect(name, tensor, (full[0], cols), f"columns {rank * cols}..{(rank + 1) * cols} of {full}")
    return hf, Block(tensor, full, (0, rank * cols))


def hf_state(named: list[tuple[str, torch.Tensor]], shape: MegatronShape) -> list[Held]:
    """Every Hugging Face tensor (or block) this rank holds, in Megatron's order."""
    return MegatronLayout(shape).to_checkpoint(named)


def assemble(pieces: list[list[Held]], shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    """Whole Hugging Face tensors from every rank's pieces (a test's and a tool's helper,
    never the sync's: it is the gather the sync does not do)."""
    out: dict[str, torch.Tensor] = {}
    for held in pieces:
        for hf, piece in held:
            if isinstance(piece, Block):
                whole = out.setdefault(hf, piece.tensor.new_zeros(piece.shape))
                whole[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.tensor.shape))] = piece.tensor
            else:
                out[hf] = piece.detach().clone()
    return out


__all__ = ["MegatronLayout", "MegatronShape", "assemble", "hf_state", "hf_tensors", "rule_of"]


