"""The steady state is per kind of source (issue 39, item 4): a sender that synced one kind
of source from a module must not carry what it learned into a sync from another kind that
converts the same module's tensors (scales them, merges an adapter into them, renames them,
lays them out as Hugging Face's checkpoint does).

The case that failed: `ModuleSource(m)` at v1, then a `ModuleSource` subclass whose
`__iter__` yields `t * 2` at v2 and v3: the listing of v1 was handed back (the module tree
had not changed) with `as_yielded` still true, so the sender read the parameters straight
from it and the receiver got the undoubled weights, with no error.

Every scenario runs through a real `Sender`/`Receiver` pair (one spawn for all of them);
the module is changed in place before every sync (an optimizer step), so a stale read
shows as wrong bytes. The oracle for each sync is the source's own iteration.
"""

from __future__ import annotations

import pytest
import torch

from hal.sync.source import ModuleSource
from tests.multiproc import run_group

pytestmark = pytest.mark.multiprocess


class Doubling(ModuleSource):
    """A converting source: the module's names, twice its values."""

    def __iter__(self):
        for name, tensor in super().__iter__():
            yield name, tensor * 2


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 4, bias=False)
        self.experts = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(6)) for _ in range(4)])


def renamed(name: str) -> str | None:
    return None if name == "b.weight" else f"model.{name}"


def step(model: torch.nn.Module, version: int) -> None:
    """An optimizer step: new values in place, other ones every version."""
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def _sources(scenario: str):
    """The module and, per version, the source to send from it (made anew per sync, as a caller does)."""
    if scenario.startswith("peft"):
        from hal.sync.lora import MergedSource
        from hal.sync.lora import base_weight_name
        from tests.sync.lora.test_lora_sync import tiny_peft_model

        model = tiny_peft_model()
        kinds = {"plain": lambda: ModuleSource(model, rename=base_weight_name), "merged": lambda: MergedSource(model)}
    else:
        model = Net()
        rename = renamed  # one function: a rename made anew per sync would not be the same rename
        kinds = {"plain": lambda: ModuleSource(model), "doubling": lambda: Doubling(model), "renamed": lambda: ModuleSource(model, rename=rename)}
    return model, kinds


SCENARIOS = {
    "plain-then-doubling": ["plain", "doubling", "doubling"],
    "doubling-then-plain": ["doubling", "plain", "plain"],
    "alternating": ["plain", "doubling", "plain", "doubling", "doubling", "plain"],
    "renamed": ["plain", "renamed", "renamed", "plain", "doubling"],
    "peft-merged": ["plain", "merged", "merged", "plain", "merged"],
}


# A Megatron GPTModel's names and layouts, without megatron-core (hal.integrations.megatron
# reads only `decoder`, `config` and the named parameters when given the shape)
H, HEADS, GROUPS, HD, FFN, VOCAB = 16, 4, 2, 4, 12, 10
MEGATRON = {
    "embedding.word_embeddings.weight": (VOCAB, H),
    "decoder.layers.0.input_layernorm.weight": (H,),
    "decoder.layers.0.self_attention.linear_qkv.weight": (GROUPS * (HEADS // GROUPS + 2) * HD, H),
    "decoder.layers.0.self_attention.linear_proj.weight": (H, HEADS * HD),
    "decoder.layers.0.pre_mlp_layernorm.weight": (H,),
    "decoder.layers.0.mlp.linear_fc1.weight": (2 * FFN, H),
    "decoder.layers.0.mlp.linear_fc2.weight": (H, FFN),
    "decoder.final_layernorm.weight": (H,),
    "output_layer.weight": (VOCAB, H),
}


def fake_gpt() -> torch.nn.Module:
    model = torch.nn.Module()
    for name, shape in MEGATRON.items():
        *path, leaf = name.split(".")
        owner = model
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape)))
    model.config = object()
    return model


def megatron_shape():
    from hal.integrations.megatron.convert import MegatronShape

    return MegatronShape(
        hidden_size=H, num_attention_heads=HEADS, num_query_groups=GROUPS, head_dim=HD, ffn_hidden_size=FFN,
        vocab_size=VOCAB, hf_vocab_size=VOCAB, layers={0: 0},
    )


def _megatron_expected(model: torch.nn.Module, kind: str) -> dict[str, list]:
    from hal.integrations.megatron.convert import assemble, hf_state

    if kind == "plain":
        return _portable(model.named_parameters())
    return _portable(assemble([hf_state([(n, p.detach()) for n, p in model.named_parameters()], megatron_shape())]).items())


MEGATRON_KINDS = ["plain", "megatron", "megatron", "plain", "megatron"]


def _portable(pairs) -> dict[str, list]:
    return {name: t.detach().float().flatten().tolist() for name, t in pairs}


def kinds_worker(rank, world, scenarios):
    from hal.sync import BroadcastTransport, Receiver, Sender, SyncConfig

    transport = BroadcastTransport(None, src=0)
    config = SyncConfig(bucket_bytes=4096, timeout_s=60)
    out = {}
    for scenario in scenarios:
        kinds_seq = SCENARIOS[scenario]
        seen = []
        if rank == 0:
            model, kinds = _sources(scenario)
            sender = Sender(transport, config)
            for version, kind in enumerate(kinds_seq, start=1):
                step(model, version)
                source = kinds[kind]()
                sender.send(source, version=version)
                seen.append(_portable(source))  # what this source yields: the bytes it stands for
        else:
            receiver = Receiver(transport, None, timeout_s=60)
            for _ in kinds_seq:
                got = {}
                receiver.receive(lambda pairs: got.update(_portable(pairs)))
                seen.append(got)
        out[scenario] = seen
    out["megatron"] = _megatron_kinds(rank)
    return out


def _megatron_kinds(rank: int) -> list[dict[str, list]]:
    """The sharded sync (every trainer rank sends its own shares; one trainer rank here):
    the module's own names (`ModuleSource`), then Hugging Face's (`MegatronSource`)."""
    import torch.distributed as dist

    from hal.integrations.megatron import MegatronSource
    from hal.sync import BroadcastTransport, SyncConfig
    from hal.sync.receive import ShardedReceiver
    from hal.sync.send import ShardedSender

    trainer_group = dist.new_group([0])
    transport = BroadcastTransport(None, src=0)
    seen = []
    if rank == 0:
        model = fake_gpt()
        sender = ShardedSender(transport, config=SyncConfig(bucket_bytes=4096, timeout_s=60), trainer_group=trainer_group)
        for version, kind in enumerate(MEGATRON_KINDS, start=1):
            step(model, version)
            source = ModuleSource(model) if kind == "plain" else MegatronSource(model, shape=megatron_shape())
            sender.sync(source, version=version)
            seen.append(_megatron_expected(model, kind))
        return seen
    receiver = ShardedReceiver([transport], None, timeout_s=60)
    for _ in MEGATRON_KINDS:
        got = {}
        receiver.receive(lambda pairs: got.update(_portable(pairs)))
        seen.append(got)
    return seen


def test_a_listing_is_handed_back_only_to_a_source_of_its_own_kind():
    model = Net()
    plain = ModuleSource(model).listing(None)
    assert ModuleSource(model).listing(plain) is plain  # the steady state
    doubled = Doubling(model).listing(plain)
    assert doubled is not plain and not doubled.as_yielded  # the sender iterates it: the doubled bytes
    assert ModuleSource(model).listing(doubled) is not doubled


def test_the_senders_steady_state_is_keyed_by_the_class_and_the_adapters():
    """Issue 40 (item 5): a `ModuleSource` with another rename or adapter is another kind: the
    specs, listing and lists a sender kept are not recalled for it, even under the same names
    (a computing adapter may yield other bytes under the same names from the same tensors)."""
    from hal.sync.plan.steady import KnownSource

    model = Net()
    known = KnownSource()

    def recalled(source) -> bool:
        """Whether the sender recalls what it kept when `source`'s sync starts (as Sender does)."""
        known.begin(source)
        listing = source.listing(known.listing)
        metadata = known.recall(listing)
        if metadata is None:
            known.remember(listing, source.metadata())
        known.settle()
        return metadata is not None

    recalled(ModuleSource(model))
    assert recalled(ModuleSource(model))  # made anew, the same adapters: the steady state
    assert not recalled(ModuleSource(model, rename=lambda n: n))  # the same names and tensors, another rename
    assert not recalled(ModuleSource(model, rename=renamed))
    assert recalled(ModuleSource(model, rename=renamed))  # the same function: the same rename
    assert not recalled(ModuleSource(model, checkpoint=False))
    assert recalled(ModuleSource(model))  # not a transformers model: no checkpoint layout either way
    assert not recalled(Doubling(model))


@pytest.fixture(scope="module")
def outcomes():
    sent, received = run_group(kinds_worker, 2, args=(list(SCENARIOS),), timeout=240)
    return sent, received


@pytest.mark.parametrize("scenario", [*SCENARIOS, "megatron"])
def test_every_sync_sends_what_its_own_source_yields(outcomes, scenario):
    sent, received = outcomes
    kinds = MEGATRON_KINDS if scenario == "megatron" else SCENARIOS[scenario]
    for version, (kind, expected, got) in enumerate(zip(kinds, sent[scenario], received[scenario]), start=1):
        assert set(got) == set(expected), f"v{version} ({kind}): names"
        wrong = [name for name in expected if got[name] != expected[name]]
        assert wrong == [], f"v{version} ({kind}): the receiver got other bytes for {wrong}"
