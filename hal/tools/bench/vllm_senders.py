"""`hal bench --engine vllm --senders M`: M trainer ranks, each holding only its own part of
the model, send into a live vLLM engine of `--engine-tp` workers.

    hal bench --engine vllm --senders 2 --engine-tp 2 --receive shard --json run.json

This process builds the `--vllm-preset`'s model, starts the engine (as hal.tools.bench.
vllm_engine does) and serves its calls on 127.0.0.1 (hal.integrations.vllm.engine_proxy);
M trainer ranks are spawned (hal.procs.spawn_ranks, one gloo group) and each holds only
its own FSDP2 `Shard(0)` rows of every tensor (with `--tp T`: the Megatron-shaped layout of
T tensor-parallel ranks x M / T stages, hal.tools.bench.senders_megatron), read from the
checkpoint's slices (hal.tools.bench.vllm_senders_rank). Every rank runs
`WeightSync([engine], trainer_group=<the ranks' group>, senders="all", receive=--receive)`;
rank 0 drives the engine through a `RemoteEngine`. `--warmup` syncs, then `--repeats`,
alternating two weight sets that differ from the checkpoint and from each other in every
weight, so that every sync changes the engine; each sync's time runs from the earliest
rank's call (after a barrier) to the latest rank's return, `seconds` is their median.

Checked, not only printed (the run fails, `hal bench` exits non-zero, otherwise): after
every sync, the engine's version, and the bytes each engine worker counted equal the
plan's (`check_worker_bytes`: its shard plus its replicated tensors with `--receive
shard`, the model's bytes with whole tensors); the bytes out of the trainer ranks add up
to the bytes into the workers (shard) or to the model (whole). After the last sync, the
engine's prompt log-probs equal transformers' on the whole weights the ranks hold
(gathered to rank 0), within 4x the engine's own difference from transformers before any
sync, and they moved by more than that (vllm_senders_rank._Reference).

Reported beside the time: bytes out of each trainer rank, into each engine worker (each
counted them), and over the largest link (one trainer rank to one worker; none with whole
tensors, which every rank broadcasts to all workers). No process, port or /dev/shm file
outlives the run: the ranks are killed past `--timeout` (spawn_ranks), the engine is shut
down and the server stopped on every way out, SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import time
from typing import Any, Iterator

from hal.tools.bench.vllm_engine_report import GIB, MIB

ENGINE_NAME = "llm"


def check_args(args: argparse.Namespace) -> None:
    """Refuse by name what `--senders` into an engine does not take, before anything is built."""
    from hal.tools.bench.vllm_engine import VLLM_METHODS, check_engine_args

    given = getattr(args, "vllm_transports", None)
    if given is not None and tuple(given) != ("broadcast",):
        raise SystemExit("hal bench: --senders M sends over the broadcast transport (every rank its own link to each "
                         "worker): give no --vllm-transports, or --vllm-transports broadcast")
    args.vllm_transports = ("broadcast",)
    check_engine_args(args)
    methods = tuple(getattr(args, "vllm_methods", VLLM_METHODS))
    unsupported = [
        flag
        for flag, wanted in (
            ("--vllm-methods other than hal", methods not in (VLLM_METHODS, ("hal",))),
            ("--vllm-canary", getattr(args, "vllm_canary", None) is not None),
            ("several --vllm-bucket-mb", len(tuple(getattr(args, "vllm_bucket_mb", (256.0,)))) > 1),
            ("--receivers (the engine's workers are --engine-tp)", getattr(args, "receivers", 1) != 1),
        )
        if wanted
    ]
    if unsupported:
        raise SystemExit(f"hal bench: --engine vllm --senders times hal's sync alone: it does not take {', '.join(unsupported)}")
    tp, senders = getattr(args, "tp", None), args.senders
    if tp is not None and senders % tp:
        raise SystemExit(f"hal bench: --tp {tp} must divide --senders {senders} (M = TP x PP)")


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises SystemExit for the block (in the main thread), so that the engine, the
    server and the ranks are shut down as on any other way out."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build, start, spawn and time (module doc); print the summary; the report."""
    check_args(args)
    from hal.integrations.vllm import internals as vllm_internals
    from hal.integrations.vllm.canary_answers import llm_prompt_logprobs
    from hal.integrations.vllm.client import OfflineEngine
    from hal.integrations.vllm.engine_proxy import serve_engine
    from hal.procs import free_port, spawn_ranks
    from hal.tools.bench.vllm_engine import DEFAULT_VLLM_PRESET, build_model, start_engine
    from hal.tools.bench.vllm_senders_rank import Job, rank_main

    spec, model_dir = build_model(args)
    (checkpoint,) = sorted(model_dir.glob("*.safetensors"))
    engine_tp, senders = int(getattr(args, "engine_tp", 1)), args.senders
    timeout_s = float(args.timeout)
    with _sigterm_unwinds():
        llm = start_engine(args, model_dir)
        try:
            extra = {
                "bench_last_metrics": lambda: llm.collective_rpc("bench_last_metrics"),
                "bench_refreshed_tied": lambda: llm.collective_rpc("bench_refreshed_tied"),
                "prompt_logprobs": lambda prompts: llm_prompt_logprobs(llm, prompts, where=f"engine {ENGINE_NAME!r}"),
            }
            with serve_engine(OfflineEngine(llm, name=ENGINE_NAME), extra=extra, timeout_s=timeout_s) as address:
                job = Job(
                    checkpoint=str(checkpoint), model_dir=str(model_dir), address=tuple(address), engine_name=ENGINE_NAME,
                    engine_tp=engine_tp, senders=senders, tp=getattr(args, "tp", None), receive=getattr(args, "receive", "auto"),
                    bucket_bytes=int(tuple(args.vllm_bucket_mb)[0] * MIB), timeout_s=0.8 * timeout_s, warmup=args.warmup,
                    repeats=args.repeats, tied=spec.tie_word_embeddings, threads=getattr(args, "threads", 1),
                )
                print(f"[bench vllm] {senders} trainer rank(s) ({layout_of(job)}) into {engine_tp} worker(s), receive "
                      f"{job.receive}: {args.warmup} + {args.repeats} syncs ...", flush=True)
                began = time.perf_counter()
                reports = spawn_ranks(rank_main, senders, args=(free_port(), job), timeout_s=timeout_s,
                                      label="hal-bench-vllm-senders-rank", on_failure=_failed)
                wall = time.perf_counter() - began
        finally:
            with contextlib.suppress(Exception):
                vllm_internals.shutdown_llm(llm)
    report = summarize(reports, job, preset=getattr(args, "vllm_preset", DEFAULT_VLLM_PRESET), wall_s=wall)
    print_summary(report)
    return report


def _failed(rank: int, text: str) -> None:
    raise RuntimeError(f"hal bench --engine vllm --senders: trainer rank {rank} failed:\n{text}")


def layout_of(job: Any) -> str:
    return "fsdp2 Shard(0)" if job.tp is None else f"megatron tp={job.tp} pp={job.pp}"


def summarize(reports: list[dict[str, Any]], job: Any, *, preset: str, wall_s: float) -> dict[str, Any]:
    """The report: times of the measured syncs, bytes of the last, the engine's check; raises
    where the trainer ranks' bytes do not add up to the workers' (or the model's)."""
    lead = reports[0]
    measured = lead["syncs"][job.warmup :]
    model = lead["model_bytes"]
    for i, s in enumerate(lead["syncs"]):
        into = sum(s["worker_bytes"]) if s["plan_worker_bytes"] is not None else model
        if sum(s["sender_bytes"]) != into:
            raise RuntimeError(f"sync {i + 1}: the trainer ranks sent {s['sender_bytes']} bytes, {sum(s['sender_bytes'])} "
                               f"in all, the workers' plan takes {into}")
    xs = [s["seconds"] for s in measured]
    last = lead["syncs"][-1]
    links = [b for b in last["largest_link_bytes_per_rank"] if b is not None]
    seconds = statistics.median(xs)
    return {
        "engine": "vllm",
        "mode": "senders",
        "preset": preset,
        "tied": job.tied,
        "bytes": model,
        "tensors": lead["tensors"],
        "senders": job.senders,
        "layout": layout_of(job),
        "engine_tp": job.engine_tp,
        "receive": lead["receive"],
        "transport": "broadcast",
        "bucket_bytes": job.bucket_bytes,
        "timing": f"median of {job.repeats} after {job.warmup} warm-up (earliest rank's call to the latest rank's return)",
        "results": [{"method": "hal", "seconds": seconds, "min_seconds": min(xs), "gib_per_s": model / seconds / GIB, "all_seconds": xs,
                     "rank0_sync_seconds": [s["rank0_sync_seconds"] for s in measured]}],
        "sender_bytes": last["sender_bytes"],
        "worker_bytes": last["worker_bytes"],
        "plan_worker_bytes": last["plan_worker_bytes"],
        "largest_link_bytes": max(links) if links else None,
        "largest_link_bytes_per_rank": last["largest_link_bytes_per_rank"],
        "worker_apply_seconds": last["worker_apply_seconds"],
        "held_bytes_per_rank": [r["held_bytes"] for r in reports],
        "check": lead["check"],
        "multiprocess_engine": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0",
        "load_average": os.getloadavg(),
        "wall_s": wall_s,
    }


def print_summary(report: dict[str, Any]) -> None:
    (hal,) = report["results"]
    mib = lambda xs: ", ".join("?" if b is None else f"{b / MIB:.3f}" for b in xs)  # noqa: E731
    link = "none (whole tensors)" if report["largest_link_bytes"] is None else f"{report['largest_link_bytes'] / MIB:.3f} MiB"
    check = report["check"]
    print(
        f"[bench vllm] {report['bytes'] / GIB:.3f} GiB in {report['tensors']} tensors; {report['senders']} trainer ranks "
        f"({report['layout']}) into {report['engine_tp']} engine worker(s), receive {report['receive']}, "
        f"{report['bucket_bytes'] / MIB:g} MiB buckets; {report['timing']}; load average {report['load_average'][0]:.1f}\n"
        f"  hal          {hal['seconds']:>7.3f} s  ({hal['gib_per_s']:.2f} GiB/s, best {hal['min_seconds']:.3f} s)\n"
        f"               out of each trainer rank [{mib(report['sender_bytes'])}] MiB; into each engine worker "
        f"[{mib(report['worker_bytes'])}] MiB; largest link {link}\n"
        f"  check        the engine's log-probs within {check['max_abs']:.1e} of the trainer's (tolerance "
        f"{check['tolerance']:.1e}; the syncs moved them by {check['engine_moved_by']:.1e})",
        flush=True,
    )
