"""Engine-side specs from a checkpoint's safetensors headers, and the layer grouping the
vLLM engine uses to decide which received views must be copied. No vLLM needed."""

from __future__ import annotations

import pytest
import torch

from hal.integrations.vllm._specs import checkpoint_specs, layer_groups, order_like_model
from hal.sync import TensorSpec

pytestmark = pytest.mark.cpu

safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")


def test_checkpoint_specs_read_headers_and_cast_floats(tmp_path):
    tensors = {
        "model.layers.10.mlp.up_proj.weight": torch.zeros(4, 2, dtype=torch.bfloat16),
        "model.layers.2.mlp.up_proj.weight": torch.zeros(4, 2, dtype=torch.bfloat16),
        "model.embed_tokens.weight": torch.zeros(8, 2, dtype=torch.bfloat16),
        "model.norm.weight": torch.zeros(2, dtype=torch.bfloat16),
        "model.counter": torch.zeros(3, dtype=torch.int64),
    }
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    specs = checkpoint_specs(tmp_path, dtype=torch.float32)
    assert [s.name for s in specs] == [
        "model.embed_tokens.weight",
        "model.layers.2.mlp.up_proj.weight",
        "model.layers.10.mlp.up_proj.weight",
        "model.counter",
        "model.norm.weight",
    ]
    by_name = {s.name: s for s in specs}
    assert by_name["model.layers.2.mlp.up_proj.weight"] == TensorSpec("model.layers.2.mlp.up_proj.weight", (4, 2), torch.float32)
    assert by_name["model.counter"].dtype == torch.int64  # integers keep their dtype


def test_checkpoint_specs_name_the_directory_without_safetensors(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        checkpoint_specs(tmp_path)


def test_layer_groups_join_a_decoder_layer_and_keep_unindexed_modules_apart():
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    groups = layer_groups(names)
    assert groups["model.layers.0.mlp.up_proj.weight"] == {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    }
    assert groups["model.layers.1.mlp.up_proj.weight"] == {"model.layers.1.mlp.up_proj.weight"}
    assert groups["model.norm.weight"] == {"model.norm.weight"}
    assert groups["lm_head.weight"] == {"lm_head.weight"}


def test_order_like_model_sorts_layers_numerically():
    specs = [TensorSpec(f"model.layers.{i}.w", (1,), torch.float32) for i in (10, 2, 1)]
    assert [s.name for s in order_like_model(specs)] == ["model.layers.1.w", "model.layers.2.w", "model.layers.10.w"]
