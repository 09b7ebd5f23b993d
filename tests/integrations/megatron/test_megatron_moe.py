"""A Megatron-core MoE trainer with expert parallelism (EP=2) as a source.

Two spawned processes run megatron-core 0.16.1 on the CPU (harness.build_moe): a
Qwen3-MoE-shaped `GPTModel` (q/k norms, a router, 4 experts of which each EP rank holds 2,
top-2 routing, all-gather token dispatch), TP=1, PP=1, the two ranks data-parallel
replicas of everything but their experts. One run checks:

1. the logits check: Megatron's own logits equal transformers' Qwen3-MoE on the Hugging
   Face state hal's rules make of both ranks' parts (experts under their global names:
   EP rank 1's local expert 0 is `experts.2`), within 1e-5 (fp32);
2. with a sigmoid router and Megatron's `router.expert_bias` (a buffer, not a parameter):
   two syncs through `WeightSync(senders="all")` into a stand-in engine, the bias changed
   between them: the engine holds the conversion bit for bit, the bias included (as
   `mlp.gate.e_score_correction_bias`), each rank sent its own experts and half of every
   replicated tensor, no more.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.integrations.megatron.harness import NEEDS
from tests.multiproc import run_group

pytestmark = [*NEEDS, pytest.mark.megatron, pytest.mark.multiprocess, pytest.mark.cpu, pytest.mark.timeout(600)]

TIMEOUT_S = 20.0


def moe_rank(rank: int, world: int) -> dict[str, Any]:
    import hal

    with hal.use("cpu"):
        return _moe_rank(rank, world)


def _moe_rank(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hal.integrations.megatron import MegatronSource
    from hal.integrations.vllm.client import WeightSync
    from hal.sync import SyncConfig, TensorSpec
    from tests.integrations.megatron import harness as h

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    # 1. the logits check, softmax top-k router (Qwen3-MoE's)
    meg = h.build_moe(world, seed=4)
    source = MegatronSource(meg.model)
    out["experts"] = sorted({n.split(".experts.")[1].split(".")[0] for n, _ in source.local_tensors() if ".experts." in n})
    hf = h.gather_hf(source)
    tokens = torch.randint(3, h.VOCAB, (2, h.SEQ), generator=torch.Generator().manual_seed(9))
    logits = h.full_logits(meg, tokens)
    if rank == 0:
        with torch.no_grad():
            reference = h.moe_reference(hf)(input_ids=tokens).logits
        out["logits_gap"] = float((reference - logits).abs().max())
    ps.destroy_model_parallel()

    # 2. a sigmoid router with expert_bias: two syncs, the bias changed between them
    meg = h.build_moe(world, expert_bias=True, seed=5)
    source = MegatronSource(meg.model)
    hf = h.gather_hf(source)
    engine = None
    if rank == 0:
        engine = h.StandInEngine([TensorSpec(n, tuple(t.shape), t.dtype) for n, t in hf.items()])
        out["names"] = sorted(hf)
        # each rank's share from the Hugging Face state alone: its experts whole, half the rows of the rest
        experts_per_rank = h.EXPERTS // world
        share = [0] * world
        for name, t in hf.items():
            if ".experts." in name:
                share[int(name.split(".experts.")[1].split(".")[0]) // experts_per_rank] += t.numel() * t.element_size()
            else:
                rows = t.shape[0]
                for r in range(world):
                    size = -(-rows // world)
                    lo = min(r * size, rows)
                    share[r] += (min(lo + size, rows) - lo) * (t.numel() // rows) * t.element_size()
        out["shares"], out["model_bytes"] = share, sum(t.numel() * t.element_size() for t in hf.values())
    config = SyncConfig(bucket_bytes=64 << 10, segment_bytes=16 << 10, timeout_s=TIMEOUT_S)
    sync = WeightSync([engine] if engine else [], config=config, timeout_s=2 * TIMEOUT_S, trainer_group=dist.group.WORLD, senders="all")
    sync.init()
    out["syncs"] = []
    try:
        for version in (1, 2):
            if version == 2:
                with torch.no_grad():  # the bias moves between steps (Megatron updates it from the tokens per expert)
                    for name, buffer in meg.model.named_buffers():
                        if name.endswith("router.expert_bias"):
                            buffer.add_(0.25)
            metrics = sync.sync(source, version=version).metrics
            hf = h.gather_hf(source)
            record = {"bytes": metrics.bytes, "model_bytes": metrics.model_bytes}
            if rank == 0:
                record["hf"], record["held"] = h.digest(hf), h.digest(engine.weights)
                record["bias"] = engine.weights["model.layers.0.mlp.gate.e_score_correction_bias"].tolist()
            out["syncs"].append(record)
    finally:
        sync.close()
    return out


@pytest.fixture(scope="module")
def moe_run() -> list[dict[str, Any]]:
    return run_group(moe_rank, 2, timeout=540, collective_timeout=4 * TIMEOUT_S)


def test_experts_go_under_their_global_names_and_the_logits_equal_transformers(moe_run):
    assert moe_run[0]["experts"] == ["0", "1"] and moe_run[1]["experts"] == ["2", "3"]
    gap = moe_run[0]["logits_gap"]
    assert gap < 1e-5, f"Megatron's MoE logits and transformers' Qwen3-MoE differ by {gap}"


def test_each_ep_rank_sends_its_experts_and_the_expert_bias_buffer_travels(moe_run):
    lead = moe_run[0]
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in lead["names"]
    assert sum(lead["shares"]) == lead["model_bytes"]
    for step in range(2):
        for rank, record in enumerate(moe_run):
            assert record["syncs"][step]["bytes"] == lead["shares"][rank], f"sync {step + 1}: rank {rank}"
            assert record["syncs"][step]["model_bytes"] == lead["model_bytes"]
        assert lead["syncs"][step]["held"] == lead["syncs"][step]["hf"], f"sync {step + 1}: the engine does not hold the conversion"
    first, second = lead["syncs"][0]["bias"], lead["syncs"][1]["bias"]
    assert second == pytest.approx([b + 0.25 for b in first]) and first != second  # the buffer's new values arrived
