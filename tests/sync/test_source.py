"""`ModuleSource` sends what the module's `state_dict()` holds: its parameters and its
persistent buffers, each tensor once. A buffer training changes (a MoE router's
`e_score_correction_bias` in DeepSeek-V3's layout, updated by aux-loss-free balancing)
must reach the engine like a weight; a non-persistent one (rotary `inv_freq`) is the
module's own cache and stays. The steady state (hal.sync.plan.steady) must notice a buffer
replaced, added, removed or made non-persistent, as it does a parameter."""

from __future__ import annotations

import pytest
import torch

from hal.sync import BroadcastTransport, Receiver, Sender, SyncConfig, copy_into
from hal.sync.source import ModuleSource
from tests.multiproc import run_group


class Router(torch.nn.Module):
    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(experts, 8))
        self.register_buffer("e_score_correction_bias", torch.zeros(experts))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.router = Router()
        self.lm_head = torch.nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.embed.weight  # tied: one tensor, sent once
        self.register_buffer("inv_freq", torch.ones(4), persistent=False)


def names(source: ModuleSource) -> list[str]:
    return source.listing(None).names


def test_persistent_buffers_travel_and_non_persistent_ones_stay():
    model = Model()
    source = ModuleSource(model)
    assert names(source) == ["embed.weight", "router.weight", "router.e_score_correction_bias"]
    assert [spec.name for spec in source.metadata()] == names(source)
    assert [name for name, _ in source] == names(source)
    assert [name for name, _ in source.local_tensors()] == names(source)
    assert set(names(source)) == set(model.state_dict()) - {"lm_head.weight"}  # state_dict names the tied one twice


def test_buffers_false_sends_parameters_only_and_rename_applies_to_buffers():
    model = Model()
    assert names(ModuleSource(model, buffers=False)) == ["embed.weight", "router.weight"]
    renamed = ModuleSource(model, rename=lambda n: None if n.startswith("embed") else f"model.{n}")
    assert names(renamed) == ["model.router.weight", "model.router.e_score_correction_bias"]
    with pytest.raises(TypeError, match="buffers must be a bool"):
        ModuleSource(model, buffers="yes")


def test_a_buffer_shared_by_two_modules_is_listed_once():
    model = Model()
    model.other = Router()
    model.other.e_score_correction_bias = model.router.e_score_correction_bias  # the same tensor
    listed = names(ModuleSource(model))
    assert listed.count("router.e_score_correction_bias") + listed.count("other.e_score_correction_bias") == 1


@pytest.mark.parametrize(
    "change,listed",
    [
        ("replace", None),  # register_buffer with another tensor under the same name
        ("add", "extra_bias"),
        ("remove", None),
        ("make non-persistent", None),
    ],
)
def test_the_listing_notices_a_buffer_change(change, listed):
    model = Model()
    source = ModuleSource(model)
    first = source.listing(None)
    with torch.no_grad():
        model.router.e_score_correction_bias.add_(1.0)  # in place: the same listing
    assert source.listing(first) is first
    bias = model.router.e_score_correction_bias
    if change == "replace":
        model.router.register_buffer("e_score_correction_bias", torch.ones(4))
    elif change == "add":
        model.register_buffer("extra_bias", torch.ones(2))
    elif change == "remove":
        del model.router.e_score_correction_bias
    else:
        model.router.register_buffer("e_score_correction_bias", bias, persistent=False)
    second = source.listing(first)
    assert second is not first
    assert second.names == names(ModuleSource(model))
    if listed:
        assert listed in second.names
    if change == "replace":
        assert second.tensors[second.names.index("router.e_score_correction_bias")] is model.router.e_score_correction_bias
    if change in ("remove", "make non-persistent"):
        assert "router.e_score_correction_bias" not in second.names


def test_a_parameters_only_listing_does_not_watch_buffers():
    model = Model()
    source = ModuleSource(model, buffers=False)
    first = source.listing(None)
    model.router.register_buffer("e_score_correction_bias", torch.ones(4))
    assert source.listing(first) is first
    assert ModuleSource(model).listing(first) is not first  # another source's setting: listed anew


def bias_at(version: int) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32) + version


def buffer_sync_worker(rank, world):
    transport = BroadcastTransport(None, src=0)
    seen = []
    if rank == 0:
        model = Model()
        source, sender = ModuleSource(model), Sender(transport, SyncConfig(bucket_bytes=4096))
        for version in (1, 2, 3, 4):
            with torch.no_grad():
                if version == 3:  # the buffer replaced by another tensor (as `module.bias = new` does)
                    model.router.e_score_correction_bias = bias_at(version)
                else:  # updated in place, as a balancing step does
                    model.router.e_score_correction_bias.copy_(bias_at(version))
                model.router.weight.fill_(float(version))
            sender.send(source, version=version)
        return seen
    dests = {name: torch.zeros_like(t) for name, t in ModuleSource(Model()).local_tensors()}
    receiver = Receiver(transport, None, timeout_s=60)
    for version in (1, 2, 3, 4):
        receiver.receive(copy_into(dests))
        seen.append((dests["router.e_score_correction_bias"].tolist(), dests["router.weight"].unique().tolist()))
    return seen


@pytest.mark.multiprocess
def test_a_router_bias_buffer_reaches_the_receiver_every_sync():
    _, seen = run_group(buffer_sync_worker, world_size=2, timeout=120)
    assert seen == [(bias_at(v).tolist(), [float(v)]) for v in (1, 2, 3, 4)]


def test_deepseek_v3s_router_bias_is_sent_as_its_state_dict_holds_it():
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2, first_k_dense_replace=1,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        vocab_size=64,
    )
    model = transformers.DeepseekV3ForCausalLM(config)
    listed = names(ModuleSource(model, checkpoint=False))
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in listed
    assert not any("inv_freq" in name for name in listed)
    assert set(listed) == set(model.state_dict())
    # as the checkpoint holds them (one tensor per expert), the buffer among them
    from transformers.core_model_loading import revert_weight_conversion

    listed = names(ModuleSource(model))
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in listed
    assert set(listed) == set(revert_weight_conversion(model, model.state_dict()))


def sharded_buffer_worker(rank, world):
    """Trainer ranks 0 and 1 hold FSDP2 shards of a model with a persistent buffer; each sends
    its own share (hal.sync.send.sharded) to receiver rank 2, twice, the buffer changed between."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from hal.sync.receive import ShardedReceiver
    from hal.sync.send import ShardedSender
    from hal.sync.spec import TensorSpec

    timeout = datetime.timedelta(seconds=60)
    trainer_group = dist.new_group([0, 1], timeout=timeout)
    sync_groups = [dist.new_group([0, 2], timeout=timeout), dist.new_group([1, 2], timeout=timeout)]
    config = SyncConfig(bucket_bytes=4096, timeout_s=60)
    if rank in (0, 1):
        torch.manual_seed(0)
        model = Model()
        mesh = DeviceMesh.from_group(trainer_group, "cpu")
        fully_shard(model.router, mesh=mesh)
        fully_shard(model, mesh=mesh)
        source = ModuleSource(model)
        sender = ShardedSender(BroadcastTransport(sync_groups[rank], src=0), config=config, trainer_group=trainer_group)
        sent = []
        for version in (1, 2):
            with torch.no_grad():
                model.router.e_score_correction_bias.copy_(bias_at(version))  # the same on every rank, as a balancing step makes it
            metrics = sender.sync(source, version=version)
            sent.append((metrics.bytes, metrics.model_bytes))
        return sent
    torch.manual_seed(0)
    local = dict(ModuleSource(Model()).local_tensors())
    specs = [TensorSpec.of(name, t) for name, t in local.items()]
    dests = {name: torch.zeros_like(t) for name, t in local.items()}
    receiver = ShardedReceiver([BroadcastTransport(g, src=0) for g in sync_groups], specs, timeout_s=60)
    seen = []
    for _ in (1, 2):
        receiver.receive(copy_into(dests))
        seen.append((dests["router.e_score_correction_bias"].tolist(), torch.equal(dests["router.weight"], local["router.weight"])))
    return seen


@pytest.mark.multiprocess
def test_every_trainer_rank_sends_the_buffer_once_between_them():
    first, second, seen = run_group(sharded_buffer_worker, world_size=3, timeout=180, collective_timeout=60)
    assert seen == [(bias_at(v).tolist(), True) for v in (1, 2)]
    model_bytes = sum(t.numel() * t.element_size() for _, t in ModuleSource(Model()).local_tensors())
    for (a, total_a), (b, total_b) in zip(first, second):
        assert total_a == total_b == model_bytes and a + b == model_bytes  # nothing sent twice: the buffer split between its holders


def test_names_leave_out_the_wrappers_torch_inserts():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = Model()
    model.router = checkpoint_wrapper(model.router)  # activation checkpointing, as torchtitan-style trainers apply it
    assert "router._checkpoint_wrapped_module.weight" in dict(model.named_parameters())
    expected = ["embed.weight", "router.weight", "router.e_score_correction_bias"]
    assert names(ModuleSource(model)) == expected
    assert set(expected) == set(model.state_dict()) - {"lm_head.weight"}  # what its state_dict calls them
    compiled = torch.compile(model)  # an OptimizedModule (compiled lazily, at its first call)
    assert names(ModuleSource(compiled)) == expected
    assert [n for n, _ in ModuleSource(compiled, rename=lambda n: f"model.{n}")][:1] == ["model.embed.weight"]  # rename sees the plain name
