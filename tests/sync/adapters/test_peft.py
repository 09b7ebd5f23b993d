"""A peft model's adapters (hal.sync.adapters.peft): its base under the engine's names, its
LoRA matrices under vLLM's, and the merge (a computing adapter: its layout reads no bytes,
its tensors are made at every read, with what peft decides at that read). The bytes of the
merge against `merge_and_unload` are tests/sync/lora/test_lora_sync.py's."""

from __future__ import annotations

import pytest
import torch

from hal.sync.adapters import Chain, PeftAdapter, PeftBase, PeftMerge, Unwrap, adapt
from hal.sync.lora import MergedSource, base_weight_name
from hal.sync.source import ModuleSource

pytest.importorskip("peft")

Q = "model.layers.0.self_attn.q_proj.weight"  # a LoRA'd weight
K = "model.layers.0.self_attn.k_proj.weight"  # a plain one


def model():
    from tests.sync.lora.test_lora_sync import tiny_peft_model

    return tiny_peft_model()


def counting(m) -> list[str]:
    """Counts every `get_delta_weight` call of the model's LoRA layers."""
    calls: list[str] = []
    for name, module in m.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            real = module.get_delta_weight
            module.get_delta_weight = lambda adapter, real=real, name=name: calls.append(name) or real(adapter)
    return calls


def test_base_and_adapter_names():
    m = model()
    base = PeftBase().to_checkpoint(m.named_parameters())
    assert [n for n, _ in base] == [n for n, _ in adapt(m.named_parameters(), Chain(PeftBase()))]
    assert Q in dict(base) and not any("lora_" in n or "base_layer" in n for n, _ in base)
    lora = [n for n, _ in PeftAdapter("default").to_checkpoint(m.named_parameters())]
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in lora and all("lora_" in n for n in lora)
    assert PeftAdapter("other").to_checkpoint(m.named_parameters()) == []
    assert PeftBase() == PeftBase() and PeftAdapter("a") != PeftAdapter("b")


def test_the_merge_computes_at_every_read_and_never_for_its_layout():
    m = model()
    calls = counting(m)
    merge = PeftMerge(m)
    assert not merge.views and merge == PeftMerge(m, "default") and merge != PeftMerge(model())
    laid_out = dict(adapt(m.named_parameters(), merge, layout=True))
    assert calls == [] and laid_out.keys() == dict(PeftBase().to_checkpoint(m.named_parameters())).keys()
    assert laid_out[Q].shape == (32, 32)
    merged = dict(merge.to_checkpoint(m.named_parameters()))
    assert len(calls) == 5  # q_proj and v_proj of both layers, and embed_tokens
    base = dict(m.named_parameters())
    assert not torch.equal(merged[Q], base["base_model.model." + Q.replace("q_proj.", "q_proj.base_layer.")])
    assert merged[K] is not None and torch.equal(merged[K], base["base_model.model." + K])
    with m.disable_adapter():  # peft decides at every forward; the merge at every read
        unmerged = dict(merge.to_checkpoint(m.named_parameters()))
    assert len(calls) == 5 and torch.equal(unmerged[Q], base["base_model.model." + Q.replace("q_proj.", "q_proj.base_layer.")])


def test_merged_source_is_the_merge_adapter_and_another_kind_than_the_base():
    m = model()
    calls = counting(m)
    source = MergedSource(m)
    assert source.adapter == PeftMerge(m)
    specs = source.metadata()
    assert calls == [] and [s.name for s in specs] == [n for n, _ in source]
    plain = ModuleSource(m, rename=base_weight_name)
    assert plain.adapter != source.adapter  # the sender's steady state keeps neither for the other


def test_the_merge_finds_its_layers_under_wrapped_names():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    m = model()
    expected = {n: t.clone() for n, t in MergedSource(m)}
    layers = m.base_model.model.model.layers
    layers[0] = checkpoint_wrapper(layers[0])
    got = dict(Chain(Unwrap(), PeftMerge(m)).to_checkpoint(m.named_parameters()))
    assert got.keys() == expected.keys()
    assert [n for n in expected if not torch.equal(got[n], expected[n])] == []


def test_a_module_source_through_the_merge_lists_stand_ins_and_yields_the_merge():
    m = model()
    calls = counting(m)
    source = ModuleSource(m, adapter=PeftMerge(m), buffers=False)
    listing = source.listing(None)
    assert calls == [] and not listing.as_yielded  # the sender iterates it: the merge is made at every sync
    assert listing.names == [s.name for s in MergedSource(m).metadata()] == [s.name for s in source.metadata()]
    expected = dict(MergedSource(m))
    got = dict(source)
    assert got.keys() == expected.keys() and [n for n in got if not torch.equal(got[n], expected[n])] == []
    assert source.listing(listing) is listing
    with pytest.raises(TypeError, match="ModuleSource: adapter must be a StateDictAdapter"):
        ModuleSource(m, adapter=base_weight_name)
