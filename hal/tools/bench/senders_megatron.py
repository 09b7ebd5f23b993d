"""A Megatron-shaped layout for `hal bench --senders M --tp T`: what each of M = T x P trainer
ranks holds of a preset, as a Megatron-core TP x PP trainer holds it under Hugging Face names
(hal.integrations.megatron.convert's rules, from the names alone, without megatron-core).

Rank r is TP rank r % T of pipeline stage r // T (Megatron's order: TP fastest). Stage s
holds layers [s * L / P, (s + 1) * L / P) (`torch.chunk` of the layers), stage 0 the
embedding, the last stage the final norm and an untied `lm_head`. Within a stage:

| tensor | a TP rank's part |
|---|---|
| `embed_tokens`, `lm_head`, `q_proj` / `k_proj` / `v_proj` (weights and biases), `gate_proj` / `up_proj` (and each expert's), the MoE router `mlp.gate` | rows (`torch.chunk` of the rows) |
| `o_proj`, `down_proj` (and each expert's) | columns: a column block, a `Shard(1)` share |
| norms (`*norm.weight`) | whole, replicated over the stage's TP ranks (who split its rows) |

`expected_megatron_shares` counts each rank's bytes from this table alone; the benchmark
checks every rank's `SyncMetrics.bytes` and plan share against it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hal.tools.bench.presets import Param
from hal.tools.bench.senders_config import chunk_rows

COLUMNS = ("o_proj.weight", "down_proj.weight")


@dataclass(frozen=True, slots=True)
class Held:
    """What one rank holds of one tensor: a block at `offsets` of shape `block`, or the
    whole tensor (`whole`, replicated over `replicas` ranks of which it is `index`)."""

    param: Param
    offsets: tuple[int, ...]
    block: tuple[int, ...]
    whole: bool = False
    replicas: int = 1
    index: int = 0

    @property
    def sent_bytes(self) -> int:
        """What the rank sends of it: its block, or its rows of a replicated whole tensor."""
        if self.whole:
            lo, hi = chunk_rows(self.param.shape[0], self.replicas)[self.index]
            return (hi - lo) * (self.param.nbytes // self.param.shape[0]) if self.param.shape[0] else 0
        n = self.param.dtype.itemsize
        for d in self.block:
            n *= d
        return n


def stage_of(name: str, layers: int, stages: int, tied: bool) -> list[int]:
    """The pipeline stages that hold `name` (one, except nothing holds a tied lm_head)."""
    if name.startswith("model.layers."):
        layer = int(name.split(".")[2])
        for s, (lo, hi) in enumerate(chunk_rows(layers, stages)):
            if lo <= layer < hi:
                return [s]
        raise ValueError(f"parameter {name!r}: layer {layer} of {layers}")
    if name == "model.embed_tokens.weight":
        return [0]
    if name == "lm_head.weight":
        return [] if tied else [stages - 1]
    return [stages - 1]  # model.norm


def megatron_held(params: list[Param], tp: int, pp: int, rank: int) -> list[Held]:
    """What trainer rank `rank` holds, in the preset's order."""
    layers = 1 + max((int(p.name.split(".")[2]) for p in params if p.name.startswith("model.layers.")), default=-1)
    tied = not any(p.name == "lm_head.weight" for p in params)
    stage, tp_rank = divmod(rank, tp)
    out: list[Held] = []
    for p in params:
        if stage not in stage_of(p.name, layers, pp, tied):
            continue
        if p.name.endswith("norm.weight") or len(p.shape) == 0:
            out.append(Held(p, (0,) * len(p.shape), tuple(p.shape), whole=True, replicas=tp, index=tp_rank))
        elif p.name.endswith(COLUMNS) and len(p.shape) == 2:
            lo, hi = chunk_rows(p.shape[1], tp)[tp_rank]
            out.append(Held(p, (0, lo), (p.shape[0], hi - lo)))
        else:
            lo, hi = chunk_rows(p.shape[0], tp)[tp_rank]
            out.append(Held(p, (lo, *(0,) * (len(p.shape) - 1)), (hi - lo, *p.shape[1:])))
    return out


def expected_megatron_shares(params: list[Param], tp: int, pp: int) -> list[int]:
    """Each rank's bytes to send, from the table of the module doc alone."""
    return [sum(h.sent_bytes for h in megatron_held(params, tp, pp, r)) for r in range(tp * pp)]


def unevenly_split(params: list[Param], tp: int, pp: int) -> list[str]:
    """The parameters not split evenly over the M ranks: with P > 1 every one (a stage holds
    it, the others nothing); with P = 1 those whose split dimension T does not divide."""
    if pp > 1:
        return [p.name for p in params]
    sizes: dict[str, set[int]] = {}
    for r in range(tp):
        for h in megatron_held(params, tp, pp, r):
            sizes.setdefault(h.param.name, set()).add(h.sent_bytes)
    return [name for name, sent in sizes.items() if len(sent) > 1]
