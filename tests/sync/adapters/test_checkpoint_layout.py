"""transformers-5 MoE models sync as their checkpoints hold them (issue 39, item 3;
hal.sync.adapters.checkpoint_layout): `ModuleSource` sends the names, shapes and bytes that
`save_pretrained` writes (one tensor per expert, Mixtral's `block_sparse_moe` names), as
views of the 3-D expert parameters, never a copy of them; from transformers' own
conversion mapping, so a mapping registered for a model is followed too. A dense model
pays nothing for it; a conversion hal cannot send as views is refused by parameter name."""

from __future__ import annotations

import hashlib

import pytest
import torch

from hal.sync.adapters import checkpoint_layout
from hal.sync.source import ModuleSource
from tests.multiproc import run_group
from tests.sync.tiny_moe import FAMILIES, redraw, tiny_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.core_model_loading")  # transformers 5


def saved(model: torch.nn.Module, tmp_path) -> dict[str, torch.Tensor]:
    """What `save_pretrained` writes (every shard's safetensors)."""
    from safetensors.torch import load_file

    model.save_pretrained(tmp_path)
    out: dict[str, torch.Tensor] = {}
    for path in sorted(tmp_path.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_source_sends_what_save_pretrained_writes_bit_for_bit(family, tmp_path):
    model = tiny_model(family)
    source = ModuleSource(model)
    checkpoint = saved(model, tmp_path)
    specs = {s.name: s for s in source.metadata()}
    assert {n: s.shape for n, s in specs.items()} == {n: tuple(t.shape) for n, t in checkpoint.items()}
    assert all(specs[n].dtype == t.dtype for n, t in checkpoint.items())
    listing = source.listing(None)
    assert listing.names == [s.name for s in source.metadata()] and listing.as_yielded
    yielded = list(source)
    assert [n for n, _ in yielded] == listing.names
    wrong = [n for n, t in yielded if not same_bits(t, checkpoint[n])]
    assert wrong == []
    assert [n for n, _ in source.local_tensors()] == listing.names
    # loaded back: transformers keeps the conversions it loaded with (`_weight_conversions`), reversed the same way
    loaded = type(model).from_pretrained(tmp_path)
    assert [s.name for s in ModuleSource(loaded).metadata()] == listing.names
    assert [n for n, t in ModuleSource(loaded) if not same_bits(t, checkpoint[n])] == []


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_experts_are_views_of_the_3d_parameters(family):
    model = tiny_model(family)
    experts = {n: p for n, p in model.named_parameters() if ".experts." in n}
    assert experts and all(p.dim() == 3 for p in experts.values())
    storages = {p.untyped_storage().data_ptr() for p in experts.values()}
    source = ModuleSource(model)
    listing = source.listing(None)
    per_expert = [(n, t) for n, t in zip(listing.names, listing.tensors) if ".experts." in n]
    assert len(per_expert) == sum(p.shape[0] * (2 if n.endswith("gate_up_proj") else 1) for n, p in experts.items())
    assert all(t.untyped_storage().data_ptr() in storages and not t.requires_grad for _, t in per_expert)
    assert all(t.untyped_storage().data_ptr() in storages for n, t in source if ".experts." in n)
    # each expert's gate and up rows lie back to back in the parameter, and are listed so
    first = [n for n, _ in per_expert[:4]]
    stem = "block_sparse_moe.experts" if family == "mixtral" else "mlp.experts"
    w1, w3 = ("w1", "w3") if family == "mixtral" else ("gate_proj", "up_proj")
    assert first == [f"model.layers.0.{stem}.{e}.{w}.weight" for e in (0, 1) for w in (w1, w3)]


def test_a_dense_model_has_no_layout_and_keeps_its_listing():
    model = tiny_model("llama")
    assert checkpoint_layout(model) is None
    listing = ModuleSource(model).listing(None)
    assert listing.names == list(model.state_dict()) and listing.as_yielded
    assert ModuleSource(model).listing(listing) is listing


def test_the_listing_is_kept_until_an_expert_parameter_moves_or_is_replaced():
    model = tiny_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    listing = ModuleSource(model).listing(None)
    assert ModuleSource(model).listing(listing) is listing  # the steady state: no view made again
    with torch.no_grad():
        experts.gate_up_proj.add_(1.0)  # an optimizer step: in place, the views see it
    assert ModuleSource(model).listing(listing) is listing
    experts.gate_up_proj.data = experts.gate_up_proj.data.clone()  # the same object, other memory
    moved = ModuleSource(model).listing(listing)
    assert moved is not listing
    at = moved.names.index("model.layers.0.mlp.experts.2.up_proj.weight")
    assert moved.tensors[at].data_ptr() != listing.tensors[at].data_ptr()
    assert torch.equal(moved.tensors[at], experts.gate_up_proj[2, 32:])
    experts.down_proj = torch.nn.Parameter(experts.down_proj.detach().clone())  # another object
    assert ModuleSource(model).listing(moved) is not moved


def test_fewer_experts_are_listed_under_their_own_names():
    model = tiny_model("qwen3_moe")
    source = ModuleSource(model)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in source.listing(None).names
    experts = model.model.layers[0].mlp.experts
    experts.gate_up_proj.data = experts.gate_up_proj.data[:2].clone()  # the same object, other shape
    experts.down_proj.data = experts.down_proj.data[:2].clone()
    names = source.listing(None).names
    assert "model.layers.0.mlp.experts.1.down_proj.weight" in names and "model.layers.0.mlp.experts.2.down_proj.weight" not in names
    assert [s.name for s in source.metadata()] == names == [n for n, _ in source]


def test_checkpoint_false_sends_the_modules_own_names():
    model = tiny_model("mixtral")
    listing = ModuleSource(model, checkpoint=False).listing(None)
    assert listing.names == list(model.state_dict())
    assert ModuleSource(model).listing(listing) is not listing  # another layout: listed again
    with pytest.raises(TypeError, match="checkpoint must be a bool"):
        ModuleSource(model, checkpoint="yes")


def test_rename_is_given_the_checkpoints_names():
    model = tiny_model("mixtral")
    seen = []
    ModuleSource(model, rename=lambda n: seen.append(n) or n).metadata()
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in seen and not any("gate_up_proj" in n for n in seen)


def test_unwrap_then_the_experts_then_a_rename_compose(tmp_path):
    """The chain `ModuleSource` applies (`Unwrap`, the checkpoint layout, `Rename`), each given
    the names the one before made: a checkpoint-wrapped MoE layer sends the checkpoint's
    per-expert tensors, views of the 3-D parameters, under the renamed checkpoint names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from hal.sync.adapters import Chain, Rename, Unwrap

    model = tiny_model("qwen3_moe")
    checkpoint = saved(model, tmp_path)
    model.model.layers[1] = checkpoint_wrapper(model.model.layers[1])
    assert any("_checkpoint_wrapped_module.mlp.experts.gate_up_proj" in n for n, _ in model.named_parameters())

    def engine(name: str) -> str | None:
        return None if name == "lm_head.weight" else f"engine.{name}"

    source = ModuleSource(model, rename=engine)
    assert source.adapter == Chain(Unwrap(), checkpoint_layout(model), Rename(engine))
    expected = {f"engine.{n}": t for n, t in checkpoint.items() if n != "lm_head.weight"}
    listing = source.listing(None)
    assert sorted(listing.names) == sorted(expected) and listing.as_yielded
    assert [n for n, t in source if not same_bits(t, expected[n])] == []
    gate_up = model.model.layers[1]._checkpoint_wrapped_module.mlp.experts.gate_up_proj
    view = listing.tensors[listing.names.index("engine.model.layers.1.mlp.experts.3.up_proj.weight")]
    assert view.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()
    assert ModuleSource(model, rename=engine).listing(listing) is listing  # the same chain: the steady state
    assert ModuleSource(model).listing(listing) is not listing  # another chain: listed again
    by_hand = source.adapter.to_checkpoint(model.named_parameters())
    assert [n for n, _ in by_hand] == [s.name for s in source.metadata()]


# ---- a conversion registered for a model: followed, or refused by name -----------------------

_registered: set[str] = set()


def registered(model_type: str, mapping: list) -> torch.nn.Module:
    """A tiny Qwen3-MoE whose `model_type` has `mapping` as transformers' conversion mapping."""
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping

    model = tiny_model("qwen3_moe")
    model.config.model_type = model_type
    register_checkpoint_conversion_mapping(model_type, mapping, overwrite=model_type in _registered)
    _registered.add(model_type)
    return model


def transposed_down(model_type: str = "hal_test_transposed_down") -> torch.nn.Module:
    """Its checkpoint holds each expert's `down_proj` transposed, (I, H): the module's (E, H, I)
    parameter is sent as non-contiguous views."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose, WeightConverter

    return registered(model_type, [
        WeightConverter(["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"], "mlp.experts.gate_up_proj",
                        operations=[MergeModulelist(dim=0), Concatenate(dim=1)]),
        WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", operations=[MergeModulelist(dim=0), Transpose(1, 2)]),
    ])


def test_a_registered_mapping_with_a_transpose_is_sent_as_non_contiguous_views(tmp_path):
    model = transposed_down()
    checkpoint = saved(model, tmp_path)
    source = ModuleSource(model)
    yielded = dict(source)
    down = yielded["model.layers.1.mlp.experts.3.down_proj.weight"]
    assert down.shape == (32, 64) and not down.is_contiguous()
    assert down.untyped_storage().data_ptr() == model.model.layers[1].mlp.experts.down_proj.untyped_storage().data_ptr()
    assert set(yielded) == set(checkpoint)
    assert [n for n, t in yielded.items() if not same_bits(t, checkpoint[n])] == []


def test_a_conversion_transformers_cannot_reverse_is_refused_by_parameter():
    from transformers.core_model_loading import ConversionOps, WeightConverter

    class OneWay(ConversionOps):  # no reverse_op: transformers itself cannot save such a model
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            return input_dict

    model = registered("hal_test_one_way", [WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", operations=[OneWay()])])
    with pytest.raises(ValueError, match=r"parameter 'model\.layers\.0\.mlp\.experts\.down_proj': transformers cannot reverse") as err:
        ModuleSource(model).metadata()
    assert "revert_weight_conversion" in str(err.value) and "checkpoint=False" in str(err.value)
    assert len(ModuleSource(model, checkpoint=False).metadata()) == len(model.state_dict())


def test_a_conversion_that_makes_new_tensors_is_refused_by_parameter():
    from transformers.core_model_loading import Chunk, WeightConverter

    # the checkpoint fuses q, k and v: saving concatenates the module's three (a copy)
    model = registered("hal_test_fused_qkv", [
        WeightConverter("self_attn.qkv_proj.weight", ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
                        operations=[Chunk(dim=0)]),
    ])
    with pytest.raises(ValueError, match=r"parameter 'model\.layers\.0\.self_attn\.[qkv]_proj\.weight'.*Concatenate.*makes new tensors"):
        ModuleSource(model).listing(None)


# ---- through a real sender and receiver ---------------------------------------------------


def _digests(pairs) -> dict[str, str]:
    return {n: hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in pairs}


MODELS = ("qwen3_moe", "qwen2_moe", "mixtral", "transposed")


def moe_sync_worker(rank, world):
    """Rank 0 sends each model three times (an optimizer step between; at v2 one expert
    parameter's memory replaced), then an FSDP2-sharded Qwen3-MoE twice; rank 1 receives.
    The sender returns what `revert_weight_conversion` makes of the model each time."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from transformers.core_model_loading import revert_weight_conversion

    from hal.sync import BroadcastTransport, Receiver, Sender, SyncConfig

    transport = BroadcastTransport(None, src=0)
    config = SyncConfig(bucket_bytes=16384, timeout_s=60)
    trainer_group = dist.new_group([0])
    out: dict[str, list] = {}
    sent = 0  # the receiver's version only goes up
    if rank == 0:
        for family in MODELS:
            model = transposed_down() if family == "transposed" else tiny_model(family)
            sender = Sender(transport, config)
            seen = []
            for version in (1, 2, 3):
                redraw(model, version)
                if version == 2:
                    experts = model.model.layers[1].mlp.experts
                    experts.gate_up_proj.data = experts.gate_up_proj.data.clone()
                sent += 1
                sender.send(ModuleSource(model), version=sent)
                seen.append((_digests(revert_weight_conversion(model, model.state_dict()).items()), sender.known.readable))
            out[family] = seen
        model = tiny_model("qwen3_moe", seed=5)
        expected = _digests(revert_weight_conversion(model, model.state_dict()).items())
        mesh = DeviceMesh.from_group(trainer_group, "cpu")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sender = Sender(transport, config)
        seen = []
        for _ in (1, 2):
            sent += 1
            sender.send(ModuleSource(model), version=sent)
            seen.append((expected, sender.known.readable))
        # every-rank senders read each rank's own experts without a gather: here one rank's, all of them
        local = ModuleSource(model).local_tensors()  # the experts plain views, the rest DTensors of one rank
        seen.append(_digests((n, t.to_local() if hasattr(t, "to_local") else t) for n, t in local))
        out["fsdp2"] = seen
        return out
    receiver = Receiver(transport, None, timeout_s=60)
    for family in (*MODELS, "fsdp2"):
        seen = []
        for _ in range(2 if family == "fsdp2" else 3):
            got = {}
            receiver.receive(lambda pairs: got.update(_digests(pairs)))
            seen.append(got)
        out[family] = seen
    return out


@pytest.mark.multiprocess
def test_moe_models_reach_the_receiver_as_their_checkpoints_hold_them():
    sent, received = run_group(moe_sync_worker, 2, timeout=240)
    for family in (*MODELS, "fsdp2"):
        versions = sent[family][:2] if family == "fsdp2" else sent[family]
        for version, ((expected, readable), got) in enumerate(zip(versions, received[family]), start=1):
            assert set(got) == set(expected), (family, version)
            assert [n for n in expected if got[n] != expected[n]] == [], (family, version)
            # read from the listing's views (no iteration), except a DTensor's: gathered every sync
            assert readable == (family != "fsdp2"), (family, version)
    assert sent["fsdp2"][2] == sent["fsdp2"][0][0]  # the local tensors of a one-rank mesh: the checkpoint's, bit for bit
