"""Megatron's names and layouts to Hugging Face's, one rank's shard at a time, without
megatron-core (hal.integrations.megatron.convert): what each TP x PP rank declares, that the
plan from all of them tiles every Hugging Face tensor once and gives each rank exactly its
own bytes, and the refusals by name. The layouts themselves are checked against
Megatron's own forward in test_megatron.py (the logits check)."""

from __future__ import annotations

import pytest
import torch

from hal.integrations.megatron.convert import MegatronShape, assemble, hf_state, hf_tensors
from hal.sync.plan import Block, build_shard_plan, declare

H, HEADS, GROUPS, HD, FFN, VOCAB = 16, 8, 4, 2, 12, 10
HPG = HEADS // GROUPS


def shape(tp_rank: int = 0, tp: int = 2, layers: dict[int, int] | None = None, **kw) -> MegatronShape:
    return MegatronShape(
        hidden_size=H, num_attention_heads=HEADS, num_query_groups=GROUPS, head_dim=HD, ffn_hidden_size=FFN,
        vocab_size=kw.pop("vocab_size", VOCAB), hf_vocab_size=kw.pop("hf_vocab_size", VOCAB), tp_rank=tp_rank, tp_size=tp,
        layers={0: 0} if layers is None else layers, **kw,
    )


def hf_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(s, generator=g)  # noqa: E731
    return {"q": r(HEADS * HD, H), "k": r(GROUPS * HD, H), "v": r(GROUPS * HD, H), "o": r(H, HEADS * HD),
            "gate": r(FFN, H), "up": r(FFN, H), "down": r(H, FFN), "embed": r(VOCAB, H), "qb": r(HEADS * HD), "kb": r(GROUPS * HD), "vb": r(GROUPS * HD)}


def megatron_shard(w: dict[str, torch.Tensor], tp_rank: int, tp: int = 2) -> dict[str, torch.Tensor]:
    """A TP rank's Megatron shards of `w`, laid out as Megatron lays them out (per query
    group [q_0 .. q_{hpg-1}, k, v]; fc1 [gate_r; up_r])."""
    groups = GROUPS // tp
    g0 = tp_rank * groups

    def fused(q, k, v):
        tail = q.shape[1:]
        per = [torch.cat([q.view(GROUPS, HPG, HD, *tail)[g], k.view(GROUPS, 1, HD, *tail)[g], v.view(GROUPS, 1, HD, *tail)[g]]) for g in range(g0, g0 + groups)]
        return torch.cat(per).reshape(-1, *tail)

    rows, cols = FFN // tp, HEADS * HD // tp
    return {
        "embedding.word_embeddings.weight": w["embed"].chunk(tp)[tp_rank],
        "decoder.layers.0.self_attention.linear_qkv.weight": fused(w["q"], w["k"], w["v"]),
        "decoder.layers.0.self_attention.linear_qkv.bias": fused(w["qb"], w["kb"], w["vb"]),
        "decoder.layers.0.self_attention.linear_proj.weight": w["o"][:, tp_rank * cols : (tp_rank + 1) * cols],
        "decoder.layers.0.mlp.linear_fc1.weight": torch.cat([w["gate"].chunk(tp)[tp_rank], w["up"].chunk(tp)[tp_rank]]),
        "decoder.layers.0.mlp.linear_fc2.weight": w["down"][:, tp_rank * rows : (tp_rank + 1) * rows],
    }


def test_a_layers_shards_from_two_tp_ranks_assemble_to_the_hugging_face_tensors():
    w = hf_weights()
    pieces = [hf_state(list(megatron_shard(w, r).items()), shape(r)) for r in (0, 1)]
    hf = assemble(pieces)
    p = "model.layers.0."
    expected = {
        "model.embed_tokens.weight": w["embed"], p + "self_attn.q_proj.weight": w["q"], p + "self_attn.k_proj.weight": w["k"],
        p + "self_attn.v_proj.weight": w["v"], p + "self_attn.q_proj.bias": w["qb"], p + "self_attn.k_proj.bias": w["kb"],
        p + "self_attn.v_proj.bias": w["vb"], p + "self_attn.o_proj.weight": w["o"], p + "mlp.gate_proj.weight": w["gate"],
        p + "mlp.up_proj.weight": w["up"], p + "mlp.down_proj.weight": w["down"],
    }
    assert set(hf) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(hf[name], tensor), name
    # rank 1's blocks: its two query groups' rows of q, k and v, its columns of o_proj
    blocks = {n: (b.offsets, tuple(b.tensor.shape)) for n, b in pieces[1] if isinstance(b, Block)}
    assert blocks[p + "self_attn.q_proj.weight"] == ((HEADS * HD // 2, 0), (HEADS * HD // 2, H))
    assert blocks[p + "self_attn.k_proj.weight"] == ((GROUPS * HD // 2, 0), (GROUPS * HD // 2, H))
    assert blocks[p + "self_attn.o_proj.weight"] == ((0, HEADS * HD // 2), (H, HEADS * HD // 2))
    assert blocks[p + "mlp.down_proj.weight"] == ((0, FFN // 2), (H, FFN // 2))


def test_every_tp_x_pp_rank_sends_exactly_its_shards_and_the_sum_is_the_model():
    w = hf_weights()
    declarations, held_bytes = [], []
    for pp in (0, 1):  # stage 0 holds layer 0 (local 0) and the embedding, stage 1 layer 1 (local 0), the norm and lm_head
        for tp in (0, 1):
            named = [(n, t) for n, t in megatron_shard(w, tp).items() if pp == 0 or not n.startswith("embedding")]
            named.append(("decoder.layers.0.input_layernorm.weight", torch.ones(H)))
            if pp == 1:
                named += [("decoder.final_layernorm.weight", torch.ones(H)), ("output_layer.weight", w["embed"].chunk(2)[tp])]
            held = hf_state(named, shape(tp, layers={0: pp}))
            declarations.append(declare(held, 2 * pp + tp, 4))
            held_bytes.append(sum(t.numel() * 4 for n, t in named if t.dim() == 2 or "bias" in n) + H * 4 // 2 * (1 + pp))
    plan = build_shard_plan(declarations)
    assert [plan.bytes_of(r) for r in range(4)] == held_bytes  # each its shards, and half of each norm it holds
    assert sum(held_bytes) == plan.total_bytes
    names = {s.name for s in plan.specs}
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight", "lm_head.weight", "model.norm.weight"} <= names


def test_a_tied_output_layer_is_not_sent_and_megatrons_padding_rows_are_cut():
    tied = shape(1, tied=True, vocab_size=12, hf_vocab_size=VOCAB)
    assert hf_tensors("output_layer.weight", torch.zeros(6, H), tied) == []
    (name, block), = hf_tensors("embedding.word_embeddings.weight", torch.zeros(6, H), tied)
    assert name == "model.embed_tokens.weight" and block.shape == (VOCAB, H) and block.offsets == (6, 0) and block.tensor.shape == (4, H)


@pytest.mark.parametrize(
    "name, local, message",
    [
        ("decoder.layers.0.self_attention.linear_qkv.weight", (20, H), r"'decoder.layers.0.self_attention.linear_qkv.weight': expected a local shard of shape \(16, 16\)"),
        ("decoder.layers.0.mlp.linear_fc2.weight", (H, 12), r"'decoder.layers.0.mlp.linear_fc2.weight': expected a local shard of shape \(16, 6\) \(columns 6..12"),
        ("decoder.layers.0.self_attention.linear_qkv.extra", (1,), r"'decoder.layers.0.self_attention.linear_qkv.extra': no Hugging Face name rule knows"),
        ("decoder.layers.3.input_layernorm.weight", (H,), r"local layer 3 is not among this stage's layers \[0\]"),
        ("something.else", (1,), r"'something.else': no Hugging Face name rule knows it"),
    ],
)
def test_what_no_rule_knows_or_another_shape_is_refused_by_name(name, local, message):
    with pytest.raises(ValueError, match=message):
        hf_tensors(name, torch.zeros(local), shape(1))


def test_shapes_that_tp_cannot_split_are_refused():
    with pytest.raises(ValueError, match="num_query_groups 4 is not a multiple of the tensor-parallel size 3"):
        shape(0, tp=3)


def test_the_rules_are_a_state_dict_adapter_that_composes():
    """`MegatronLayout` is hal.sync.adapters' contract: replicated tensors renamed whole, a tied
    `output_layer` left out, every other tensor its rank's blocks (views of its shard); a
    name no rule knows refused when the rules are made, before any tensor is read."""
    from hal.integrations.megatron.convert import MegatronLayout
    from hal.sync.adapters import Chain, Rename

    w = hf_weights()
    named = list(megatron_shard(w, 1).items()) + [("decoder.layers.0.input_layernorm.weight", torch.ones(H)), ("output_layer.weight", torch.zeros(5, H))]
    layout = MegatronLayout(shape(1, tied=True))
    rules = layout.rules([n for n, _ in named], [t for _, t in named])
    assert rules["decoder.layers.0.input_layernorm.weight"].name == "model.layers.0.input_layernorm.weight"
    assert rules["output_layer.weight"].whole and rules["output_layer.weight"].name is None
    assert not rules["decoder.layers.0.self_attention.linear_qkv.weight"].whole
    held = layout.to_checkpoint(named)
    assert [(n, type(t)) for n, t in held] == [(n, type(t)) for n, t in hf_state(named, shape(1, tied=True))]
    fc1 = dict(named)["decoder.layers.0.mlp.linear_fc1.weight"]
    up = dict(held)["model.layers.0.mlp.up_proj.weight"]
    assert up.tensor.untyped_storage().data_ptr() == fc1.untyped_storage().data_ptr()  # a view of the shard, not a copy
    renamed = Chain(layout, Rename(lambda n: f"engine.{n}")).to_checkpoint(named)
    assert [n for n, _ in renamed] == [f"engine.{n}" for n, _ in held]
    assert [getattr(t, "offsets", None) for _, t in renamed] == [getattr(t, "offsets", None) for _, t in held]
    assert layout == MegatronLayout(shape(1, tied=True)) != MegatronLayout(shape(0, tied=True))
    with pytest.raises(ValueError, match=r"'something.else': no Hugging Face name rule knows it"):
        layout.rules(["embedding.word_embeddings.weight", "something.else"], [torch.zeros(0), torch.zeros(0)])
