"""LoRA-aware sync of a peft model: names the engine expects, merged export, and a
multi-process sync where only adapter bytes travel in the steady state."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.multiproc import run_group

pytestmark = pytest.mark.cpu

R = 4
TARGETS = ["q_proj", "v_proj", "embed_tokens"]


def tiny_peft_model(seed: int = 0):
    """A 2-layer Llama with a LoRA adapter whose B matrices are non-zero (so the adapter matters)."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    base = AutoModelForCausalLM.from_config(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft warns that embedding layers are targeted
        model = get_peft_model(base, LoraConfig(r=R, lora_alpha=2 * R, target_modules=TARGETS))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def train_adapter(model, step: int) -> None:
    """Stand-in for an optimizer step: only the adapter changes."""
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.01)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


# ---- names ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "peft_name,engine_name",
    [
        ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("base_model.model.model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.weight"),
        ("base_model.model.model.embed_tokens.base_layer.weight", "model.embed_tokens.weight"),
        ("base_model.model.lm_head.weight", "lm_head.weight"),
        ("base_model.model.lm_head.original_module.weight", "lm_head.weight"),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", None),
        ("base_model.model.model.embed_tokens.lora_embedding_B.default", None),
        ("base_model.model.lm_head.modules_to_save.default.weight", None),
        ("model.norm.weight", "model.norm.weight"),
    ],
)
def test_base_weight_name(peft_name, engine_name):
    from hal.sync.lora import base_weight_name

    assert base_weight_name(peft_name) == engine_name


@pytest.mark.parametrize(
    "peft_name,vllm_name",
    [
        (
            "base_model.model.model.layers.1.self_attn.v_proj.lora_B.default.weight",
            "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight",
        ),
        ("base_model.model.model.embed_tokens.lora_embedding_A.default", "base_model.model.model.embed_tokens.lora_embedding_A"),
        ("base_model.model.model.layers.1.self_attn.v_proj.lora_B.other.weight", None),
        ("base_model.model.model.layers.1.self_attn.v_proj.base_layer.weight", None),
        ("base_model.model.model.norm.weight", None),
    ],
)
def test_adapter_weight_name(peft_name, vllm_name):
    from hal.sync.lora import adapter_weight_name

    assert adapter_weight_name(peft_name) == vllm_name


@pytest.mark.parametrize(
    "name",
    ["base_model.model.lm_head.modules_to_save.default.weight", "base_model.model.x.q_proj.lora_magnitude_vector.default.weight"],
)
def test_unsupported_adapter_parameters_are_named(name):
    from hal.sync.lora import adapter_weight_name

    with pytest.raises(NotImplementedError, match=name.replace(".", r"\.")):
        adapter_weight_name(name)


def test_base_tensors_are_the_plain_models_names_and_views():
    from hal.sync.lora import base_tensors

    model = tiny_peft_model()
    plain_names = [n for n, _ in model.get_base_model().named_parameters() if "lora_" not in n]
    expected = [n.replace(".base_layer", "") for n in plain_names]
    pairs = base_tensors(model)
    assert [n for n, _ in pairs] == expected
    params = dict(model.named_parameters())
    assert pairs[1][1].data_ptr() == params["base_model.model." + plain_names[1]].data_ptr()  # a view, no copy


def test_adapter_tensors_match_what_peft_saves_and_vllm_parses():
    from peft import get_peft_model_state_dict

    from hal.sync.lora import adapter_tensors

    model = tiny_peft_model()
    pairs = dict(adapter_tensors(model))
    saved = get_peft_model_state_dict(model, save_embedding_layers=False)
    assert pairs.keys() == saved.keys()
    for name, t in pairs.items():
        assert torch.equal(t, saved[name]), name
    try:
        from vllm.lora.utils import parse_fine_tuned_lora_name
    except Exception as exc:  # pragma: no cover - vllm absent
        pytest.skip(f"vllm not importable: {exc}")
    modules = {parse_fine_tuned_lora_name(n)[0] for n in pairs}
    assert "model.layers.0.self_attn.q_proj" in modules and "model.embed_tokens" in modules


def test_adapter_tensors_of_a_model_without_that_adapter():
    from hal.sync.lora import adapter_tensors

    with pytest.raises(ValueError, match="no LoRA parameters of adapter 'nope'"):
        adapter_tensors(tiny_peft_model(), "nope")
    with pytest.raises(ValueError, match="not a peft model"):
        adapter_tensors(torch.nn.Linear(2, 2))


def test_merged_export_equals_merge_and_unload_and_leaves_the_model_alone():
    from hal.sync.lora import MergedSource, merged_tensors

    model = tiny_peft_model()
    before = {n: _bits(p).clone() for n, p in model.named_parameters()}
    merged = dict(merged_tensors(model))
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for name, t in merged.items():
        assert torch.equal(_bits(t), _bits(reference[name])), name
    # the adapter really changed the LoRA'd weights
    base = dict(model.get_base_model().named_parameters())
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.base_layer.weight"])
    for n, p in model.named_parameters():
        assert torch.equal(_bits(p), before[n]), f"{n} was changed by the merged export"
    source = MergedSource(model)
    assert [s.name for s in source.metadata()] == [n for n, _ in source]
    assert [s.shape for s in source.metadata()] == [tuple(t.shape) for _, t in source]


def test_merged_export_of_an_already_merged_model_adds_nothing():
    from hal.sync.lora import merged_tensors

    model = tiny_peft_model()
    expected = {n: t.clone() for n, t in merged_tensors(model)}
    model.merge_adapter()  # peft merges in place; the export must not add the delta twice
    got = dict(merged_tensors(model))
    for name, t in got.items():
        torch.testing.assert_close(t, expected[name], rtol=0, atol=1e-6)


def test_adapter_config_is_json():
    from hal.sync.lora import adapter_config

    cfg = adapter_config(tiny_peft_model())
    assert cfg["r"] == R and cfg["lora_alpha"] == 2 * R
    assert cfg["target_modules"] == sorted(TARGETS)
    json.dumps(cfg)


def test_adapter_specs_from_engine_side_information_match_the_trainer():
    from hal.sync import TensorSpec
    from hal.sync.lora import adapter_specs, adapter_tensors, base_tensors

    model = tiny_peft_model()
    base_specs = [TensorSpec.of(n, t) for n, t in base_tensors(model)]
    computed = adapter_specs(base_specs, r=R, target_modules=TARGETS)
    actual = [TensorSpec.of(n, t) for n, t in adapter_tensors(model)]
    assert sorted(computed, key=lambda s: s.name) == sorted(actual, key=lambda s: s.name)
    with pytest.raises(ValueError, match="no base weight matches"):
        adapter_specs(base_specs, r=R, target_modules=["nothing_here"])


# ---- multi-process sync -------------------------------------------------------------------

# (sleep_level, free_cache_engine, steps at whose start the engine reports it freed its weights)
SCENARIOS = {
    "level1_keeps_base": (1, True, {3}),
    "no_free_cache_engine": (2, False, set()),
    "level2_frees_every_sleep": (2, True, set()),
}
STEPS = 5


def _portable(obj):
    """Tensors cross the result queue as bytes: shared-memory handles die with the child."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unportable(data):
    import io

    return torch.load(io.BytesIO(data), weights_only=True)


def _adapter_scenario(rank: int, ckpt: str, scenario: str, config) -> list[dict]:
    import torch.distributed as dist

    import hal
    from hal.sync import BroadcastTransport, Receiver, Sender, TensorSource
    from hal.sync.lora import BaseWeightTracker, adapter_specs, adapter_tensors, base_tensors
    from hal.sync.receive import allocate, specs_from_safetensors
    from hal.sync.sink import copy_into

    level, free, lost_at = SCENARIOS[scenario]
    transport = BroadcastTransport(src=0)
    log = []
    if rank == 0:
        model = tiny_peft_model()
        tracker = BaseWeightTracker(has_adapter=True, sleep_level=level, free_cache_engine=free)
        sender = Sender(transport, config)
        for step in range(STEPS):
            report = [None]
            dist.broadcast_object_list(report, src=1)  # the engine says whether it lost its weights
            if report[0] == "freed":
                tracker.engine_lost_weights()
            train_adapter(model, step)
            decision = tracker.decide()
            pairs = (base_tensors(model) if decision.send_base else []) + adapter_tensors(model)
            metrics = sender.send(TensorSource(pairs), version=step)
            tracker.sent(decision)
            log.append(
                dict(
                    parts=decision.parts,
                    bytes=metrics.bytes,
                    adapter_bytes=sum(t.numel() * t.element_size() for _, t in adapter_tensors(model)),
                    base_bytes=sum(t.numel() * t.element_size() for _, t in base_tensors(model)),
                    expected={n: t.clone() for n, t in base_tensors(model) + adapter_tensors(model)},
                )
            )
        return log

    # rank 1: the engine, built from its checkpoint header and the LoRA config only
    base_specs = specs_from_safetensors(ckpt)
    specs = base_specs + adapter_specs(base_specs, r=R, target_modules=TARGETS)
    weights = allocate(specs, fill=float("nan"))
    receiver = Receiver(transport, specs, timeout_s=30.0)
    for step in range(STEPS):
        if step in lost_at or (level == 2 and free and step > 0):  # slept and discarded its weights
            for spec in base_specs:
                weights[spec.name].fill_(float("nan"))
        # It reports the loss only in `lost_at`: at level 2 with freeing the trainer knows from
        # the configuration alone that every sleep loses the base.
        dist.broadcast_object_list(["freed" if step in lost_at else "kept"], src=1)
        apply = copy_into(weights, record=True)
        metrics = receiver.receive(apply)
        log.append(
            dict(
                bytes=metrics.bytes,
                received=sorted(apply.received),
                version=receiver.version,
                state={n: t.clone() for n, t in weights.items()},
                backend=hal.current().name,
            )
        )
    return log


def _merged_scenario(rank: int, ckpt: str, config) -> list[dict]:
    from hal.sync import BroadcastTransport, Receiver, Sender
    from hal.sync.lora import BaseWeightTracker, MergedSource
    from hal.sync.receive import allocate, specs_from_safetensors
    from hal.sync.sink import copy_into

    transport = BroadcastTransport(src=0)
    out = []
    if rank == 0:
        model = tiny_peft_model()
        tracker = BaseWeightTracker(has_adapter=True, sleep_level=1, free_cache_engine=True, adapter_merged=True)
        sender = Sender(transport, config)
        for step in range(2):
            train_adapter(model, step)
            decision = tracker.decide()
            metrics = sender.send(MergedSource(model), version=step)
            tracker.sent(decision)
            reference = copy.deepcopy(model).merge_and_unload().state_dict()
            out.append(dict(parts=decision.parts, bytes=metrics.bytes, expected={n: t.clone() for n, t in reference.items()}))
        return out
    specs = specs_from_safetensors(ckpt)
    weights = allocate(specs, fill=float("nan"))
    receiver = Receiver(transport, specs, timeout_s=30.0)
    for _ in range(2):
        receiver.receive(copy_into(weights))
        out.append({n: t.clone() for n, t in weights.items()})
    return out


def lora_sync_worker(rank: int, world_size: int, ckpt: str, bucket_bytes: int):
    from hal.sync import SyncConfig

    config = SyncConfig(bucket_bytes=bucket_bytes, verify=True, timeout_s=30.0)
    results = {name: _adapter_scenario(rank, ckpt, name, config) for name in SCENARIOS}
    results["merged"] = _merged_scenario(rank, ckpt, config)
    return _portable(results)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from safetensors.torch import save_file

    from hal.sync.lora import base_tensors

    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    save_file({n: t.contiguous() for n, t in base_tensors(tiny_peft_model())}, str(path))
    return str(path)


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend_name", ["cpu", "sim"])
def test_multiprocess_lora_sync(checkpoint, backend_name):
    env = {"VERL_DEVICE": backend_name}
    if backend_name == "sim":
        env["VERL_HAL_SIM_LATENCY"] = "0.0002"
    # 4 KiB buckets: the embedding (8 KiB) is split across buckets, the adapter spans several.
    raw = run_group(lora_sync_worker, 2, args=(checkpoint, 4096), timeout=240, collective_timeout=60, env=env)
    trainer, engine = (_unportable(r) for r in raw)

    for scenario, (level, free, lost_at) in SCENARIOS.items():
        base_every_time = level == 2 and free
        for step, (sent, got) in enumerate(zip(trainer[scenario], engine[scenario])):
            where = f"{scenario}, step {step}"
            assert got["backend"] == backend_name
            base_due = step == 0 or step in lost_at or base_every_time
            assert sent["parts"] == (("base", "adapter") if base_due else ("adapter",)), where
            expected_bytes = sent["adapter_bytes"] + (sent["base_bytes"] if base_due else 0)
            assert sent["bytes"] == expected_bytes, f"{where}: sender metrics"
            assert got["bytes"] == expected_bytes, f"{where}: receiver metrics"
            if not base_due:
                assert got["received"] == sorted(n for n in sent["expected"] if ".lora_" in n), where
            assert got["version"] == step
            # after every sync the engine holds exactly the trainer's base and adapter, bit for bit
            assert got["state"].keys() == sent["expected"].keys()
            for name, t in sent["expected"].items():
                assert torch.equal(_bits(got["state"][name]), _bits(t)), f"{where}: {name}"
        if not base_every_time:  # the steady state really was adapter-only, and cheaper
            steady = trainer[scenario][1]
            assert steady["bytes"] == steady["adapter_bytes"] < trainer[scenario][0]["bytes"]

    for sent, state in zip(trainer["merged"], engine["merged"]):
        assert sent["parts"] == ("merged",)
        assert state.keys() == sent["expected"].keys()
        assert sent["bytes"] == sum(t.numel() * t.element_size() for t in sent["expected"].values())
        for name, t in sent["expected"].items():
            assert torch.equal(_bits(state[name]), _bits(t)), f"merged: {name}"
