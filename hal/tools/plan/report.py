"""What `hal plan` says of a plan: its numbers (`summarize`) and their lines (`header_lines`, `engine_lines`)."""

from __future__ import annotations

from array import array
from typing import Any, Sequence

import torch

from hal.sync.plan.mxn import MxNPlan
from hal.sync.plan.needs import WorkerNeeds
from hal.tools.plan.fabric import FABRICS, Fabric, floor


def _boxes(needs: Sequence[WorkerNeeds], per_group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Every box every worker needs as a row (its group of `per_group` workers, the tensor,
    the offsets, the sizes), with the worker and the bytes of each; None when none needs any."""
    dims = max((len(s.shape) for s in needs[0].specs), default=0)
    rows, owner, nbytes = array("q"), array("q"), array("q")
    for w, record in enumerate(needs):
        sizes = [s.dtype.itemsize for s in record.specs]
        for need in record.needs:
            pad = dims - len(need.sizes)
            rows.extend((w // per_group, need.tensor, *need.offsets, *(0,) * pad, *need.sizes, *(1,) * pad))
            owner.append(w)
            nbytes.append(need.numel * sizes[need.tensor])
    if not owner:
        return None
    table = torch.frombuffer(rows, dtype=torch.int64).reshape(len(owner), -1)
    return table, torch.frombuffer(owner, dtype=torch.int64), torch.frombuffer(nbytes, dtype=torch.int64)


def replicated_bytes(needs: Sequence[WorkerNeeds], per_engine: int) -> list[int]:
    """Per worker, the bytes of the boxes it needs that another worker of its engine
    (workers `per_engine` at a time) needs too (norms, routers, a KV head two TP ranks
    serve, attention under DP): the rest is its own shard of its engine."""
    boxes = _boxes(needs, per_engine)
    if boxes is None:
        return [0] * len(needs)
    table, owner, nbytes = boxes
    _, inverse, counts = torch.unique(table, dim=0, return_inverse=True, return_counts=True)
    out = torch.zeros(len(needs), dtype=torch.int64)
    out.scatter_add_(0, owner, nbytes * (counts[inverse] > 1))
    return out.tolist()


def node_bytes(needs: Sequence[WorkerNeeds], per_node: int) -> tuple[list[int], list[int]]:
    """Per node of `per_node` workers (in worker order): the bytes its workers take in
    together, and the bytes of the distinct boxes they need (what one receiver per node would
    take in once, then hand on inside the node: a later transport's gain, told apart here)."""
    nodes = -(-len(needs) // per_node)
    boxes = _boxes(needs, per_node)
    if boxes is None:
        return [0] * nodes, [0] * nodes
    table, owner, nbytes = boxes
    total = torch.zeros(nodes, dtype=torch.int64).scatter_add_(0, owner // per_node, nbytes)
    distinct, inverse = torch.unique(table, dim=0, return_inverse=True)
    once = torch.zeros(len(distinct), dtype=torch.int64).scatter_reduce_(0, inverse, nbytes, "amax")  # the same box: the same bytes
    union = torch.zeros(nodes, dtype=torch.int64).scatter_add_(0, distinct[:, 0], once)
    return total.tolist(), union.tolist()


def summarize(plan: MxNPlan, fabric: Fabric, per_engine: int, per_node: int = 8) -> dict[str, Any]:
    """The plan's numbers: bytes per worker (its shard and what other workers of its engine,
    of `per_engine` workers, need too), per node of `per_node` workers (their sum and their
    distinct boxes) and per sender, the largest link, what is dropped, and the floor at
    `fabric` with the figure and its source (and at every named fabric)."""
    replicated = replicated_bytes(plan.needs, per_engine)
    node_sum, node_union = node_bytes(plan.needs, per_node)
    link = plan.largest_link
    busiest = max(range(len(plan.bytes_in)), key=plan.bytes_in.__getitem__)
    low = floor(fabric, max(plan.bytes_in), max(plan.bytes_out), link.nbytes)
    floors = {name: floor(other, max(plan.bytes_in), max(plan.bytes_out), link.nbytes).seconds for name, other in FABRICS.items()}
    return {
        "tensors": len(plan.specs),
        "parameters": sum(s.numel for s in plan.specs),
        "model_bytes": plan.model_bytes,
        "pieces": plan.pieces,
        "senders": len(plan.bytes_out),
        "workers": len(plan.bytes_in),
        "bytes_in": list(plan.bytes_in),
        "replicated_in": replicated,
        "bytes_in_min": min(plan.bytes_in),
        "bytes_in_max": max(plan.bytes_in),
        "busiest_worker": {"worker": busiest, "bytes": plan.bytes_in[busiest], "shard": plan.bytes_in[busiest] - replicated[busiest],
                           "replicated": replicated[busiest]},
        "per_node": per_node,
        "node_in": node_sum,
        "node_union_in": node_union,
        "node_in_max": max(node_sum),
        "node_union_in_max": max(node_union),
        "bytes_out": list(plan.bytes_out),
        "bytes_out_min": min(plan.bytes_out),
        "bytes_out_max": max(plan.bytes_out),
        "largest_link": {"sender": link.sender, "worker": link.worker, "bytes": link.nbytes, "pieces": link.count},
        "dropped": list(plan.dropped),
        "floor": {"seconds": low.seconds, "binds": low.binds, "fabric": fabric.name, "figure": fabric.what,
                  "per_port_bytes_per_s": fabric.per_port, "per_pair_bytes_per_s": fabric.per_pair, "source": fabric.source,
                  "third_party": fabric.third_party},
        "floors": floors,
        "digest": plan.digest,
    }


def _gb(n: float) -> str:
    """Bytes in decimal units (the fabrics' figures are decimal too)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def header_lines(model: dict[str, Any], trainer: str, numbers: dict[str, Any], shared: dict[str, Any]) -> list[str]:
    """The model and the trainer, as text."""
    n = numbers
    return [
        f"model        {model['name']} ({model['model_type']}): {n['tensors']:,} tensors, {n['parameters'] / 1e9:,.3g} B parameters, "
        f"{_gb(n['model_bytes'])} in {model['dtype']}" + (f" (its first {model['layers']} layers)" if model.get("layers") else ""),
        f"trainer      {trainer}: {n['senders']} senders",
        f"shared       imports {shared['imports_s']:.2f} s, checkpoint {shared['checkpoint_s']:.2f} s, holdings {shared['holdings_s']:.2f} s; "
        f"peak RSS {shared['peak_rss_bytes'] / 2**30:.2f} GiB",
    ]


def engine_lines(engine: str, numbers: dict[str, Any], timing: dict[str, Any]) -> list[str]:
    """One engine layout's plan, as text: one line per fact."""
    n = numbers
    busy, link, low = n["busiest_worker"], n["largest_link"], n["floor"]
    dropped = f"{len(n['dropped'])}: {', '.join(n['dropped'][:3])}{' ...' if len(n['dropped']) > 3 else ''}" if n["dropped"] else "none"
    others = ", ".join(f"{name} {seconds:.3g} s" for name, seconds in n["floors"].items() if name != low["fabric"])
    return [
        f"engine       vLLM {engine}: {n['workers']} workers",
        f"pieces       {n['pieces']:,}",
        f"worker in    min {_gb(n['bytes_in_min'])}, max {_gb(n['bytes_in_max'])} (worker {busy['worker']}: its shard {_gb(busy['shard'])} "
        f"+ replicated {_gb(busy['replicated'])})",
        f"node in      {n['per_node']} workers a node: max {_gb(n['node_in_max'])} into a node's workers together; "
        f"the distinct boxes they need, max {_gb(n['node_union_in_max'])} (what one receiver per node would take in once)",
        f"sender out   min {_gb(n['bytes_out_min'])}, max {_gb(n['bytes_out_max'])}",
        f"largest link trainer rank {link['sender']} -> worker {link['worker']}: {_gb(link['bytes'])} in {link['pieces']:,} pieces",
        f"dropped      {dropped}",
        f"floor        {low['seconds']:.3g} s at {low['fabric']} ({low['figure']}; {low['binds']})" + (f"; {others}" if others else ""),
        f"             source: {low['source']}",
        f"planned in   {timing['plan_s']:.2f} s: engine config {timing['engine_config_s']:.2f} s, needs {timing['needs_s']:.2f} s "
        f"({n['workers']} workers), M x N plan {timing['mxn_s']:.2f} s, with the shared steps",
    ]
