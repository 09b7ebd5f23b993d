"""The M x N plan (hal.sync.plan.mxn): trainer holdings intersected with engine workers' needs.

Pure: the holdings come from trainer ranks' declarations (FSDP2 rows, Megatron TP x PP
blocks through hal.integrations.megatron.convert, one sender with the whole model), the
needs are what a vLLM engine of TP workers records (rows, columns, replicated KV heads and
norms, experts split over the workers, a padded vocabulary). Every plan is checked by
moving real values through it: each piece cut from the checkpoint tensor at its box, landed
at its need's destination, gives every worker exactly what it needs.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from hal.sync import SpecMismatchError
from hal.sync.plan.declare import declare
from hal.sync.plan.mxn import MxNPlan, build_mxn_plan
from hal.sync.plan.needs import Need, Target, WorkerNeeds, contiguous_strides
from hal.sync.plan.shards import SHARD0, WHOLE, Declared, ShardPlan, build_shard_plan
from hal.sync.spec import TensorSpec

F32 = torch.float32
HIDDEN, HEAD = 8, 2


def llama(vocab: int = 10, layers: int = 2, kv_heads: int = 2, experts: int = 0, tied: bool = False) -> tuple[TensorSpec, ...]:
    """A tiny Llama's checkpoint (4 query heads of 2, `kv_heads`, an FFN of 8 or `experts` of 4)."""
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, HIDDEN), F32)]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [TensorSpec(p + "input_layernorm.weight", (HIDDEN,), F32),
                  TensorSpec(p + "self_attn.q_proj.weight", (4 * HEAD, HIDDEN), F32),
                  TensorSpec(p + "self_attn.k_proj.weight", (kv_heads * HEAD, HIDDEN), F32),
                  TensorSpec(p + "self_attn.v_proj.weight", (kv_heads * HEAD, HIDDEN), F32),
                  TensorSpec(p + "self_attn.o_proj.weight", (HIDDEN, 4 * HEAD), F32),
                  TensorSpec(p + "post_attention_layernorm.weight", (HIDDEN,), F32)]
        if experts:
            specs.append(TensorSpec(p + "mlp.gate.weight", (experts, HIDDEN), F32))
            for e in range(experts):
                specs += [TensorSpec(f"{p}mlp.experts.{e}.{w}.weight", shape, F32)
                          for w, shape in (("gate_proj", (4, HIDDEN)), ("up_proj", (4, HIDDEN)), ("down_proj", (HIDDEN, 4)))]
        else:
            specs += [TensorSpec(p + "mlp.gate_proj.weight", (8, HIDDEN), F32), TensorSpec(p + "mlp.up_proj.weight", (8, HIDDEN), F32),
                      TensorSpec(p + "mlp.down_proj.weight", (HIDDEN, 8), F32)]
    specs.append(TensorSpec("model.norm.weight", (HIDDEN,), F32))
    if not tied:
        specs.append(TensorSpec("lm_head.weight", (vocab, HIDDEN), F32))
    return tuple(specs)


def engine_box(spec: TensorSpec, w: int, tp: int, experts: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """What worker `w` of a vLLM engine of `tp` workers (experts split over them) loads of `spec`."""
    name, shape = spec.name, spec.shape
    if ".experts." in name:
        expert = int(name.split(".experts.")[1].split(".")[0])
        return ((0,) * len(shape), shape) if expert * tp // experts == w else None
    if "embed_tokens" in name or "lm_head" in name:  # padded to a multiple of 64, then split
        per = -(-shape[0] // 64) * 64 // tp
        lo, hi = w * per, min((w + 1) * per, shape[0])
        return ((lo, 0), (hi - lo, shape[1])) if hi > lo else None
    if "k_proj" in name or "v_proj" in name:
        heads = shape[0] // HEAD
        head = w * heads // tp if heads >= tp else w // (tp // heads)  # fewer KV heads than workers: replicated
        per = max(heads // tp, 1) * HEAD
        return (head * HEAD, 0), (per, shape[1])
    if any(k in name for k in ("q_proj", "gate_proj", "up_proj")) and "mlp.gate.weight" not in name:
        per = shape[0] // tp
        return (w * per, 0), (per, shape[1])
    if "o_proj" in name or "down_proj" in name:
        per = shape[1] // tp
        return (0, w * per), (shape[0], per)
    return (0,) * len(shape), shape  # norms, the router: whole, to every worker


def engine_needs(specs: tuple[TensorSpec, ...], tp: int, experts: int = 0) -> list[WorkerNeeds]:
    out = []
    for w in range(tp):
        targets, needs = [], []
        for i, spec in enumerate(specs):
            box = engine_box(spec, w, tp, experts)
            if box is None:
                continue
            targets.append(Target(spec.name.rpartition(".")[0], "weight", box[1]))
            needs.append(Need(i, box[0], box[1], len(targets) - 1, 0, contiguous_strides(box[1])))
        out.append(WorkerNeeds(w, specs, tuple(targets), tuple(needs)))
    return out


def fsdp2(specs: tuple[TensorSpec, ...], ranks: int) -> ShardPlan:
    return build_shard_plan([[Declared(s.name, s.shape, s.dtype, SHARD0) for s in specs] for _ in range(ranks)])


def one_sender(specs: tuple[TensorSpec, ...]) -> ShardPlan:
    return build_shard_plan([[Declared(s.name, s.shape, s.dtype, WHOLE) for s in specs]])


def values(specs: tuple[TensorSpec, ...]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=gen) for s in specs}


def _box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes))


def check_moves_exactly_the_needs(plan: MxNPlan, holdings: ShardPlan) -> None:
    """Every piece inside its share and its need; the pieces landed give each worker exactly
    its needs; the bytes add up."""
    full = values(plan.specs)
    landed = {(w, t.describe()): torch.full(t.shape, float("nan")) for w, r in enumerate(plan.needs) for t in r.targets}
    for r, row in enumerate(plan.links):
        for w, link in enumerate(row):
            assert (link.sender, link.worker) == (r, w)
            pieces = link.pieces
            assert sum(p.numel * plan.specs[p.tensor].dtype.itemsize for p in pieces) == link.nbytes
            assert [(p.tensor, p.offsets) for p in pieces] == sorted((p.tensor, p.offsets) for p in pieces)  # checkpoint order
            for p in pieces:
                share, index = plan.source(r, p)
                need = plan.needs[w].needs[p.need]
                assert p.numel > 0
                assert share is holdings.shares[r][p.share] and share.spec.name == plan.specs[p.tensor].name and need.tensor == p.tensor
                for o, n, so, sn, no, nn in zip(p.offsets, p.sizes, share.offsets, share.wire.shape, need.offsets, need.sizes):
                    assert so <= o and o + n <= so + sn and no <= o and o + n <= nn + no
                wire = full[share.spec.name][_box(share.offsets, share.wire.shape)][index]  # cut from the share as the sender holds it
                t, (offset, shape, strides) = plan.destination(w, p)
                assert t == need.target
                region = landed[(w, plan.needs[w].targets[t].describe())].as_strided(shape, strides, offset)
                assert bool(region.isnan().all()), "a destination written twice"
                region.copy_(wire)
    for w, record in enumerate(plan.needs):
        for need in record.needs:
            want = full[record.specs[need.tensor].name][_box(need.offsets, need.sizes)]
            assert torch.equal(landed[(w, record.targets[need.target].describe())], want)
        assert plan.bytes_in[w] == record.nbytes
    assert sum(plan.bytes_out) == sum(plan.bytes_in) == sum(link.nbytes for row in plan.links for link in row)
    # each link's bytes, counted the slow way: every share of the sender against every need of the worker
    for r, shares in enumerate(holdings.shares):
        for w, record in enumerate(plan.needs):
            slow = 0
            for share in shares:
                for need in record.needs:
                    if record.specs[need.tensor].name == share.spec.name:
                        overlap = [min(a + n, b + m) - max(a, b) for a, n, b, m in zip(share.offsets, share.wire.shape, need.offsets, need.sizes)]
                        slow += math.prod(max(x, 0) for x in overlap) * record.specs[need.tensor].dtype.itemsize
            assert plan.links[r][w].nbytes == slow, (r, w)


@pytest.mark.parametrize("senders", [2, 3])
def test_fsdp2_rows_into_two_workers(senders):
    specs = llama()
    holdings = fsdp2(specs, senders)
    plan = build_mxn_plan(holdings, engine_needs(specs, 2))
    check_moves_exactly_the_needs(plan, holdings)
    assert all(plan.bytes_out) and plan.dropped == ()


def test_one_sender_sends_each_worker_its_shard_and_the_shared_tensors():
    specs = llama()
    holdings = one_sender(specs)
    plan = build_mxn_plan(holdings, engine_needs(specs, 2))
    check_moves_exactly_the_needs(plan, holdings)
    norms = sum(s.nbytes for s in specs if "norm" in s.name)
    assert plan.bytes_out == (sum(plan.bytes_in),)
    assert sum(plan.bytes_in) == plan.model_bytes + norms  # the norms go to both workers, everything else once
    assert plan.largest_link.nbytes == max(plan.bytes_in)


def test_kv_heads_fewer_than_workers_go_to_each_worker_that_serves_them():
    specs = llama(kv_heads=1)
    holdings = fsdp2(specs, 2)
    plan = build_mxn_plan(holdings, engine_needs(specs, 2))
    check_moves_exactly_the_needs(plan, holdings)
    k = next(i for i, s in enumerate(specs) if s.name == "model.layers.0.self_attn.k_proj.weight")
    for w in range(2):
        pieces = [p for r in range(2) for p in plan.links[r][w].pieces if p.tensor == k]
        assert sum(p.numel for p in pieces) == specs[k].numel  # the whole head, from both trainer ranks' rows
    assert sum(plan.bytes_in) == plan.model_bytes + sum(s.nbytes for s in specs if any(x in s.name for x in ("norm", "k_proj", "v_proj")))


def test_experts_split_over_the_workers_go_to_the_one_that_holds_them():
    specs = llama(experts=4)
    holdings = fsdp2(specs, 2)
    plan = build_mxn_plan(holdings, engine_needs(specs, 2, experts=4))
    check_moves_exactly_the_needs(plan, holdings)
    for w in range(2):
        names = {specs[p.tensor].name for r in range(2) for p in plan.links[r][w].pieces}
        mine = {n.split(".experts.")[1].split(".")[0] for n in names if ".experts." in n}
        assert mine == ({"0", "1"} if w == 0 else {"2", "3"})


def test_a_padded_vocabulary_sends_only_its_real_rows():
    specs = llama(vocab=96)  # padded to 128: worker 0 rows 0..64, worker 1 rows 64..96 (and 32 rows it zeroes)
    holdings = fsdp2(specs, 3)
    plan = build_mxn_plan(holdings, engine_needs(specs, 2))
    check_moves_exactly_the_needs(plan, holdings)
    embed = 0
    got = [sum(p.numel for r in range(3) for p in plan.links[r][w].pieces if p.tensor == embed) for w in range(2)]
    assert got == [64 * HIDDEN, 32 * HIDDEN]


def test_megatron_tp2_pp2_blocks_into_two_workers():
    from hal.integrations.megatron.convert import MegatronShape, hf_state

    specs = llama(vocab=10)
    declarations = []
    for pp in range(2):
        for tp in range(2):
            shape = MegatronShape(hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, head_dim=HEAD, ffn_hidden_size=8,
                                  vocab_size=12, hf_vocab_size=10, tp_rank=tp, tp_size=2, layers={0: pp})
            local = [(f"decoder.layers.0.{n}", torch.zeros(s)) for n, s in (
                ("input_layernorm.weight", (HIDDEN,)), ("self_attention.linear_qkv.weight", (8, HIDDEN)),
                ("self_attention.linear_proj.weight", (HIDDEN, 4)), ("pre_mlp_layernorm.weight", (HIDDEN,)),
                ("mlp.linear_fc1.weight", (8, HIDDEN)), ("mlp.linear_fc2.weight", (HIDDEN, 4)))]
            if pp == 0:
                local.insert(0, ("embedding.word_embeddings.weight", torch.zeros(6, HIDDEN)))
            else:
                local += [("decoder.final_layernorm.weight", torch.zeros(HIDDEN)), ("output_layer.weight", torch.zeros(6, HIDDEN))]
            declarations.append(declare(hf_state(local, shape), pp * 2 + tp, 4))
    holdings = build_shard_plan(declarations)
    plan = build_mxn_plan(holdings, engine_needs(specs, 2))
    check_moves_exactly_the_needs(plan, holdings)
    # o_proj's columns: Megatron's TP rank w holds exactly vLLM worker w's, so each comes over one link
    o = next(i for i, s in enumerate(specs) if s.name == "model.layers.1.self_attn.o_proj.weight")
    for w in range(2):
        senders = {r for r in range(4) for p in plan.links[r][w].pieces if p.tensor == o}
        assert senders == {2 + w}
    assert plan.bytes_out[0] + plan.bytes_out[1] > 0 and plan.bytes_out[2] + plan.bytes_out[3] > 0


def test_a_tensor_no_worker_needs_is_dropped_and_named():
    specs = llama(tied=True)
    trainer = specs + (TensorSpec("lm_head.weight", (10, HIDDEN), F32),)  # the trainer keeps the tied head's name
    holdings = fsdp2(trainer, 2)
    plan = build_mxn_plan(holdings, engine_needs(specs, 2))
    assert plan.dropped == ("lm_head.weight",)
    check_moves_exactly_the_needs(plan, holdings)


def test_what_no_trainer_rank_holds_or_holds_in_another_shape_is_refused_by_name():
    specs = llama()
    needs = engine_needs(specs, 2)
    short = build_shard_plan([[Declared(s.name, s.shape, s.dtype, SHARD0) for s in specs if s.name != "model.norm.weight"]] * 2)
    with pytest.raises(SpecMismatchError, match=re.escape(
            "parameter 'model.norm.weight': engine workers [0, 1] need elements 0..8; 8 of its 8 elements are sent by no trainer rank "
            "(no trainer rank declares it)")):
        build_mxn_plan(short, needs)
    other = build_shard_plan([[Declared(s.name, (9, 8) if s.name == "lm_head.weight" else s.shape, s.dtype, SHARD0) for s in specs]] * 2)
    with pytest.raises(SpecMismatchError, match=r"parameter 'lm_head.weight': the trainer ranks declare shape \(9, 8\), the engine's checkpoint has \(10, 8\)"):
        build_mxn_plan(other, needs)
    with pytest.raises(SpecMismatchError, match="engine workers 0 and 1 recorded their needs against different checkpoints"):
        build_mxn_plan(fsdp2(specs, 2), [needs[0], engine_needs(llama(vocab=12), 2)[1]])
    with pytest.raises(ValueError, match=r"the needs of engine worker 1 are at index 0 \(index = the worker\)"):
        build_mxn_plan(fsdp2(specs, 2), needs[::-1])


def _edited(holdings: ShardPlan, rank: int, name: str, edit) -> ShardPlan:
    """`holdings` with rank `rank`'s shares of tensor `name` replaced by `edit(share)` (a list)."""
    shares = [list(s) for s in holdings.shares]
    shares[rank] = [x for s in shares[rank] for x in (edit(s) if s.spec.name == name else [s])]
    return ShardPlan(holdings.specs, tuple(map(tuple, shares)), holdings.kinds, holdings.digests)


def test_a_hole_or_a_box_sent_twice_in_the_holdings_is_refused_naming_the_workers_and_the_ranks():
    specs = llama()
    q = "model.layers.0.self_attn.q_proj.weight"  # (8, 8): trainer ranks hold rows 0..3, 3..6, 6..8; workers need 0..4, 4..8
    holdings = fsdp2(specs, 3)
    with pytest.raises(SpecMismatchError) as caught:
        build_mxn_plan(_edited(holdings, 1, q, lambda s: []), engine_needs(specs, 2))
    assert str(caught.value) == (
        "what the engine's workers need is not sent exactly once by the trainer's ranks: "
        f"parameter {q!r}: engine worker 0 needs rows 0..4, columns 0..8; 8 of its 32 elements are sent by no trainer rank "
        "(sent: rank 0 rows 0..3, columns 0..8); "
        f"parameter {q!r}: engine worker 1 needs rows 4..8, columns 0..8; 16 of its 32 elements are sent by no trainer rank "
        "(sent: rank 2 rows 6..8, columns 0..8)"
    )
    with pytest.raises(SpecMismatchError, match=re.escape(
            f"parameter {q!r}: engine worker 0 needs rows 0..4, columns 0..8; parts of it are sent twice "
            "(sent: rank 0 rows 0..3, columns 0..8, rank 0 rows 0..3, columns 0..8, rank 1 rows 3..6, columns 0..8)")):
        build_mxn_plan(_edited(holdings, 0, q, lambda s: [s, s]), engine_needs(specs, 2))


def test_bytes_in_are_a_workers_shard_plus_what_it_shares_and_bytes_out_a_ranks_rows_times_their_readers():
    specs = llama(vocab=128, kv_heads=1)  # one KV head for two workers: k and v go to both, as the norms
    replicated = sum(s.nbytes for s in specs if any(k in s.name for k in ("norm", "k_proj", "v_proj")))
    split = sum(s.nbytes for s in specs) - replicated  # every other tensor halved between the workers (rows or columns)
    holdings = fsdp2(specs, 2)
    plan = build_mxn_plan(holdings, engine_needs(specs, 2))
    check_moves_exactly_the_needs(plan, holdings)
    assert plan.bytes_in == (split // 2 + replicated,) * 2
    # FSDP2: each rank owns half the rows of every tensor; a replicated tensor's half goes to both workers
    assert plan.bytes_out == ((split + 2 * replicated) // 2,) * 2
    assert plan.largest_link.nbytes == max(link.nbytes for row in plan.links for link in row)
    assert plan.pieces == sum(link.count for row in plan.links for link in row)


def test_the_plan_is_the_same_on_every_rank_and_its_digest_follows_its_inputs():
    specs = llama()
    a = build_mxn_plan(fsdp2(specs, 2), engine_needs(specs, 2))
    b = build_mxn_plan(fsdp2(specs, 2), engine_needs(specs, 2))
    assert a.digest == b.digest and [l.pieces for row in a.links for l in row] == [l.pieces for row in b.links for l in row]
    assert build_mxn_plan(fsdp2(specs, 3), engine_needs(specs, 2)).digest != a.digest
    assert build_mxn_plan(fsdp2(specs, 2), engine_needs(specs, 4)).digest != a.digest
    wire = tuple(TensorSpec(s.name, s.shape, torch.bfloat16) for s in specs)
    assert build_mxn_plan(fsdp2(specs, 2), engine_needs(wire, 2)).digest != a.digest  # the wire dtype, through the needs


def test_bytes_are_counted_at_the_engines_wire_dtype():
    specs = llama()
    wire = tuple(TensorSpec(s.name, s.shape, torch.bfloat16) for s in specs)
    plan = build_mxn_plan(fsdp2(specs, 2), engine_needs(wire, 2))
    assert sum(plan.bytes_in) == 2 * sum(math.prod(n.sizes) for r in plan.needs for n in r.needs)
