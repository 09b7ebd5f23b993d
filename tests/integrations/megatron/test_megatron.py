"""A Megatron-core trainer as a source: TP=2 x PP=2 on gloo, every rank sending its own shards.

Four spawned processes run megatron-core 0.16.1 on the CPU (tests/integrations/megatron/harness.py
says how): a Llama-shaped `GPTModel` (RMSNorm, SwiGLU, 8 query heads in 4 groups: two per TP
rank, RoPE) with its weights re-drawn from a seed. The engine is a stand-in (a thread of
rank 0 receiving with `ShardedReceiver`, as hal's vLLM engine does; the live vLLM engines
are in test_megatron_vllm.py). One run of the four ranks checks, in order:

1. the logits check: Megatron's own forward (the stages by hand) against transformers'
   on the Hugging Face state hal's rules make of every rank's shards, within 1e-5 (fp32),
   untied, tied, and with Qwen2's q/k/v biases;
2. three syncs through `WeightSync(senders="all")` with an Adam step before the second and
   third: the engine holds the Hugging Face conversion bit for bit, each rank's
   `metrics.bytes` is its own shards plus its part of its stage's norms (counted from
   Megatron's parameters), and the sum is the model;
3. mismatched declarations (rank 3 leaves a tensor out): refused on every rank naming the
   tensor, the engine unchanged;
4. a rank failing part-way (rank 3's source raises at its fifth share): every rank raises,
   every engine tensor holds its old or its new bytes.

A second run kills rank 3 part-way through a sync: every other rank raises within the
timeout, and no tensor rank 3 had a share of changed on the engine.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from tests.integrations.megatron.harness import NEEDS
from tests.multiproc import run_group

pytestmark = [*NEEDS, pytest.mark.megatron, pytest.mark.multiprocess, pytest.mark.cpu, pytest.mark.timeout(600)]

TIMEOUT_S = 20.0
LEFT_OUT = "model.layers.3.mlp.down_proj.weight"  # rank 3 (stage 1, TP rank 1) holds its columns 192..384


class Leaving:
    """A source that leaves one tensor out (a rank whose declaration differs from the others')."""

    def __init__(self, source: Any, name: str) -> None:
        self.source, self.name = source, name

    def local_tensors(self) -> list:
        return [(n, t) for n, t in self.source.local_tensors() if n != self.name]

    def metadata(self) -> list:
        return self.source.metadata()

    def __iter__(self):
        return iter(self.source)


def megatron_rank(rank: int, world: int, scenario: str) -> dict[str, Any]:
    import hal

    with hal.use("cpu"):
        return _megatron_rank(rank, scenario)


def _megatron_rank(rank: int, scenario: str) -> dict[str, Any]:
    import torch.distributed as dist

    from hal.integrations.megatron import MegatronSource
    from hal.integrations.vllm.client import WeightSync
    from hal.sync import SyncConfig, SyncError, TensorSpec
    from hal.sync.send import sharded
    from tests.integrations.megatron import harness as h

    torch.set_num_threads(1)
    meg = h.build(2, 2, seed=1)
    source = MegatronSource(meg.model)
    out: dict[str, Any] = {"own_bytes": h.own_bytes(meg), "syncs": []}
    if scenario == "main":
        out["logits_gap"] = h.logits_gap(meg, source)
    hf = h.gather_hf(source)
    engine = None
    if rank == 0:
        engine = h.StandInEngine([TensorSpec(n, tuple(t.shape), t.dtype) for n, t in hf.items()])
        out["model_bytes"] = sum(t.numel() * t.element_size() for t in hf.values())
        out["hf_names"] = sorted(hf)
    config = SyncConfig(bucket_bytes=256 << 10, segment_bytes=64 << 10, timeout_s=TIMEOUT_S)
    sync = WeightSync([engine] if engine else [], config=config, timeout_s=2 * TIMEOUT_S, trainer_group=dist.group.WORLD,
                      senders="all", resend_after_failure=0)
    sync.init()
    optimizer = torch.optim.Adam(meg.model.parameters(), lr=1e-3)

    def held() -> dict[str, str] | None:
        return h.digest(engine.weights) if engine is not None else None

    try:
        versions = (1, 2, 3) if scenario == "main" else (1,)
        from hal.integrations.verl import internals as verl_internals

        verl_engine = h.VerlMegatronEngine(meg.model)
        out["verl_refusals"] = [verl_internals.shard_refusal(verl_engine)] + [
            verl_internals.shard_refusal(h.VerlMegatronEngine(meg.model, **change))
            for change in ({"peft_cls": object}, {"_qat_enabled": True}, {"_is_offload_param": True}, {"model_type": "gemma3"})
        ]
        for version in versions:
            if version > 1:
                h.train_step(meg, optimizer, version)
            # the third sync reads the model as hal's verl checkpoint engine reads verl's Megatron engine
            result = sync.sync(verl_internals.engine_shards(verl_engine) if version == 3 else source, version=version)
            hf = h.gather_hf(source)
            out["syncs"].append({
                "bytes": result.metrics.bytes, "model_bytes": result.metrics.model_bytes, "versions": result.engine_versions,
                "hf": h.digest(hf) if hf is not None else None, "held": held(),
            })
        if scenario == "main":
            # 3. rank 3 leaves a tensor out: its declaration does not fit the others'
            try:
                sync.sync(Leaving(source, LEFT_OUT) if rank == 3 else source, version=4)
                out["mismatch"] = ("completed",)
            except SyncError as exc:
                out["mismatch"] = (type(exc).__name__, str(exc))
            out["mismatch_held"] = held()
        # 4. (main) rank 3's source fails at its fifth share; (killed) rank 3 dies at its third
        h.train_step(meg, optimizer, 10)
        new = h.gather_hf(source)
        out["old"], out["new"] = out["syncs"][-1]["hf"], h.digest(new) if new is not None else None
        if rank == 3:
            real = sharded._Shares.__iter__

            def failing(self, real=real):
                for i, item in enumerate(real(self)):
                    if scenario == "main" and i == 4:
                        raise RuntimeError("the trainer's weights are gone")
                    if scenario == "killed" and i == 2:
                        os._exit(9)  # a trainer rank lost mid-sync, after its first shares went
                    yield item

            sharded._Shares.__iter__ = failing
        start = time.monotonic()
        try:
            sync.sync(source, version=5)
            out["failed"] = ("completed",)
        except Exception as exc:  # noqa: BLE001 - recorded, checked by the test
            out["failed"] = (type(exc).__name__, str(exc)[:600], time.monotonic() - start)
        out["failed_held"] = held()
    finally:
        if scenario == "main":
            sync.close()
    if scenario == "main":
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        tied = h.build(2, 2, tied=True, seed=2)
        tied_source = MegatronSource(tied.model)
        out["tied_logits_gap"] = h.logits_gap(tied, tied_source)
        out["tied_names"] = sorted(h.gather_hf(tied_source) or {})
        ps.destroy_model_parallel()
        qwen2 = h.build(2, 2, seed=6, qwen2=True)  # q/k/v biases, de-interleaved like the weights
        qwen2_source = MegatronSource(qwen2.model)
        out["qwen2_logits_gap"] = h.logits_gap(qwen2, qwen2_source)
        out["qwen2_names"] = sorted(h.gather_hf(qwen2_source) or {})
    return out


@pytest.fixture(scope="module")
def main_run() -> list[dict[str, Any]]:
    return run_group(megatron_rank, 4, args=("main",), timeout=540, collective_timeout=4 * TIMEOUT_S)


def test_megatrons_logits_equal_transformers_on_the_converted_state(main_run):
    gap, tied_gap = main_run[0]["logits_gap"], main_run[0]["tied_logits_gap"]
    assert gap < 1e-5, f"untied: Megatron's logits and transformers' differ by {gap}"
    assert tied_gap < 1e-5, f"tied: Megatron's logits and transformers' differ by {tied_gap}"
    qwen2_gap = main_run[0]["qwen2_logits_gap"]
    assert qwen2_gap < 1e-5, f"Qwen2 (q/k/v biases): Megatron's logits and transformers' differ by {qwen2_gap}"
    assert "model.layers.3.self_attn.k_proj.bias" in main_run[0]["qwen2_names"]
    assert "lm_head.weight" in main_run[0]["hf_names"] and "lm_head.weight" not in main_run[0]["tied_names"]
    layers = {n.split(".")[2] for n in main_run[0]["hf_names"] if n.startswith("model.layers.")}
    assert layers == {"0", "1", "2", "3"}  # global names over both stages


def test_three_syncs_bit_exact_with_each_rank_sending_exactly_its_share(main_run):
    total = main_run[0]["model_bytes"]
    assert sum(r["own_bytes"] for r in main_run) == total
    for step in range(3):
        records = [r["syncs"][step] for r in main_run]
        for rank, record in enumerate(records):
            assert record["bytes"] == main_run[rank]["own_bytes"], f"sync {step + 1}: rank {rank} sent {record['bytes']}, its share is {main_run[rank]['own_bytes']}"
            assert record["model_bytes"] == total and record["versions"] == {"stand-in": str(step + 1)}
        assert records[0]["held"] == records[0]["hf"], f"sync {step + 1}: the engine does not hold the Hugging Face conversion"
    digests = [main_run[0]["syncs"][s]["hf"] for s in range(3)]
    assert digests[0] != digests[1] != digests[2]  # the optimizer moved the weights


def test_verl_megatron_engine_stand_in_is_read_as_its_shards_and_what_verl_transforms_is_refused(main_run):
    """verl 0.9.1's Megatron engine cannot be built here (it requires Megatron-Bridge, Python
    >= 3.12, Transformer Engine, apex and CUDA builds of torch 2.11: its `megatron` extra);
    a stand-in with the attributes hal reads from it (harness.VerlMegatronEngine) is read as
    hal's checkpoint engine reads the real one (the third sync above went through it)."""
    plain, lora, qat, offload, other = main_run[0]["verl_refusals"]
    assert plain is None
    assert "LoRA" in lora and "QAT" in qat and "param_offload" in offload
    assert "model type 'gemma3'" in other


def test_mismatched_declarations_are_refused_by_name_on_every_rank(main_run):
    for rank, record in enumerate(main_run):
        kind, message = record["mismatch"]
        assert kind == "SpecMismatchError", (rank, message)
        assert f"parameter {LEFT_OUT!r}: the blocks declared do not tile (256, 384) exactly once" in message, (rank, message)
    assert main_run[0]["mismatch_held"] == main_run[0]["syncs"][-1]["hf"]  # nothing applied


def test_a_rank_failing_part_way_leaves_every_tensor_old_or_new(main_run):
    for rank, record in enumerate(main_run):
        assert record["failed"][0] == "SourceError", (rank, record["failed"])
    assert "the trainer's weights are gone" in main_run[3]["failed"][1]
    old, new, held = main_run[0]["old"], main_run[0]["new"], main_run[0]["failed_held"]
    assert all(held[n] in (old[n], new[n]) for n in held), "a tensor holds neither its old nor its new bytes"
    assert held != new


def test_a_killed_rank_is_detected_and_its_tensors_stay_old():
    results = run_group(megatron_rank, 4, args=("killed",), timeout=540, collective_timeout=4 * TIMEOUT_S, allow_failure=True)
    assert "exit code 9" in results[3] or "died" in results[3], results[3]
    for rank in (0, 1, 2):
        kind, message, seconds = results[rank]["failed"]
        assert kind in ("PeerError", "SyncError", "SourceError"), (rank, message)
        assert seconds < 8 * TIMEOUT_S, f"rank {rank} took {seconds:.1f} s"
    old, new, held = results[0]["old"], results[0]["new"], results[0]["failed_held"]
    assert all(held[n] in (old[n], new[n]) for n in held), "a tensor holds neither its old nor its new bytes"
    # rank 3 is on stage 1: every tensor it had a share of (layers 2-3, the norm, lm_head) is old
    stage1 = [n for n in held if n.startswith(("model.layers.2.", "model.layers.3.", "model.norm", "lm_head"))]
    assert stage1 and all(held[n] == old[n] for n in stage1)
