"""`hal plan`'s layouts: the trainer that sends (`--trainer`) and what each of its ranks
holds, from the checkpoint's shapes alone; the engine that receives (`--engine`).

    --trainer one                              one rank holds every tensor whole
    --trainer fsdp2:8                          FSDP2 over 8 ranks: each tensor's rows, torch.chunk's split
    --trainer megatron:tp=4,pp=2,ep=8,etp=1    Megatron-core (hal.integrations.megatron.local), dp= optional
    --engine tp=8 | tp=1,dp=16,ep              vLLM TP x DP workers, `ep`: experts over all of them
    --engine tp=8,engines=16                   16 independent engines of TP8 (NeMo-RL's data parallelism)

The holdings are the `ShardPlan` the live trainer ranks would agree (hal.sync.plan.shards):
`one` and Megatron's blocks through `build_shard_plan` from each rank's declaration (for
Megatron, hal.sync.plan.declare of the blocks convert.py's rules make); FSDP2's shares
made directly, as `build_shard_plan` makes them from `Shard(0)` declarations, without a
declaration per tensor per rank (DeepSeek-V3 over 64 ranks has 2.9 M shares).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from hal.sync.plan.declare import declare
from hal.sync.plan.shards import SHARD0, WHOLE, Declared, Share, ShardPlan, build_shard_plan, chunk_rows, rows_of, shard_name
from hal.sync.spec import TensorSpec

_SIZE = re.compile(r"(tp|pp|ep|etp|dp)=(\d+)")


@dataclass(frozen=True, slots=True)
class TrainerLayout:
    """`kind` one, fsdp2 or megatron; `ranks` for FSDP2; the Megatron grid for megatron."""

    kind: str
    ranks: int = 1
    grid: Any = None  # hal.integrations.megatron.local.MegatronGrid

    @property
    def senders(self) -> int:
        return self.grid.ranks if self.kind == "megatron" else self.ranks

    def describe(self) -> str:
        if self.kind == "one":
            return "one rank, every tensor whole"
        if self.kind == "fsdp2":
            return f"FSDP2 over {self.ranks} ranks (rows of every tensor)"
        return self.grid.describe()


def parse_trainer(text: str) -> TrainerLayout:
    """`one`, `fsdp2:M` or `megatron:tp=..,pp=..,ep=..,etp=..[,dp=..]`; ValueError naming what is wrong."""
    kind, _, rest = text.partition(":")
    if kind == "one" and not rest:
        return TrainerLayout("one")
    if kind == "fsdp2" and rest.isdigit() and int(rest) >= 1:
        return TrainerLayout("fsdp2", int(rest))
    if kind == "megatron":
        from hal.integrations.megatron.local import MegatronGrid

        sizes = {}
        for part in filter(None, rest.split(",")):
            match = _SIZE.fullmatch(part)
            if match is None or match.group(1) in sizes:
                raise ValueError(f"--trainer {text}: {part!r} is not one of tp=, pp=, ep=, etp=, dp= (each once)")
            sizes[match.group(1)] = int(match.group(2))
        return TrainerLayout("megatron", grid=MegatronGrid(**sizes))
    raise ValueError(f"--trainer {text}: expected one, fsdp2:M (M >= 1) or megatron:tp=T,pp=P,ep=E,etp=X[,dp=D]")


def parse_engine(text: str) -> Any:
    """`tp=T[,dp=D][,ep][,engines=R]` as a vLLM engine layout; ValueError naming what is wrong."""
    from hal.integrations.vllm.meta_engine import EngineLayout

    sizes: dict[str, Any] = {}
    for part in text.split(","):
        name, eq, value = part.partition("=")
        if name == "ep" and not eq and "ep" not in sizes:
            sizes["ep"] = True
        elif name in ("tp", "dp", "engines") and value.isdigit() and name not in sizes:
            sizes[name] = int(value)
        else:
            raise ValueError(f"--engine {text}: {part!r} is not one of tp=T, dp=D, ep, engines=R (each once)")
    return EngineLayout(**sizes)


def holdings(layout: TrainerLayout, specs: list[TensorSpec], config: dict[str, Any], dtype: torch.dtype) -> ShardPlan:
    """Every trainer rank's shares of the checkpoint `specs` (floating-point in `dtype`)."""
    if layout.kind == "one":
        return build_shard_plan([[Declared(s.name, s.shape, s.dtype, WHOLE) for s in specs]])
    if layout.kind == "fsdp2":
        return fsdp2_holdings(specs, layout.ranks)
    from hal.integrations.megatron.local import held_blocks

    grid = layout.grid
    declarations = [declare(held_blocks(config, grid, rank, dtype), rank, grid.ranks) for rank in range(grid.ranks)]
    plan = build_shard_plan(declarations)
    missing = {s.name for s in specs} - {s.name for s in plan.specs}
    if missing:
        raise ValueError(f"megatron trainer: its ranks hold no {sorted(missing)[0]!r} ({len(missing)} checkpoint tensors none holds)")
    return plan


def fsdp2_holdings(specs: list[TensorSpec], ranks: int) -> ShardPlan:
    """What `build_shard_plan` makes of every rank declaring every tensor `Shard(0)`, made
    directly: rank i's rows of each tensor (`chunk_rows`), a 0-d or empty tensor whole from
    one rank (the tensor's index modulo the ranks), in checkpoint order."""
    shares: list[list[Share]] = [[] for _ in range(ranks)]
    trusted = TensorSpec.trusted  # the specs passed their checks; 2.9 M shares are built here
    cuts: dict[tuple[int, ...], list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]] = {}  # shape -> (rank, first row, offsets, block)
    for index, spec in enumerate(specs):
        if not spec.shape or spec.numel == 0:
            offsets = (0,) * len(spec.shape)
            shares[index % ranks].append(Share(spec, offsets, trusted(shard_name(spec.name, 0), spec.shape, spec.dtype)))
            continue
        cut = cuts.get(spec.shape)
        if cut is None:
            rows, zeros = rows_of(spec.shape), (0,) * (len(spec.shape) - 1)
            cut = cuts[spec.shape] = [(rank, lo, (lo, *zeros), (hi - lo, *spec.shape[1:]))
                                      for rank in range(ranks) for lo, hi in [chunk_rows(rows, ranks, rank)] if hi > lo]
        name, dtype = spec.name, spec.dtype
        for rank, lo, offsets, block in cut:
            shares[rank].append(Share(spec, offsets, trusted(f"{name}@{lo}", block, dtype)))
    return ShardPlan(tuple(specs), tuple(tuple(s) for s in shares), (SHARD0,) * len(specs), ())
