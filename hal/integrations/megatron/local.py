"""What each rank of a Megatron-core trainer holds, by local name and shape, from a Hugging
Face config alone: the plan of a trainer that does not exist (`hal plan --trainer megatron:...`).

`MegatronGrid(tp, pp, ep, etp, dp)` is the trainer: TP x PP x DP ranks (Megatron's default
order, TP fastest, then DP, then PP: rank = tp_rank + TP x (dp_rank + DP x pp_rank)); in a
stage, the TP x DP ranks hold the experts as expert-TP x EP x expert-DP (expert-TP fastest),
as Megatron folds them. Stage s holds the decoder layers `chunk_rows(L, PP)[s]` (even
stages; an uneven split such as 94 layers over 8 stages gives the last stage fewer), stage
0 the embedding, the last stage the final norm and an untied output layer.

`local_tensors` names each rank's tensors as megatron-core 0.16's GPT model with Transformer
Engine names them (the norms fused into `linear_qkv` / `linear_fc1` of a dense layer, a
`pre_mlp_layernorm` before a MoE block, experts as `SequentialMLP`'s `local_experts`), as
meta tensors of the local shapes; `held_blocks` hands them to the same rules a live source
uses (hal.integrations.megatron.convert: each rank's blocks of the Hugging Face tensors).
Families with rules there: Llama, Qwen2 (q/k/v biases), Qwen3 (q/k norms), Qwen3-MoE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hal.integrations.megatron.convert import Held, MegatronShape, hf_tensors
from hal.sync.plan.shards import chunk_rows

# model_type -> (q/k/v biases, q/k norms); the families convert.py has rules for
FAMILIES = {"llama": (False, False), "qwen2": (True, False), "qwen3": (False, True), "qwen3_moe": (False, True)}
VOCAB_DIVISIBLE_BY = 128  # Megatron's make_vocab_size_divisible_by default: the vocabulary is padded to it x TP


@dataclass(frozen=True, slots=True)
class MegatronGrid:
    """A Megatron-core trainer's parallel sizes: TP x PP x DP ranks, experts over EP x expert-TP."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 0
    """Data-parallel replicas; 0: the fewest that hold the experts (EP x expert-TP / TP, at least 1)."""

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.ep, self.etp) < 1 or self.dp < 0:
            raise ValueError(f"megatron trainer: tp={self.tp}, pp={self.pp}, ep={self.ep}, etp={self.etp}, dp={self.dp}: sizes must be at least 1")
        if not self.dp:
            object.__setattr__(self, "dp", max(1, -(-self.ep * self.etp // self.tp)))
        if (self.tp * self.dp) % (self.ep * self.etp):
            raise ValueError(f"megatron trainer: the TP x DP = {self.tp * self.dp} ranks of a stage cannot hold the experts as "
                             f"EP {self.ep} x expert-TP {self.etp} (not a divisor)")

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.dp

    def place(self, rank: int) -> tuple[int, int, int, int, int]:
        """(tp_rank, dp_rank, pp_rank, ep_rank, expert_tp_rank) of trainer rank `rank`."""
        tp_rank, rest = rank % self.tp, rank // self.tp
        dp_rank, pp_rank = rest % self.dp, rest // self.dp
        local = tp_rank + self.tp * dp_rank  # the rank's index among its stage's TP x DP ranks
        return tp_rank, dp_rank, pp_rank, (local // self.etp) % self.ep, local % self.etp

    def describe(self) -> str:
        return f"Megatron TP{self.tp} x PP{self.pp} x DP{self.dp}, EP{self.ep} x ETP{self.etp} ({self.ranks} ranks)"


def _family(config: dict[str, Any]) -> tuple[bool, bool]:
    kind = config.get("model_type")
    if kind == "deepseek_v3":
        raise ValueError("megatron trainer: DeepSeek-V3's attention (MLA) and shared experts have no Megatron rules in "
                         "hal.integrations.megatron.convert; plan it with --trainer fsdp2:M")
    if kind not in FAMILIES:
        raise ValueError(f"megatron trainer: model_type {kind!r} has no Megatron rules in hal.integrations.megatron.convert "
                         f"(it knows {', '.join(FAMILIES)})")
    return FAMILIES[kind]


def _experts(config: dict[str, Any]) -> int:
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def _is_moe(config: dict[str, Any], layer: int) -> bool:
    step = int(config.get("decoder_sparse_step") or 1)
    return _experts(config) > 0 and layer not in (config.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def megatron_shape(config: dict[str, Any], grid: MegatronGrid, rank: int) -> MegatronShape:
    """The `MegatronShape` of trainer rank `rank` (what convert's rules need)."""
    _family(config)
    heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
    vocab = int(config["vocab_size"])
    multiple = VOCAB_DIVISIBLE_BY * grid.tp
    tp_rank, _, pp_rank, ep_rank, etp_rank = grid.place(rank)
    lo, hi = chunk_rows(int(config["num_hidden_layers"]), grid.pp, pp_rank)
    experts = _experts(config)
    return MegatronShape(
        hidden_size=hidden, num_attention_heads=heads, num_query_groups=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads), ffn_hidden_size=int(config["intermediate_size"]),
        vocab_size=-(-vocab // multiple) * multiple, hf_vocab_size=vocab, tied=bool(config.get("tie_word_embeddings", False)),
        tp_rank=tp_rank, tp_size=grid.tp, layers={i: lo + i for i in range(hi - lo)},
        moe_ffn_hidden_size=int(config["moe_intermediate_size"]) if experts else None, num_experts=experts or None,
        ep_rank=ep_rank, ep_size=grid.ep, expert_tp_size=grid.etp, expert_tp_rank=etp_rank,
    )


def local_tensors(config: dict[str, Any], grid: MegatronGrid, rank: int, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Trainer rank `rank`'s tensors, Megatron's local names, as meta tensors of their local shapes."""
    bias, qk_norm = _family(config)
    shape = megatron_shape(config, grid, rank)
    tp, hd, hidden = grid.tp, shape.head_dim, shape.hidden_size
    _, _, pp_rank, _, _ = grid.place(rank)
    out: list[tuple[str, tuple[int, ...]]] = []
    if pp_rank == 0:
        out.append(("embedding.word_embeddings.weight", (shape.vocab_size // tp, hidden)))
    qkv_rows = shape.num_query_groups // tp * (shape.heads_per_group + 2) * hd
    for local, layer in shape.layers.items():
        p = f"decoder.layers.{local}."
        out += [(p + "self_attention.linear_qkv.layer_norm_weight", (hidden,)), (p + "self_attention.linear_qkv.weight", (qkv_rows, hidden))]
        out += [(p + "self_attention.linear_qkv.bias", (qkv_rows,))] if bias else []
        out += [(p + f"self_attention.{n}_layernorm.weight", (hd,)) for n in ("q", "k")] if qk_norm else []
        out.append((p + "self_attention.linear_proj.weight", (hidden, shape.num_attention_heads * hd // tp)))
        if not _is_moe(config, layer):
            ffn = shape.ffn_hidden_size // tp
            out += [(p + "mlp.linear_fc1.layer_norm_weight", (hidden,)), (p + "mlp.linear_fc1.weight", (2 * ffn, hidden)),
                    (p + "mlp.linear_fc2.weight", (hidden, ffn))]
            continue
        ffn = shape.moe_ffn_hidden_size // grid.etp
        out += [(p + "pre_mlp_layernorm.weight", (hidden,)), (p + "mlp.router.weight", (shape.num_experts, hidden))]
        for e in range(shape.num_experts // grid.ep):
            q = f"{p}mlp.experts.local_experts.{e}."
            out += [(q + "linear_fc1.weight", (2 * ffn, hidden)), (q + "linear_fc2.weight", (hidden, ffn))]
    if pp_rank == grid.pp - 1:
        out.append(("decoder.final_layernorm.weight", (hidden,)))
        if not shape.tied:
            out.append(("output_layer.weight", (shape.vocab_size // tp, hidden)))
    return [(name, torch.empty(size, dtype=dtype, device="meta")) for name, size in out]


def held_blocks(config: dict[str, Any], grid: MegatronGrid, rank: int, dtype: torch.dtype) -> list[Held]:
    """Trainer rank `rank`'s Hugging Face tensors and blocks, by convert.py's rules."""
    shape = megatron_shape(config, grid, rank)
    return [held for name, tensor in local_tensors(config, grid, rank, dtype) for held in hf_tensors(name, tensor, shape)]
