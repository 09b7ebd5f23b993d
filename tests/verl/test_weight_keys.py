"""verl's weight keys are hal's `KeyMapping` adapter (hal.sync.adapters.names): what verl's
`convert_weight_keys` makes of a state dict (transformers 4's `_checkpoint_conversion_mapping`
reversed) is what the adapter makes of it, and a sharded verl sync (`fsdp_shards`) sends
under the names verl's own weight generator would."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.cpu]

pytest.importorskip("verl", reason="needs verl 0.9.1: make setup-verl, then run the verl lane (ci/verl.sh)")

# transformers 4's mappings (checkpoint pattern -> the module's name) of Qwen2-VL and Llava
MAPPINGS = {
    "qwen2_vl": {"^visual": "model.visual", r"^model(?!\.(language_model|visual))": "model.language_model"},
    "llava": {
        "^language_model.model": "model.language_model",
        "^vision_tower": "model.vision_tower",
        "^multi_modal_projector": "model.multi_modal_projector",
        "^language_model.lm_head": "lm_head",
    },
}
KEYS = [
    "model.language_model.layers.0.self_attn.q_proj.weight", "model.language_model.embed_tokens.weight", "model.visual.blocks.0.attn.qkv.weight",
    "model.vision_tower.encoder.layers.0.mlp.fc1.weight", "model.multi_modal_projector.linear_1.weight", "lm_head.weight", "model.norm.weight",
]


def with_mapping(mapping: dict[str, str] | None) -> torch.nn.Module:
    model = torch.nn.Module()
    if mapping is not None:
        model._checkpoint_conversion_mapping = mapping
    return model


@pytest.mark.parametrize("family", [*MAPPINGS, None])
def test_key_mapping_names_what_verls_convert_weight_keys_names(family):
    from verl.utils.model import convert_weight_keys

    from hal.sync.adapters import KeyMapping, adapt

    model = with_mapping(MAPPINGS.get(family))
    state = {key: torch.zeros(1) for key in KEYS}
    theirs = list(convert_weight_keys(dict(state), model))
    ours = [name for name, _ in adapt(state.items(), KeyMapping.of(model))]
    assert ours == theirs
    assert (theirs != KEYS) == (family is not None)  # each mapping renames something


def test_fsdp_shards_are_the_state_dict_under_verls_names():
    from types import SimpleNamespace

    from verl.utils.model import convert_weight_keys

    from hal.integrations.verl import internals

    module = torch.nn.Module()
    module.model = torch.nn.Module()
    module.model.language_model = torch.nn.Linear(2, 2)
    module.lm_head = torch.nn.Linear(2, 3, bias=False)
    module._checkpoint_conversion_mapping = MAPPINGS["qwen2_vl"]
    shards = internals.fsdp_shards(SimpleNamespace(module=module))
    expected = convert_weight_keys(module.state_dict(), module)
    assert [n for n, _ in shards] == list(expected) == ["model.weight", "model.bias", "lm_head.weight"]
    assert all(t.data_ptr() == expected[n].data_ptr() for n, t in shards)  # the tensors themselves, no copy
