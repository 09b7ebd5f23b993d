"""Each worker's needs of a vLLM engine that does not exist, recorded on paper (`hal plan`).

A `MetaEngine` builds vLLM's own model class for a model directory (its `config.json`
only: no weights, no tokenizer) on the meta device, as the worker at a pretended place of
a TP x DP engine would build it (hal.integrations.vllm.internals.meta), and records that
worker's needs with the engine's own recorder (`record_needs`, the same one a live worker
runs at init: vLLM's loaders, driven by geometric stand-ins). Nothing is allocated beyond
the model's buffers.

Layer templates keep it fast (a recording of every layer costs 3-7 s per worker of
Qwen3-235B-A22B's 36,945 tensors here; with templates its 8 workers take ~1.3 s, 128 ~12 s,
DeepSeek-V3's 64 ~11 s: docs/benchmarks.md, "At scale, on paper"): worker 0's whole model
is built once and its decoder layers grouped by *signature* (module classes, parameter and
buffer shapes and dtypes, the values of integer buffers such as expert maps); then each
worker builds only the first layers that hold one layer of every signature, records them,
and every other layer's needs are its template's, renamed (the checkpoint tensors and the
worker's tensors of layer t become those of layer i). Checked: worker 0's shortened model
has the same signatures as the first layers of its whole one, and every worker's shortened
model groups its layers as worker 0's does; a need that crosses layers is refused by name.
`templates=False` records every layer of every worker (the tests compare both).
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import typing
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from hal.integrations.vllm import internals
from hal.integrations.vllm.recording import record_needs
from hal.sync.plan.needs import Fill, Need, Target, WorkerNeeds
from hal.sync.spec import TensorSpec

LAYERS = "num_hidden_layers"  # the config's count of decoder layers (Hugging Face's name, which vLLM's classes read)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?=\.|$)")
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def layer_of(name: str) -> int | None:
    """The decoder layer a dotted name belongs to (`model.layers.3.mlp...` -> 3), or None."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def _renamed(name: str, layer: int) -> str:
    """`name` of one layer as the same name in layer `layer`."""
    match = _LAYER.search(name)
    return f"{name[: match.start(1)]}{layer}{name[match.end(1):]}"


def engine_checkpoint(folder: str, dtype: torch.dtype) -> list[TensorSpec] | None:
    """The checkpoint a live engine on `folder` reads (its safetensors headers, floating-point
    tensors in `dtype`, in the order its layerwise reload completes layers), or None when
    the folder has no safetensors files."""
    from hal.integrations.vllm._specs import checkpoint_specs

    return checkpoint_specs(folder, dtype) if any(pathlib.Path(folder).glob("*.safetensors")) else None


def in_engine_order(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """`specs` in the order a live engine reads a checkpoint (embeddings, layer by layer, the rest)."""
    from hal.integrations.vllm._specs import order_like_model

    return order_like_model(specs)


class WorkerPlace(typing.NamedTuple):
    """Where a worker sits in its engine: the engine's TP and DP sizes, its TP and DP ranks,
    and whether the engine splits its experts over its workers."""

    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    ep: bool


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """`engines` vLLM engines of `tp` x `dp` workers each (worker = engine x tp x dp + dp
    rank x tp + tp rank); `ep`: an engine's MoE layers split their experts over all its
    workers (vLLM's expert parallelism; without it vLLM splits each expert's rows over
    them). Engines are independent copies (as NeMo-RL runs its data parallelism): one
    engine's workers are recorded, the others' needs are theirs."""

    tp: int = 1
    dp: int = 1
    ep: bool = False
    engines: int = 1

    def __post_init__(self) -> None:
        if min(self.tp, self.dp, self.engines) < 1:
            raise ValueError(f"engine layout: tp={self.tp}, dp={self.dp}, engines={self.engines}; each must be at least 1")

    @property
    def per_engine(self) -> int:
        return self.tp * self.dp

    @property
    def workers(self) -> int:
        return self.engines * self.per_engine

    def place(self, worker: int) -> WorkerPlace:
        if not 0 <= worker < self.workers:
            raise ValueError(f"engine worker {worker} of {self.workers} workers")
        local = worker % self.per_engine
        return WorkerPlace(self.tp, self.dp, local % self.tp, local // self.tp, self.ep)

    def describe(self) -> str:
        parts = [f"TP{self.tp}"] + ([f"DP{self.dp}"] if self.dp > 1 else [])
        one = " x ".join(parts) + (f", EP{self.per_engine}" if self.ep else "")
        return one if self.engines == 1 else f"{self.engines} engines of {one}"


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter goes to the meta device as it is registered, keeping its class and
    its attributes (the same `__dict__`: a loader set on it after registration lands too).
    Buffers stay real: vLLM computes expert maps and rotary caches from data as it builds
    (building under `torch.device("meta")` fails on its `nonzero`)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: Any) -> None:
        if param is not None and not param.is_meta:
            meta = param.data.to("meta")
            meta.__class__ = param.__class__
            meta.__dict__ = param.__dict__
            param = meta
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _build(vllm_config: Any, layers: int | None = None) -> torch.nn.Module:
    """vLLM's model on meta at the pretended worker, of its first `layers` layers when given."""
    with parameters_on_meta():
        return internals.build_model(vllm_config, None if layers is None else {LAYERS: layers})


def _signatures(model: torch.nn.Module) -> dict[int, tuple]:
    """Per decoder layer of `model`, what makes two layers load alike."""
    out: dict[int, tuple] = {}
    for name, module in model.named_modules():
        index = layer_of(name)
        if index is None or _LAYER.search(name).end() != len(name):
            continue  # not a decoder layer itself
        modules = tuple((n, type(m).__qualname__) for n, m in module.named_modules())
        params = tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())
        buffers = tuple(
            (n, tuple(b.shape), b.dtype, tuple(b.flatten().tolist()) if not b.is_floating_point() and not b.is_meta else None)
            for n, b in module.named_buffers()
        )
        out[index] = (modules, params, buffers)
    return out


class MetaEngine:
    """vLLM's model for `model_dir` in `dtype` (its first `layers` decoder layers when
    given), at any worker of an engine of `layout`."""

    def __init__(self, model_dir: str, dtype: torch.dtype, layout: EngineLayout, *, templates: bool = True, layers: int | None = None) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"hal plan: dtype {dtype} is none of {', '.join(map(str, _DTYPES))}")
        self.layout, self.templates, self.dtype = layout, templates, dtype
        self.vllm_config = internals.meta_vllm_config(str(model_dir), _DTYPES[dtype], None if layers is None else {LAYERS: layers})
        self._template_of: dict[int, int] | None = None  # layer -> the first layer of its signature
        self._signatures: dict[int, tuple] = {}
        self._kept: tuple[tuple[TensorSpec, ...], int, tuple[TensorSpec, ...]] | None = None

    def needs(self, specs: Sequence[TensorSpec], worker: int) -> WorkerNeeds:
        """What `worker` needs of the checkpoint `specs` (wire dtypes, checkpoint order)."""
        specs = specs if isinstance(specs, tuple) else tuple(specs)
        place = self.layout.place(worker)
        if not self.templates:
            with internals.pretend_worker(self.vllm_config, *place):
                return record_needs(_build(self.vllm_config), specs, "cpu", worker=worker)
        template_of = self._layer_templates()
        prefix = max(template_of.values(), default=-1) + 1
        with internals.pretend_worker(self.vllm_config, *place):
            model = _build(self.vllm_config, prefix)
            signatures = _signatures(model)
            problem = self._prefix_problem(signatures, prefix, worker)
            if problem:
                raise ValueError(f"hal plan: layer templates of engine worker {worker}: {problem}; run it with --no-templates")
            record = record_needs(model, self._prefix_specs(specs, prefix), "cpu", worker=worker)
        return _expand(record, specs, template_of, prefix)

    def _prefix_specs(self, specs: tuple[TensorSpec, ...], prefix: int) -> tuple[TensorSpec, ...]:
        """The checkpoint tensors of the first `prefix` layers and of no layer (kept for the next worker)."""
        if self._kept is None or self._kept[0] is not specs or self._kept[1] != prefix:
            kept = tuple(s for s, i in zip(specs, map(layer_of, (s.name for s in specs))) if i is None or i < prefix)
            self._kept = (specs, prefix, kept)
        return self._kept[2]

    def all_needs(self, specs: Sequence[TensorSpec]) -> list[WorkerNeeds]:
        specs = tuple(specs)
        one = [self.needs(specs, w) for w in range(self.layout.per_engine)]
        return one + [WorkerNeeds(w, specs, r.targets, r.needs, r.fills)  # another engine's worker: the same needs
                      for w in range(len(one), self.layout.workers) for r in [one[w % len(one)]]]

    @property
    def template_of(self) -> dict[int, int]:
        """Each decoder layer's template (the first layer of its signature), worker 0's."""
        return dict(self._layer_templates())

    def _layer_templates(self) -> dict[int, int]:
        if self._template_of is None:
            with internals.pretend_worker(self.vllm_config, *self.layout.place(0)):
                self._signatures = _signatures(_build(self.vllm_config))
            first: dict[tuple, int] = {}
            self._template_of = {i: first.setdefault(sig, i) for i, sig in sorted(self._signatures.items())}
        return self._template_of

    def _prefix_problem(self, signatures: dict[int, tuple], prefix: int, worker: int) -> str | None:
        if sorted(signatures) != list(range(prefix)):
            return f"the model built with {prefix} layers has layers {sorted(signatures)}"
        template_of = self._template_of or {}
        for i in range(prefix):
            if worker == 0 and signatures[i] != self._signatures[i]:
                return f"layer {i} of the model built with {prefix} layers differs from layer {i} of the whole model"
            if signatures[i] != signatures[template_of[i]]:
                return f"layer {i} differs from layer {template_of[i]} here, though they are alike on worker 0"
        return None


def _expand(record: WorkerNeeds, specs: tuple[TensorSpec, ...], template_of: dict[int, int], prefix: int) -> WorkerNeeds:
    """The record of a model's first `prefix` layers (against the checkpoint tensors of
    those layers) as the record of the whole model (against `specs`): layer i's needs are
    those of its template, renamed; targets in the model's order, as a whole recording
    gives them."""
    index = {s.name: i for i, s in enumerate(specs)}
    layers = sorted(template_of)
    source = {i: (i if i < prefix else template_of[i]) for i in layers}
    copies: dict[int, list[int]] = {}
    for i in layers:
        copies.setdefault(source[i], []).append(i)

    # targets: those before the first layer's, each layer's (its source's, renamed), those after
    by_layer: dict[int, list[int]] = {}
    before: list[int] = []
    after: list[int] = []
    for k, target in enumerate(record.targets):
        j = layer_of(target.layer)
        if j is not None:
            by_layer.setdefault(j, []).append(k)
        else:
            (after if by_layer else before).append(k)
    targets: list[Target] = []
    new_index: dict[tuple[int, int], int] = {}  # (old target, layer it is copied to; -1: itself) -> new index

    def put(k: int, layer: int) -> None:
        target = record.targets[k]
        name = target.layer if layer < 0 else _renamed(target.layer, layer)
        new_index[(k, layer)] = len(targets)
        targets.append(Target(name, target.name, target.shape, target.padding))

    for k in before:
        put(k, -1)
    for i in layers:
        for k in by_layer.get(source[i], ()):
            put(k, i)
    for k in after:
        put(k, -1)

    needs: list[Need] = []
    for need in record.needs:
        name = record.specs[need.tensor].name
        j = layer_of(record.targets[need.target].layer)
        for layer in (copies.get(j, ()) if j is not None else (-1,)):
            tensor_name = name
            if layer >= 0 and layer_of(name) is not None:
                if layer_of(name) != j:
                    raise ValueError(f"hal plan: layer {j}'s parameter {record.targets[need.target].describe()!r} loads checkpoint tensor "
                                     f"{name!r} of another layer; layer templates cannot rename it: run it with --no-templates")
                tensor_name = _renamed(name, layer)
            if tensor_name not in index:
                raise ValueError(f"hal plan: the checkpoint has no tensor {tensor_name!r}, which layer {layer}'s template (layer {j}) loads")
            needs.append(Need(index[tensor_name], need.offsets, need.sizes, new_index[(need.target, layer)], need.dst_offset, need.dst_strides))
    needs.sort(key=lambda n: (n.tensor, n.target, n.dst_offset))
    fills: list[Fill] = []
    for fill in record.fills:
        j = layer_of(record.targets[fill.target].layer)
        for layer in (copies.get(j, ()) if j is not None else (-1,)):
            fills.append(Fill(new_index[(fill.target, layer)], fill.offset, fill.shape, fill.stride, fill.value))
    return WorkerNeeds(record.worker, specs, tuple(targets), tuple(needs), tuple(fills))


__all__ = ["EngineLayout", "MetaEngine", "WorkerPlace", "engine_checkpoint", "in_engine_order", "layer_of", "parameters_on_meta"]
