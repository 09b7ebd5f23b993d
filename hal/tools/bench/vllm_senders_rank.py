"""One trainer rank of `hal bench --engine vllm --senders M` (hal.tools.bench.vllm_senders
describes the run).

Each rank reads only its own part of the checkpoint (safetensors slices: FSDP2's Shard(0)
rows, or with `--tp T` a block of the Megatron-shaped layout of hal.tools.bench.
senders_megatron) and makes two weight sets of it, the checkpoint's values plus one of two
perturbations that depend on each element's place in the whole tensor alone (`perturbation`),
so that the ranks holding a replicated tensor hold the same values and every sync changes
every weight the engine serves. Trainer rank 0 drives the engine through `RemoteEngine`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from hal.procs import run_gloo_rank

AMPLITUDE = 5e-3  # each weight moves by up to this much between the two sets
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13], [1, 40, 41]]  # within every preset's vocabulary (the tiny one: 64)


@dataclass(frozen=True, slots=True)
class Job:
    """What every trainer rank is told (picklable: it crosses to the spawned ranks)."""

    checkpoint: str
    model_dir: str
    address: tuple[str, int]
    engine_name: str
    engine_tp: int
    senders: int
    tp: int | None
    receive: str
    bucket_bytes: int
    timeout_s: float
    warmup: int
    repeats: int
    tied: bool
    threads: int = 1

    @property
    def pp(self) -> int:
        return self.senders // self.tp if self.tp else 1


def rank_main(rank: int, out: Any, port: int, job: Job) -> None:
    torch.set_num_threads(job.threads)
    run_gloo_rank(out, rank, job.senders, port, job.timeout_s, lambda: _body(rank, job))


def held_by(params: list[Any], job: Job, rank: int) -> list[Any]:
    """What `rank` holds of each tensor (`senders_megatron.Held`): FSDP2's Shard(0) rows, or the Megatron layout's."""
    from hal.tools.bench.senders_config import chunk_rows
    from hal.tools.bench.senders_megatron import Held, megatron_held

    if job.tp is not None:
        return megatron_held(params, job.tp, job.pp, rank)
    out = []
    for p in params:
        lo, hi = chunk_rows(p.shape[0], job.senders)[rank]
        out.append(Held(p, (lo, *(0,) * (len(p.shape) - 1)), (hi - lo, *p.shape[1:])))
    return out


def perturbation(shape: tuple[int, ...], offsets: tuple[int, ...], block: tuple[int, ...], k: int) -> torch.Tensor:
    """Weight set k's change at the elements of `block` (at `offsets` of a tensor of `shape`):
    a function of each element's flat index in the whole tensor, within +-AMPLITUDE."""
    index = torch.zeros(block, dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(shape))):
        view = [1] * len(block)
        view[d] = block[d]
        index = index + (torch.arange(offsets[d], offsets[d] + block[d], dtype=torch.int64) * stride).view(view)
        stride *= shape[d]
    return ((index * 2654435761 + 40503 * k) % 2001 - 1000).to(torch.float32) * (AMPLITUDE / 1000)


def _body(rank: int, job: Job) -> dict[str, Any]:
    import hal

    with hal.use("cpu"):  # host tensors over gloo, whatever VERL_DEVICE says
        return _run(rank, job)


def _run(rank: int, job: Job) -> dict[str, Any]:
    import torch.distributed as dist
    from safetensors import safe_open

    from hal.integrations.vllm.client import WeightSync
    from hal.integrations.vllm.engine_proxy import RemoteEngine
    from hal.sync import SyncConfig
    from hal.sync.receive import specs_from_safetensors

    began = time.perf_counter()
    params = specs_from_safetensors(job.checkpoint)  # from its header alone
    held = held_by(params, job, rank)
    base = []
    with safe_open(job.checkpoint, framework="pt") as f:
        for h in held:
            base.append(f.get_slice(h.param.name)[tuple(slice(o, o + n) for o, n in zip(h.offsets, h.block))].contiguous())
    sets = [[b + perturbation(h.param.shape, h.offsets, h.block, k).to(b.dtype) for h, b in zip(held, base)] for k in (1, 2)]
    del base
    pairs = [_pairs(held, values, job) for values in sets]
    engine = RemoteEngine(job.address if rank == 0 else None, name=job.engine_name, num_workers=job.engine_tp, timeout_s=job.timeout_s)
    reference = _Reference(job, engine) if rank == 0 else None  # the engine before any sync: its noise
    sync = WeightSync(
        [engine], config=SyncConfig(bucket_bytes=job.bucket_bytes, timeout_s=job.timeout_s), timeout_s=job.timeout_s,
        trainer_group=dist.group.WORLD, senders="all", receive=job.receive, canary=None,
    )
    setup_s = time.perf_counter() - began
    syncs: list[dict[str, Any]] = []
    sync.init()
    try:
        for i in range(job.warmup + job.repeats):
            dist.barrier()
            start = time.perf_counter()
            result = sync.sync(pairs[i % 2], version=i + 1)
            end = time.perf_counter()
            m = result.metrics
            mine = {"start": start, "end": end, "seconds": result.seconds, "bytes": int(m.bytes), "largest_link_bytes": m.largest_link_bytes}
            every: list[Any] = [None] * job.senders
            dist.all_gather_object(every, mine)  # after the timed part
            if rank == 0:
                syncs.append(_engine_side(job, engine, result, every))
        receive = sync.receive
    finally:
        sync.close()
    last = sets[(job.warmup + job.repeats - 1) % 2]
    full = _gather(params, held, last, rank)  # what the trainer holds, whole, on rank 0 (None elsewhere)
    if rank != 0:
        return {"rank": rank, "held_bytes": sum(t.nbytes for t in last), "setup_s": setup_s}
    return {
        "rank": 0, "held_bytes": sum(t.nbytes for t in last), "setup_s": setup_s, "receive": receive, "syncs": syncs,
        "model_bytes": sum(p.nbytes for p in params), "tensors": len(params), "check": reference.check(full),
    }


def _pairs(held: list[Any], values: list[torch.Tensor], job: Job) -> list[tuple[str, Any]]:
    """A weight set as this rank's source: FSDP2 `Shard(0)` DTensors (their local rows these
    tensors), or the Megatron layout's blocks (`hal.sync.plan.Block`) and whole norms."""
    import torch.distributed as dist

    if job.tp is not None:
        from hal.sync.plan import Block

        return _BlockSource([(h.param.name, v if h.whole else Block(v, tuple(h.param.shape), h.offsets)) for h, v in zip(held, values)])
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    return [
        (h.param.name, DTensor.from_local(v, mesh, [Shard(0)], run_check=False, shape=torch.Size(h.param.shape),
                                          stride=torch.empty(h.param.shape, device="meta").stride()))
        for h, v in zip(held, values)
    ]


class _BlockSource:
    """A Megatron-shaped rank's blocks and whole norms as a source every rank sends its own
    part of (hal.sync.source.LocalSource, as hal.integrations.megatron.MegatronSource)."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        self.pairs = pairs

    def local_tensors(self) -> list[tuple[str, Any]]:
        return list(self.pairs)

    def metadata(self) -> list[Any]:
        from hal.sync import TensorSpec
        from hal.sync.plan import Block

        return [TensorSpec(n, held.shape if isinstance(held, Block) else tuple(held.shape), held.dtype) for n, held in self.pairs]

    def __iter__(self) -> Any:
        raise TypeError("the bench's Megatron-shaped blocks are sent by every rank, each its own: WeightSync(senders='all')")


def _engine_side(job: Job, engine: Any, result: Any, every: list[dict[str, Any]]) -> dict[str, Any]:
    """Trainer rank 0, after a sync: the engine's version, what each worker counted (equal to
    the plan's, `check_worker_bytes`), its tied head refreshed."""
    from hal.tools.bench.vllm_engine_methods import check_worker_bytes

    if result.engine_versions.get(job.engine_name) != str(result.version):
        raise RuntimeError(f"engine reports version {result.engine_versions} after sync {result.version}")
    workers = engine.call("bench_last_metrics")
    sender = result.metrics.as_dict()
    check_worker_bytes(sender, workers, model_bytes=int(result.metrics.model_bytes))
    if job.tied and engine.call("bench_refreshed_tied") != [["lm_head"]] * job.engine_tp:
        raise RuntimeError("the engine did not refresh its tied lm_head after the sync")
    return {
        "seconds": max(x["end"] for x in every) - min(x["start"] for x in every),
        "rank0_sync_seconds": result.seconds,
        "sender_bytes": [x["bytes"] for x in every],
        "largest_link_bytes_per_rank": [x["largest_link_bytes"] for x in every],
        "plan_worker_bytes": None if sender.get("worker_bytes") is None else list(sender["worker_bytes"]),
        "worker_bytes": [w["bytes"] if w else None for w in workers],
        "model_bytes": int(result.metrics.model_bytes),
        "worker_apply_seconds": [w.get("apply_s") if w else None for w in workers],
    }


def _gather(params: list[Any], held: list[Any], values: list[torch.Tensor], rank: int) -> dict[str, torch.Tensor] | None:
    """The whole tensors the ranks hold, on rank 0: each rank adds its piece into zeros (one
    copy of a replicated tensor: its first holder's), reduced to rank 0 one tensor at a time."""
    import torch.distributed as dist

    mine = {h.param.name: (h, v) for h, v in zip(held, values)}
    out: dict[str, torch.Tensor] = {}
    for p in params:
        whole = torch.zeros(p.shape, dtype=p.dtype)
        if p.name in mine:
            h, v = mine[p.name]
            if not h.whole or h.index == 0:
                whole[tuple(slice(o, o + n) for o, n in zip(h.offsets, h.block))] = v
        dist.reduce(whole, dst=0, op=dist.ReduceOp.SUM)
        if rank == 0:
            out[p.name] = whole
    return out if rank == 0 else None


class _Reference:
    """Trainer rank 0's check that the engine computes what the trainer holds: transformers'
    prompt log-probs on the gathered weights against the engine's, within 4x the engine's
    own difference from transformers on the checkpoint before any sync (+1e-5, as
    tests/integrations/vllm/families.py), and the engine moved by more than that."""

    def __init__(self, job: Job, engine: Any) -> None:
        from hal.canary import Probe, module_logprobs
        from hal.tools.tiny_model import load_trainer_model

        self.engine, self.probe = engine, Probe(tuple(tuple(p) for p in PROMPTS))
        self.model = load_trainer_model(job.model_dir)
        self.before = engine.call("prompt_logprobs", PROMPTS)
        self.noise = _largest_difference(self.before, module_logprobs(self.model, self.probe))
        self.tolerance = 4 * self.noise + 1e-5

    def check(self, full: dict[str, torch.Tensor]) -> dict[str, Any]:
        from hal.canary import module_logprobs

        self.model.load_state_dict(full, strict=False, assign=True)
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.get_output_embeddings().weight = self.model.get_input_embeddings().weight
        engine = self.engine.call("prompt_logprobs", PROMPTS)
        difference = _largest_difference(engine, module_logprobs(self.model, self.probe))
        moved = _largest_difference(engine, self.before)
        out = {"max_abs": difference, "tolerance": self.tolerance, "noise_before": self.noise, "engine_moved_by": moved, "log_probs": sum(map(len, engine))}
        if difference > self.tolerance:
            raise RuntimeError(f"after the last sync the engine's prompt log-probs differ from the trainer's by {difference:.3g} (tolerance {self.tolerance:.3g})")
        if moved <= self.tolerance:
            raise RuntimeError(f"the syncs moved the engine's log-probs by {moved:.3g} only, within the tolerance {self.tolerance:.3g}: the check proves nothing")
        return out


def _largest_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))
