"""What the link tests share: a tiny checkpoint, the needs of a tensor-parallel engine of it
(as vLLM's loaders record them: fused q/k/v and gate/up rows, column pieces of o_proj and
down_proj, replicated norms, a vocabulary padded to 64 whose last rows a loader zeroes),
the trainer ranks' tensors, and a fake engine (`FakeLayers`) whose layers are plain
tensors, staged on open and made its own on close, so that a test sees old or new per
layer."""

from __future__ import annotations

import os

import torch

from hal.sync.plan.mxn import MxNPlan, build_mxn_plan
from hal.sync.plan.needs import Fill, Need, Target, WorkerNeeds, coverage_problems
from hal.sync.plan.shards import SHARD0, WHOLE, Declared, ShardPlan, build_shard_plan, chunk_rows
from hal.sync.spec import TensorSpec

F32 = torch.float32
HIDDEN, HEAD, HEADS, KV, FFN = 8, 2, 4, 2, 8
OLD = -1.0  # every element of the engine's weights before the first sync


def checkpoint(vocab: int = 100, layers: int = 2) -> tuple[TensorSpec, ...]:
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, HIDDEN), F32)]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [TensorSpec(p + n, s, F32) for n, s in (
            ("input_layernorm.weight", (HIDDEN,)), ("self_attn.q_proj.weight", (HEADS * HEAD, HIDDEN)),
            ("self_attn.k_proj.weight", (KV * HEAD, HIDDEN)), ("self_attn.v_proj.weight", (KV * HEAD, HIDDEN)),
            ("self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD)), ("post_attention_layernorm.weight", (HIDDEN,)),
            ("mlp.gate_proj.weight", (FFN, HIDDEN)), ("mlp.up_proj.weight", (FFN, HIDDEN)), ("mlp.down_proj.weight", (HIDDEN, FFN)))]
    specs += [TensorSpec("model.norm.weight", (HIDDEN,), F32), TensorSpec("lm_head.weight", (vocab, HIDDEN), F32)]
    return tuple(specs)


def tp_needs(specs: tuple[TensorSpec, ...], tp: int) -> list[WorkerNeeds]:
    """Each worker's needs in a TP engine of `tp` workers (checked by `coverage_problems`)."""
    index = {s.name: i for i, s in enumerate(specs)}
    out = []
    for w in range(tp):
        targets: list[Target] = []
        needs: list[Need] = []
        fills: list[Fill] = []

        def target(layer: str, shape: tuple[int, ...], padding: int = 0) -> int:
            targets.append(Target(layer, "weight", shape, padding))
            return len(targets) - 1

        def rows(name: str, t: int, lo: int, n: int, at: int) -> None:  # rows lo..lo+n of `name` at row `at` of target t
            cols = specs[index[name]].shape[1]
            needs.append(Need(index[name], (lo, 0), (n, cols), t, at * cols, (cols, 1)))

        def whole(name: str, layer: str) -> None:
            shape = specs[index[name]].shape
            needs.append(Need(index[name], (0,) * len(shape), shape, target(layer, shape), 0, (1,)))

        for name, layer in (("model.embed_tokens.weight", "model.embed_tokens"),):
            vocabulary(specs, index, name, layer, w, tp, target, rows, fills)
        for i in range(sum(1 for s in specs if s.name.endswith("q_proj.weight"))):
            p = f"model.layers.{i}."
            whole(p + "input_layernorm.weight", p + "input_layernorm")
            q, kv = HEADS * HEAD // tp, KV * HEAD // tp
            t = target(p + "self_attn.qkv_proj", (q + 2 * kv, HIDDEN))
            rows(p + "self_attn.q_proj.weight", t, w * q, q, 0)
            rows(p + "self_attn.k_proj.weight", t, w * kv, kv, q)
            rows(p + "self_attn.v_proj.weight", t, w * kv, kv, q + kv)
            cols = HEADS * HEAD // tp  # o_proj: this worker's columns, a strided box of the checkpoint tensor
            t = target(p + "self_attn.o_proj", (HIDDEN, cols))
            needs.append(Need(index[p + "self_attn.o_proj.weight"], (0, w * cols), (HIDDEN, cols), t, 0, (cols, 1)))
            whole(p + "post_attention_layernorm.weight", p + "post_attention_layernorm")
            f = FFN // tp
            t = target(p + "mlp.gate_up_proj", (2 * f, HIDDEN))
            rows(p + "mlp.gate_proj.weight", t, w * f, f, 0)
            rows(p + "mlp.up_proj.weight", t, w * f, f, f)
            t = target(p + "mlp.down_proj", (HIDDEN, f))
            needs.append(Need(index[p + "mlp.down_proj.weight"], (0, w * f), (HIDDEN, f), t, 0, (f, 1)))
        whole("model.norm.weight", "model.norm")
        vocabulary(specs, index, "lm_head.weight", "lm_head", w, tp, target, rows, fills)
        record = WorkerNeeds(w, specs, tuple(targets), tuple(sorted(needs, key=lambda n: (n.tensor, n.offsets))), tuple(fills))
        assert coverage_problems(record) == [], coverage_problems(record)
        out.append(record)
    return out


def vocabulary(specs, index, name, layer, w, tp, target, rows, fills) -> None:
    """Rows of a vocabulary padded to a multiple of 64, split over the workers; the padded
    rows of a worker's part zeroed by its loader (a fill)."""
    vocab = specs[index[name]].shape[0]
    per = -(-vocab // 64) * 64 // tp
    lo, hi = w * per, min((w + 1) * per, vocab)
    t = target(layer, (per, HIDDEN))
    if hi > lo:
        rows(name, t, lo, hi - lo, 0)
    real = max(hi - lo, 0)
    if real < per:
        fills.append(Fill(t, real * HIDDEN, (per - real, HIDDEN), (HIDDEN, 1), 0.0))


def holdings(specs: tuple[TensorSpec, ...], senders: int) -> ShardPlan:
    """One sender: the whole model. Several: FSDP2 rows, the norms replicated on every rank."""
    def kind(spec: TensorSpec) -> str:
        return WHOLE if senders == 1 or "norm" in spec.name else SHARD0

    return build_shard_plan([[Declared(s.name, s.shape, s.dtype, kind(s)) for s in specs] for _ in range(senders)])


def plan_of(senders: int, workers: int, vocab: int = 100) -> MxNPlan:
    specs = checkpoint(vocab)
    return build_mxn_plan(holdings(specs, senders), tp_needs(specs, workers))


def values(specs: tuple[TensorSpec, ...], version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    return {s.name: torch.randn(s.shape, generator=gen) for s in specs}


def rank_tensors(plan: MxNPlan, rank: int, version: int) -> dict[str, torch.Tensor]:
    """What trainer rank `rank` holds of `version`: its FSDP2 rows, or a whole tensor."""
    full = values(plan.specs, version)
    senders = len(plan.holdings.shares)
    out = {}
    for spec, kind in zip(plan.holdings.specs, plan.holdings.kinds):
        tensor = full[spec.name]
        if kind == SHARD0:
            lo, hi = chunk_rows(spec.shape[0], senders, rank)
            tensor = tensor[lo:hi].clone()
        out[spec.name] = tensor
    return out


def expected(needs: WorkerNeeds, version: int) -> dict[str, torch.Tensor]:
    """Each target as the engine's loaders would leave it after loading `version`."""
    full = values(needs.specs, version)
    out = {t.describe(): torch.zeros(t.shape) for t in needs.targets}
    for need in needs.needs:
        box = tuple(slice(o, o + n) for o, n in zip(need.offsets, need.sizes))
        target = out[needs.targets[need.target].describe()]
        target.as_strided(need.sizes, need.dst_strides, need.dst_offset).copy_(full[needs.specs[need.tensor].name][box])
    for fill in needs.fills:
        out[needs.targets[fill.target].describe()].as_strided(fill.shape, fill.stride, fill.offset).fill_(fill.value)
    return out


class FakeLayers:
    """An engine's layers as plain tensors (`weights`, by target): `open_layer` stages fresh
    ones (NaN: a region nobody writes shows), `close_layer` makes them the engine's. Targets
    named in `live` are given as None (the sink holds them). `die_at`: after closing that
    many layers the process exits (an engine worker lost part-way)."""

    def __init__(self, needs: WorkerNeeds, *, live: tuple[str, ...] = (), die_at: int | None = None, fail_open: str | None = None) -> None:
        self.needs = needs
        self.weights = {t.describe(): torch.full(t.shape, OLD) for t in needs.targets}
        self.live, self.die_at, self.fail_open = set(live), die_at, fail_open
        self.staged: dict[str, tuple[list[Target], list[torch.Tensor | None]]] = {}
        self.closed: list[str] = []
        self.calls: list[str] = []

    def begin(self) -> None:
        self.calls.append("begin")
        self.closed = []

    def open_layer(self, layer, targets):
        if layer == self.fail_open:
            raise RuntimeError(f"the engine cannot stage {layer}")
        staged = [None if t.describe() in self.live else torch.full(t.shape, float("nan")) for t in targets]
        self.staged[layer] = (list(targets), staged)
        return staged

    def close_layer(self, layer, held):
        targets, staged = self.staged.pop(layer)
        for target, tensor in zip(targets, staged):
            self.weights[target.describe()] = (held[target.name] if tensor is None else tensor).clone()
        self.closed.append(layer)
        if self.die_at is not None and len(self.closed) == self.die_at:
            os._exit(7)

    def finish(self) -> None:
        self.calls.append("finish")

    def abort(self) -> None:
        self.calls.append("abort")
        self.staged.clear()

    def state(self, version: int, before: int | None = None) -> dict[str, str]:
        """Per layer, "new" (every target holds `version`), "old" (every target holds what it
        held before: `before`'s values, or OLD) or "torn"."""
        new = expected(self.needs, version)
        old = expected(self.needs, before) if before is not None else {n: torch.full_like(t, OLD) for n, t in new.items()}
        layers: dict[str, set[str]] = {}
        for target in self.needs.targets:
            name, held = target.describe(), self.weights[target.describe()]
            word = "new" if torch.equal(held, new[name]) else "old" if torch.equal(held, old[name]) else "torn"
            layers.setdefault(target.layer, set()).add(word)
        return {layer: words.pop() if len(words) == 1 else "torn" for layer, words in layers.items()}
