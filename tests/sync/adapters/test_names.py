"""The adapters that only rename (hal.sync.adapters.names): wrapper components, a caller's
function, transformers 4's `_checkpoint_conversion_mapping` reversed (verl's lane checks
`KeyMapping` against verl's own `convert_weight_keys`: tests/verl/test_weight_keys.py)."""

from __future__ import annotations

import pytest
import torch

from hal.sync.adapters import KeyMapping, Rename, Unwrap, unwrapped_name
from hal.sync.source import ModuleSource


@pytest.mark.parametrize(
    "name, unwrapped",
    [
        ("layers.0._checkpoint_wrapped_module.mlp.weight", "layers.0.mlp.weight"),
        ("_orig_mod.layers.0._fsdp_wrapped_module.w", "layers.0.w"),
        ("layers.0.mlp.weight", "layers.0.mlp.weight"),
        ("layers.0._private.weight", "layers.0._private.weight"),  # a component of the model's own
    ],
)
def test_unwrap_drops_only_the_wrappers_components(name, unwrapped):
    assert unwrapped_name(name) == Unwrap().name(name) == unwrapped
    assert Unwrap() == Unwrap() and Unwrap().name_function() is unwrapped_name


def test_a_wrapped_module_is_sent_under_its_own_names():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    names = [n for n, _ in inner.named_parameters()]
    inner[0] = checkpoint_wrapper(inner[0])
    wrapped = torch.nn.Module()
    wrapped._orig_mod = inner  # as torch.compile's OptimizedModule holds it (compiling would start its workers)
    assert any("_orig_mod" in n for n, _ in wrapped.named_parameters())
    assert ModuleSource(wrapped).listing(None).names == [n for n, _ in ModuleSource(wrapped)] == names


def test_rename_is_the_callers_function_and_the_same_function_is_the_same_rename():
    def rename(name: str) -> str | None:
        return None if name.endswith("bias") else f"model.{name}"

    pairs = [("w", torch.zeros(1)), ("bias", torch.zeros(1))]
    assert [n for n, _ in Rename(rename).to_checkpoint(pairs)] == ["model.w"]
    assert Rename(rename) == Rename(rename) and Rename(rename) != Rename(lambda n: n)
    with pytest.raises(TypeError, match="Rename needs a function of one name, got a str"):
        Rename("model.")


# transformers 4's Qwen2-VL mapping (checkpoint pattern -> the module's name), as its
# `save_pretrained` and verl's `convert_weight_keys` reverse it
QWEN2_VL = {"^visual": "model.visual", r"^model(?!\.(language_model|visual))": "model.language_model"}


@pytest.mark.parametrize(
    "name, checkpoint",
    [
        ("model.language_model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("model.visual.blocks.0.attn.qkv.weight", "visual.blocks.0.attn.qkv.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ],
)
def test_key_mapping_reverses_a_checkpoint_conversion_mapping(name, checkpoint):
    assert KeyMapping(QWEN2_VL).name(name) == checkpoint


def test_key_mapping_of_a_model_without_a_mapping_is_none():
    model = torch.nn.Linear(2, 2)
    assert KeyMapping.of(model) is None
    model._checkpoint_conversion_mapping = QWEN2_VL
    assert KeyMapping.of(model) == KeyMapping(dict(QWEN2_VL)) != KeyMapping({"^a": "b"})
