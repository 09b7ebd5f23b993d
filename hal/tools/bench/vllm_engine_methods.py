"""The methods of `hal bench --engine vllm` against one live engine (hal.tools.bench.vllm_engine
says what each measures): `VllmBench` holds what they share (the engine, the two weight
sets, the counters, the canaries, the timings), one method per timed method, the rounds
and the report."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from hal.tools.bench.vllm_engine_report import GIB, MIB, canary_summary, median

# torch threads of the trainer's forward while the canary runs: on 2 shared cores two threads
# stall at every op's barrier when one is descheduled (the 0.5B model's 72 MLP matmuls of 8
# tokens: 0.55-0.66 s with one thread, 3.4-6.9 s with two, load average 27), as in the
# transfer benchmark (`--threads`, default 1).
CANARY_THREADS = 1


def check_worker_bytes(sender: dict[str, Any], workers: list[dict[str, Any] | None], *, model_bytes: int) -> None:
    """Each engine worker counted the bytes the sync's plan gives it (a shard receive: its
    shard plus its replicated tensors); whole tensors, the model's bytes each."""
    received = [w["bytes"] if w else None for w in workers]
    planned = list(sender["worker_bytes"]) if sender.get("worker_bytes") is not None else [model_bytes] * len(workers)
    if received != planned:
        raise RuntimeError(f"bytes into the engine workers {received} are not the plan's {planned}")


def link_bytes(last: dict[str, Any]) -> dict[str, Any]:
    """Bytes into each engine worker (each counted them), out of the trainer rank, and over
    its largest point-to-point link (None with whole tensors: one broadcast or ipc, no links)."""
    sender, workers = last["sender"], last["receivers"]
    return {
        "worker_bytes": [w["bytes"] if w else None for w in workers],
        "sender_bytes": sender["bytes"],
        "largest_link_bytes": sender.get("largest_link_bytes"),
    }


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class VllmBench:
    """One benchmark run against `llm` (started by `vllm_engine.run` on the model in
    `model_dir`, whose weights are `weights`): `rounds()` (every method once per round,
    the rounds repeated), `other_configs()` (hal's further transports and bucket sizes),
    `close()`, then `report()`. Consecutive syncs alternate between `weights` and a
    perturbed copy, so that every sync changes the engine."""

    def __init__(self, args: Any, llm: Any, *, model_dir: Path, weights: dict[str, torch.Tensor], tied: bool) -> None:
        from hal.integrations.vllm.client import OfflineEngine

        # `args` come from `hal bench`'s parser (vllm_engine.add_arguments), defaults included
        self.repeats, self.warmup, self.timeout_s = args.repeats, args.warmup, float(args.timeout)
        self.methods = tuple(args.vllm_methods)
        self.transports = tuple(args.vllm_transports)  # resolved for --receive by vllm_engine.run
        self.receive, self.engine_tp = getattr(args, "receive", "auto"), int(getattr(args, "engine_tp", 1))
        self.configs = [(t, mb) for t in self.transports for mb in tuple(args.vllm_bucket_mb)]
        self.bucket_bytes = int(args.vllm_bucket_mb[0] * MIB)
        self.llm, self.tied = llm, tied
        self.engine = OfflineEngine(llm)
        self.weights_a = weights
        gen = torch.Generator().manual_seed(1)
        weights_b = {k: v + torch.randn(v.shape, generator=gen) * 1e-3 for k, v in weights.items()}
        self.total_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        self.weight_sets = [weights_b, weights]
        self.version = 0
        self.set = 0  # the syncs' weight set: weight_sets[set % 2]
        self.save_dir = Path(tempfile.mkdtemp(prefix="hal-bench-disk-"))
        for name in ("config.json", "generation_config.json"):
            if (model_dir / name).exists():
                shutil.copy(model_dir / name, self.save_dir / name)
        self.canary_shapes: tuple[tuple[int, int], ...] = getattr(args, "vllm_canary", None) or ()
        self.canary_runs: dict[tuple[int, int], list[Any]] = {shape: [] for shape in self.canary_shapes}
        if self.canary_shapes:
            from hal.canary import Canary, CanaryConfig
            from hal.tools.tiny_model import load_trainer_model

            shapes = ", ".join(f"{s}x{n}" for s, n in self.canary_shapes)
            print(f"[bench vllm] loading the trainer's model for the canary ({shapes}) ...", flush=True)
            self.trainer = load_trainer_model(model_dir)
            self.canaries = {shape: Canary(CanaryConfig(mode="log", sequences=shape[0], length=shape[1])) for shape in self.canary_shapes}
        self.timings: dict[str, list[float]] = {m: [] for m in (*self.methods, "memcpy")}
        self.by_config: dict[str, dict[str, Any]] = {}
        self.sync: Any = None
        self.flat = torch.empty(self.total_bytes, dtype=torch.uint8)
        # not in save_dir: reload reads every file there
        self.apply_file = Path(tempfile.mkdtemp(prefix="hal-bench-apply-")) / "apply.safetensors"

    def next_weights(self) -> dict[str, torch.Tensor]:
        self.set += 1
        return self.weight_sets[self.set % 2]

    def next_version(self) -> int:
        self.version += 1
        return self.version

    def open_sync(self, transport: str, mb: float) -> Any:
        from hal.integrations.vllm.client import WeightSync
        from hal.sync import SyncConfig

        sync = WeightSync(
            [self.engine], config=SyncConfig(bucket_bytes=int(mb * MIB), timeout_s=self.timeout_s), timeout_s=self.timeout_s,
            transport=transport, receive=self.receive, canary=None,  # the sync alone: --vllm-canary times the canary apart
        )
        sync.init()
        return sync

    # ---- the timed methods -----------------------------------------------------------------

    def hal_once(self, sync: Any, metrics: list[dict[str, Any]], *, canary: bool) -> float:
        """One sync; its time from the call until the engine reported the new version.
        `canary`: then the canary on what the engine now serves (the rounds' syncs only)."""
        from hal.sync import TensorSource

        result = sync.sync(TensorSource(self.next_weights().items()), version=self.next_version())
        if result.engine_versions[self.engine.name] != str(result.version):
            raise RuntimeError(f"engine reports version {result.engine_versions} after sync {result.version}")
        if self.tied and self.llm.collective_rpc("bench_refreshed_tied") != [["lm_head"]] * self.engine_tp:
            raise RuntimeError("the engine did not refresh its tied lm_head after the sync")
        workers = self.llm.collective_rpc("bench_last_metrics")  # after the timed part
        sender = result.metrics.as_dict()
        check_worker_bytes(sender, workers, model_bytes=self.total_bytes)
        metrics.append({"sender": sender, "receiver": workers[0], "receivers": workers})
        if canary and self.canary_shapes:  # after the timed part
            self.canary_once(result.version)
        return result.seconds

    def disk_once(self) -> float:
        from safetensors.torch import save_file

        def once() -> None:
            weights, version = self.next_weights(), self.next_version()
            save_file(weights, str(self.save_dir / "model.safetensors"))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self.save_dir)})
            self.llm.reset_prefix_cache()
            self.llm.update_weight_version(str(version))

        return _seconds(once)

    def rpc_once(self) -> float:
        from safetensors.torch import save

        def once() -> None:
            weights, version = self.next_weights(), self.next_version()
            self.llm.collective_rpc("bench_reload_bytes", args=(save(weights),))
            self.llm.reset_prefix_cache()
            self.llm.update_weight_version(str(version))

        return _seconds(once)

    def apply_once(self) -> float:
        """The engine's own apply of weights already in the worker's memory (its clock)."""
        from safetensors.torch import save_file

        save_file(self.next_weights(), str(self.apply_file))  # untimed: the worker loads it before its clock starts
        return max(self.llm.collective_rpc("bench_time_apply", args=(str(self.apply_file),)))  # the slowest worker

    def memcpy_once(self) -> float:
        def once() -> None:
            offset = 0
            for t in self.weights_a.values():
                n = t.numel() * t.element_size()
                self.flat[offset : offset + n].copy_(t.reshape(-1).view(torch.uint8))
                offset += n

        return _seconds(once)

    def floor_once(self, sync: Any) -> float:
        """One flat broadcast of every byte trainer -> worker on the hal group; the worker's receive time."""
        import torch.distributed as dist

        import hal

        group, nbytes, timeout_s = sync.sender.transport.group, self.total_bytes, self.timeout_s
        buf = hal.current().empty(nbytes)
        buf.fill_(1)
        result: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: result.update(v=self.llm.collective_rpc("bench_floor_recv", args=(nbytes, timeout_s))), daemon=True
        )
        thread.start()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = timedelta(seconds=timeout_s)
        group.broadcast([torch.zeros(1)], opts).wait()
        start = time.perf_counter()
        group.broadcast([buf], opts).wait()
        sender_s = time.perf_counter() - start
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"floor measurement: the worker did not return within {timeout_s} s")
        return max(sender_s, *(float(v) for v in result["v"]))

    def canary_once(self, version: int) -> None:
        """The canary on the weights the engine now serves, once per probe shape (untimed in the sync)."""
        from hal.integrations.vllm.canary import check_engines

        weights = self.weight_sets[self.set % 2]
        self.trainer.load_state_dict(weights, strict=False, assign=True)  # the synced tensors themselves, no copy
        if self.tied:
            self.trainer.get_output_embeddings().weight = self.trainer.get_input_embeddings().weight
        threads = torch.get_num_threads()
        torch.set_num_threads(CANARY_THREADS)
        try:
            for shape, canary in self.canaries.items():
                self.canary_runs[shape].append(
                    check_engines(canary, [self.engine], source=self.trainer, version=version, wire_dtype=None, timeout_s=self.timeout_s)
                )
        finally:
            torch.set_num_threads(threads)

    # ---- the run ---------------------------------------------------------------------------

    def rounds(self) -> None:
        """Every method once per round, rounds repeated: load on a shared machine hits all alike."""
        methods, (transport, mb) = self.methods, self.configs[0]
        self.sync = self.open_sync(transport, mb)
        metrics: list[dict[str, Any]] = []
        print(f"[bench vllm] {self.warmup} + {self.repeats} rounds of {', '.join(methods)} "
              f"(hal = {transport}, {mb:g} MiB buckets) ...", flush=True)
        for i in range(self.warmup + self.repeats):
            measured = {}
            if "hal" in methods:
                measured["hal"] = self.hal_once(self.sync, metrics, canary=True)
            if "disk_reload" in methods:
                measured["disk_reload"] = self.disk_once()
            if "rpc_bytes" in methods:
                measured["rpc_bytes"] = self.rpc_once()
            if "apply" in methods:
                measured["apply"] = self.apply_once()
            if "floor" in methods:
                measured["floor"] = self.floor_once(self.sync)
                measured["memcpy"] = self.memcpy_once()
            if i >= self.warmup:
                for name, seconds in measured.items():
                    self.timings[name].append(seconds)
        if "hal" in methods:
            self.by_config[f"{transport}@{mb:g}MiB"] = self.summarize(self.timings["hal"], metrics)
        self.sync.close()
        self.sync = None

    def other_configs(self) -> None:
        """hal alone on each further transport and bucket size (`hal_by_config`)."""
        if "hal" not in self.methods:
            return
        for transport, mb in self.configs[1:]:
            print(f"[bench vllm] hal ({transport}, {mb:g} MiB buckets) ...", flush=True)
            self.sync = self.open_sync(transport, mb)
            metrics: list[dict[str, Any]] = []
            xs = [self.hal_once(self.sync, metrics, canary=False) for _ in range(self.warmup + self.repeats)][self.warmup :]
            self.by_config[f"{transport}@{mb:g}MiB"] = self.summarize(xs, metrics)
            self.sync.close()
            self.sync = None

    def close(self) -> None:
        """The open sync and the temporary folders (the engine is its starter's to shut down)."""
        if self.sync is not None:
            self.sync.close()
            self.sync = None
        shutil.rmtree(self.save_dir, ignore_errors=True)
        shutil.rmtree(self.apply_file.parent, ignore_errors=True)
        self.flat = torch.empty(0, dtype=torch.uint8)

    def summarize(self, xs: list[float], metrics: list[dict[str, Any]]) -> dict[str, Any]:
        receiver = [m["receiver"] for m in metrics[self.warmup :] if m["receiver"]]
        return {
            "seconds": median(xs),
            "all_seconds": xs,
            "receiver_apply_seconds": median([r["apply_s"] or 0.0 for r in receiver]) if receiver else None,
            "receiver_total_seconds": median([r["total_s"] for r in receiver]) if receiver else None,
            "sender_transfer_seconds": median([m["sender"]["transfer_s"] or 0.0 for m in metrics[self.warmup :]]),
            "buckets": metrics[-1]["sender"]["buckets"],
            **link_bytes(metrics[-1]),
        }

    def report(self, preset: str) -> dict[str, Any]:
        """The medians, the references and the ratios (the shape `hal bench --json` writes)."""
        timings, warmup = self.timings, self.warmup
        apply_s, floor_s, memcpy_s = timings.get("apply", []), timings.get("floor", []), timings.get("memcpy", [])
        apply_seconds = median(apply_s) if apply_s else None
        floor_seconds = median(floor_s) if floor_s else None
        results = []
        for method in ("hal", "disk_reload", "rpc_bytes"):
            if timings.get(method):
                xs = timings[method]
                s = median(xs)
                results.append({"method": method, "seconds": s, "min_seconds": min(xs), "gib_per_s": self.total_bytes / s / GIB, "all_seconds": xs})
        seconds = {r["method"]: r["seconds"] for r in results}
        ratios: dict[str, float] = {}
        if "hal" in seconds:
            if "disk_reload" in seconds:
                ratios["disk_reload_over_hal"] = seconds["disk_reload"] / seconds["hal"]
            if "rpc_bytes" in seconds:
                ratios["rpc_bytes_over_hal"] = seconds["rpc_bytes"] / seconds["hal"]
            bound = max(x for x in (floor_seconds, apply_seconds, 0.0) if x is not None)
            if bound > 0:
                ratios["hal_over_max_floor_apply"] = seconds["hal"] / bound
        report = {
            "engine": "vllm",
            "preset": preset,
            "tied": self.tied,
            "bytes": self.total_bytes,
            "tensors": len(self.weights_a),
            "timing": f"median of {self.repeats} after {warmup} warm-up",
            "bucket_bytes": self.bucket_bytes,
            "results": results,
            "apply_seconds": apply_seconds,
            "floor_seconds": floor_seconds,
            "memcpy_seconds": median(memcpy_s) if memcpy_s else None,
            "ratios": ratios,
            "transport": self.transports[0],
            "engine_tp": self.engine_tp,
            "receive": self.receive,
            "hal_by_config": self.by_config,
            "multiprocess_engine": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0",
            "load_average": os.getloadavg(),
        }
        if self.canary_shapes:
            report["canary"] = [
                canary_summary(runs[warmup:], shape, seconds.get("hal"), first=runs[0] if runs else None)
                for shape, runs in self.canary_runs.items()
            ]
        return report
