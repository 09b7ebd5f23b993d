"""The M x N plan at the size of a large MoE checkpoint (~90k tensors, DeepSeek-V3 FP8's
count): the inputs are tiny tensors, since the plan's work grows with tensors, needs and
shares, not with elements. What is asserted is the plan's structure; the time it takes
is printed (`-s`), never asserted (a shared machine decides it).
"""

from __future__ import annotations

import time

import torch

from hal.sync.plan.mxn import build_mxn_plan
from hal.sync.plan.needs import Need, Target, WorkerNeeds, contiguous_strides
from hal.sync.plan.shards import SHARD0, Declared, build_shard_plan
from hal.sync.spec import TensorSpec

LAYERS, EXPERTS, SENDERS, WORKERS = 58, 256, 4, 8
BF16, F32 = torch.bfloat16, torch.float32


def checkpoint() -> tuple[TensorSpec, ...]:
    """Per layer: two norms, q rows and o columns split over the workers, a router every worker
    reads, and per expert gate, up and down with an FP8-like scale each (one element)."""
    specs = [TensorSpec("model.embed_tokens.weight", (64, 8), BF16)]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        specs += [TensorSpec(p + "input_layernorm.weight", (8,), BF16), TensorSpec(p + "self_attn.q_proj.weight", (16, 8), BF16),
                  TensorSpec(p + "self_attn.o_proj.weight", (8, 16), BF16), TensorSpec(p + "post_attention_layernorm.weight", (8,), BF16),
                  TensorSpec(p + "mlp.gate.weight", (EXPERTS, 8), BF16)]
        for e in range(EXPERTS):
            for w, shape in (("gate_proj", (4, 8)), ("up_proj", (4, 8)), ("down_proj", (8, 4))):
                specs += [TensorSpec(f"{p}mlp.experts.{e}.{w}.weight", shape, BF16), TensorSpec(f"{p}mlp.experts.{e}.{w}.weight_scale_inv", (1, 1), F32)]
    return tuple(specs)


def box_of(name: str, shape: tuple[int, ...], w: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    if ".experts." in name:  # expert parallel: 32 experts per worker
        return ((0,) * len(shape), shape) if int(name.split(".experts.")[1].split(".")[0]) * WORKERS // EXPERTS == w else None
    if "q_proj" in name or "embed_tokens" in name:
        per = shape[0] // WORKERS
        return (w * per, 0), (per, shape[1])
    if "o_proj" in name:
        per = shape[1] // WORKERS
        return (0, w * per), (shape[0], per)
    return (0,) * len(shape), shape  # norms and the router, to every worker


def test_a_plan_of_90k_tensors_is_built_from_arrays():
    specs = checkpoint()
    assert len(specs) > 89_000
    declared = [Declared(s.name, s.shape, s.dtype, SHARD0) for s in specs]
    holdings = build_shard_plan([declared] * SENDERS)
    needs = []
    for w in range(WORKERS):
        targets, own = [], []
        for i, s in enumerate(specs):
            box = box_of(s.name, s.shape, w)
            if box is not None:
                targets.append(Target(s.name.rpartition(".")[0], s.name.rpartition(".")[2], box[1]))
                own.append(Need(i, box[0], box[1], len(targets) - 1, 0, contiguous_strides(box[1])))
        needs.append(WorkerNeeds(w, specs, tuple(targets), tuple(own)))

    start = time.perf_counter()
    plan = build_mxn_plan(holdings, needs)
    built = time.perf_counter() - start
    pieces = plan.links[0][3].pieces
    print(f"\n{len(specs)} tensors, {SENDERS} senders x {WORKERS} workers: {plan.pieces} pieces in {built:.2f} s, "
          f"a link's {len(pieces)} pieces in {time.perf_counter() - start - built:.2f} s")

    # FSDP2 over 4 ranks: a (4, 8) expert tensor is 4 one-row shares, a (8, 4) one 4 of two rows,
    # a scale one share: 15 pieces per expert, to its one worker; a norm or the router 4 shares
    # to each of 8 workers; q's rows and the embedding's: each worker's 2 rows inside one share;
    # o's columns: each worker's 2 columns cut by the 4 row shares
    per_layer = EXPERTS * 15 + 3 * SENDERS * WORKERS + WORKERS + SENDERS * WORKERS
    assert plan.pieces == LAYERS * per_layer + WORKERS
    assert plan.dropped == ()
    replicated = sum(s.nbytes for s in specs if "norm" in s.name or "mlp.gate." in s.name)
    assert sum(plan.bytes_in) == plan.model_bytes + (WORKERS - 1) * replicated
    assert sum(plan.bytes_out) == sum(plan.bytes_in)
    # sender 0 to worker 3: the first rows of worker 3's experts' tensors and their scales, the
    # norms' and the router's first rows, o's columns' first rows (q's and the embedding's rows
    # of worker 3 are sender 1's)
    experts = {specs[p.tensor].name.split(".experts.")[1].split(".")[0] for p in pieces if ".experts." in specs[p.tensor].name}
    assert experts == {str(e) for e in range(3 * EXPERTS // WORKERS, 4 * EXPERTS // WORKERS)}
    assert all(p.offsets[0] == 0 for p in pieces)
    assert len(pieces) == LAYERS * (EXPERTS // WORKERS * 6 + 4)
