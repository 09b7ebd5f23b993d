"""`hal demo`: a miniature RL loop in which a trainer and a live vLLM engine stay in sync.

1. Build a tiny Llama- (or, with --arch qwen2, Qwen2-) architecture model locally (no hub;
   --tied shares lm_head with embed_tokens, as most small real models do) and start a real
   vLLM engine on it (fp32, the engine's default multi-process mode unless --in-process).
2. Each step: sample completions with vLLM, score them with a programmatic reward (the
   fraction of completion tokens equal to a chosen target token), take one REINFORCE
   step on the trainer's copy (a transformers model), and push the new weights into the
   engine through hal (`WeightSync` -> vLLM's native weight-transfer API, backend "hal").
3. After every sync, check that the engine's greedy output equals the trainer model's
   (Hugging Face `generate`, greedy) on fixed prompts, and that the engine reports the
   trainer's step as its weight version.

With --delta the syncs are delta syncs (`SyncConfig(delta=DeltaConfig(anchor_every=N, choose="bytes"))`):
after a whole (anchor) sync, each segment carries only the words that changed since the
previous version when that is smaller, and every N-th sync is a whole anchor again. The
table and plot then also show, per step, whether the sync was an anchor or a delta, the
fraction of words changed, and the bytes sent against what a dense sync sends; the check
also compares the engine's log-probabilities of its greedy tokens with the trainer's
(`LOGPROB_TOLERANCE` in hal.tools.demo_rl). See `add_arguments` for the configuration --delta picks and why.

With --canary-every N the sync runs the canary (hal.canary, docs/canary.md) at syncs
1, N+1, 2N+1, ...: the engine's log-probs of a fixed probe against the trainer's, printed
as the max |delta log-prob| beside the outputs column, plotted against its tolerance, and a
FAIL when it fired.

Writes a PNG of reward and sync time per step; `--json PATH` writes the per-step record.
Exits non-zero if outputs stop matching or the engine reports another version.

The code: this module holds the options and the loop; hal.tools.demo_rl the engine, the
prompts, the REINFORCE step and the engine-trainer comparison (shared with
hal.tools.demo_ray); hal.tools.demo_plot the PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from hal.tools.demo_plot import write_plot
from hal.tools.demo_rl import (
    LOGPROB_TOLERANCE,
    engine_greedy,
    engine_greedy_logprobs,
    quiet_vllm,
    random_prompts,
    reinforce_step,
    round_to_wire,
    say,
    shutdown_engine,
    start_engine,
    trainer_greedy,
    trainer_logprobs,
)
from hal.tools.demo_records import CANARY_KEYS, DELTA_KEYS, canary_cell, canary_record, delta_record, median

# the dense families of hal.tools.tiny_model.ARCHITECTURES (named here without importing torch)
ARCHITECTURES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}
LR = 3e-3
DELTA_LR = 1e-3
DELTA_ANCHOR_EVERY = 8
DELTA_SEGMENT_BYTES = 64 << 10
WIRE_DTYPES = ("float32", "bfloat16")
TRANSPORTS = ("auto", "broadcast", "ipc")  # "auto" and hal.integrations.vllm.info.ENGINE_TRANSPORTS, without importing vLLM here


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20, help="RL steps (each ends with one weight sync); default 20")
    parser.add_argument("--out-dir", default="hal-demo-out", help="where the model, plot and JSON go; default ./hal-demo-out")
    parser.add_argument("--json", metavar="PATH", help="write {'steps': [...]} to PATH")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-token", type=int, default=7, help="the token the reward counts; default 7")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step; default 16")
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt; default 4")
    parser.add_argument("--max-tokens", type=int, default=12, help="completion length; default 12")
    parser.add_argument(
        "--lr", type=float, default=None,
        help=f"Adam learning rate; default {LR:g}, or {DELTA_LR:g} with --delta (see there)",
    )
    parser.add_argument(
        "--arch", choices=list(ARCHITECTURES), default="llama",
        help="model architecture: llama (no biases), qwen2 (q/k/v biases) or qwen3 (q/k norms); default llama",
    )
    parser.add_argument(
        "--tied",
        action="store_true",
        help="tie lm_head to embed_tokens (tie_word_embeddings), like Qwen2.5 0.5B-3B, Qwen3 0.6B-4B, Llama 3.2",
    )
    parser.add_argument(
        "--ray",
        action="store_true",
        help="the distributed job: 2 FSDP2 trainer actors and a TP=2 vLLM engine actor on a loopback-only Ray "
        "(needs the [ray] extra); outputs go to <out-dir>/ray",
    )
    parser.add_argument(
        "--receive", choices=("auto", "shard", "whole"), default=None,
        help="--ray: how each engine worker takes a sync (WeightSync(receive=...)): auto (default), its own shard "
        "where the engine's workers recorded their needs; shard; whole, every tensor whole",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run vLLM's engine core and worker inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); faster start",
    )
    parser.add_argument(
        "--delta",
        action="store_true",
        help="delta syncs with periodic whole anchors (SyncConfig(delta=DeltaConfig(anchor_every=N))); the table and "
        "plot add per step: anchor or delta, fraction of words changed, bytes sent against a dense sync. "
        "A delta only pays where most words stay the same between steps, and an fp32 copy of weights under Adam "
        f"changes nearly every element every step. So --delta sets, unless given: --wire-dtype bfloat16 (fp32 "
        f"master weights sent as bf16, as to a bf16 engine: a step smaller than a weight's bf16 spacing often "
        f"leaves its bf16 word as it was), --lr {DELTA_LR:g} (here about half the words change per step and the "
        f"reward starts rising within 20 steps; at {LR:g} the reward reaches 1 but about 80%% change, at 3e-4 about "
        f"25%% change but the reward hardly moves in 20 steps; real post-training runs use far smaller rates), "
        f"--transport broadcast (bytes travel through the group, as between nodes) and "
        f"{DELTA_SEGMENT_BYTES >> 10} KiB segments, each encoded on its own",
    )
    parser.add_argument(
        "--anchor-every", type=int, default=None, metavar="N",
        help=f"with --delta only: a whole (anchor) sync every N syncs (steps 1, N+1, 2N+1, ...); default {DELTA_ANCHOR_EVERY}",
    )
    parser.add_argument(
        "--wire-dtype", choices=WIRE_DTYPES, default=None,
        help="dtype the weights travel in (SyncConfig.wire_dtype); default float32, bfloat16 with --delta. The engine "
        "still runs fp32: with bfloat16 it holds the trainer's weights rounded to bf16, and the output check compares "
        "with the trainer's weights rounded the same way (fp32 vLLM equals transformers token for token; bf16 vLLM does not)",
    )
    parser.add_argument(
        "--canary-every", type=int, default=None, metavar="N",
        help="run the canary at syncs 1, N+1, 2N+1, ... (CanaryConfig(mode='log', every=N), docs/canary.md): the engine's "
        "log-probabilities of a fixed probe against the trainer's; printed as 'canary' beside the outputs column (the "
        "max |delta log-prob|, '-' where it did not run, '!' where it fired), plotted, and a FAIL when it fired",
    )
    parser.add_argument(
        "--transport", choices=TRANSPORTS, default=None,
        help="how buckets reach the engine: auto (shared memory on this node), broadcast (through the group), ipc; "
        "default auto, broadcast with --delta",
    )


def resolve_options(args: argparse.Namespace) -> None:
    """Fill in the defaults that depend on --delta (see add_arguments), in place."""
    delta = getattr(args, "delta", False)
    if getattr(args, "lr", None) is None:
        args.lr = DELTA_LR if delta else LR
    if getattr(args, "wire_dtype", None) is None:
        args.wire_dtype = "bfloat16" if delta else "float32"
    if getattr(args, "transport", None) is None:
        args.transport = "broadcast" if delta else "auto"
    anchor_every = getattr(args, "anchor_every", None)
    if anchor_every is not None and not delta:
        raise ValueError("--anchor-every applies only with --delta")
    if anchor_every is None and delta:
        anchor_every = args.anchor_every = DELTA_ANCHOR_EVERY
    if delta and (isinstance(anchor_every, bool) or not isinstance(anchor_every, int) or anchor_every < 1):
        raise ValueError(f"--anchor-every must be at least 1, got {anchor_every!r}")
    canary_every = getattr(args, "canary_every", None)
    if canary_every is not None and (isinstance(canary_every, bool) or not isinstance(canary_every, int) or canary_every < 1):
        raise ValueError(f"--canary-every must be at least 1, got {canary_every!r}")


def check_ray_options(args: argparse.Namespace) -> None:
    """Refuse the single-engine options `hal demo --ray` does not take; resolve the rest."""
    if args.tied or args.in_process:
        raise ValueError("--ray runs its own engine actor: --tied and --in-process do not apply")
    if any(getattr(args, name, None) not in (None, False) for name in ("delta", "anchor_every", "wire_dtype", "transport", "canary_every")):
        raise ValueError(
            "--delta, --anchor-every, --wire-dtype, --transport and --canary-every apply to the single-engine demo, not to --ray"
        )
    args.receive = args.receive or "auto"
    resolve_options(args)


def demo_canary(args: argparse.Namespace, trainer: Any, reference: Any, wire_dtype: Any) -> Any:
    """The demo's canary (--canary-every N), or None: mode "log", so the loop runs on and a
    step where it fired is a FAIL at the end. With a narrower wire the engine holds the
    trainer's weights rounded to it, and the canary's reference is that rounded copy, held
    to fp32's tolerance (as the output check is held to the rounded weights)."""
    every = getattr(args, "canary_every", None)
    if every is None:
        return None
    from hal.canary import TOLERANCES, Canary, CanaryConfig, module_logprobs

    if reference is None:
        return Canary(CanaryConfig(mode="log", every=every))
    import torch

    return Canary(
        CanaryConfig(mode="log", every=every, tolerance=TOLERANCES[torch.float32]),
        reference=lambda probe: module_logprobs(round_to_wire(reference, trainer, wire_dtype), probe),
    )


def main(args: argparse.Namespace) -> int:
    """The single-engine demo (`hal demo`; `hal demo --ray` is hal.tools.demo_ray.main)."""
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if getattr(args, "receive", None) is not None:
        raise ValueError("--receive applies to --ray: the single-engine demo's engine has one worker, which takes every tensor whole")
    resolve_options(args)
    delta = getattr(args, "delta", False)
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    quiet_vllm()
    import torch

    from hal.tools.tiny_model import TinyModelSpec, build_tiny_model, load_trainer_model
    from hal.integrations.vllm.client import OfflineEngine, WeightSync
    from hal.sync import SyncConfig
    from hal.sync.config import DeltaConfig

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = TinyModelSpec(seed=args.seed, architecture=args.arch, tie_word_embeddings=args.tied)
    model_name = ARCHITECTURES[spec.architecture] + (" (tied)" if spec.tie_word_embeddings else "")
    if not 3 <= args.target_token < spec.vocab_size:
        raise ValueError(f"--target-token must be a word id in 3..{spec.vocab_size - 1}, got {args.target_token}")
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model_dir = build_tiny_model(out_dir / "model", spec)
    say(f"[demo] tiny {model_name} ({spec.nbytes_fp32() / 2**20:.1f} MiB fp32) in {model_dir}")
    trainer = load_trainer_model(model_dir)
    optimizer = torch.optim.Adam(trainer.parameters(), lr=args.lr)
    wire_dtype = getattr(torch, args.wire_dtype)
    # What the check compares the engine with: the trainer itself, or (a narrower wire) a
    # second copy holding the trainer's weights rounded as the engine got them.
    reference = load_trainer_model(model_dir) if wire_dtype != torch.float32 else None
    mode = "in-process" if args.in_process else "multi-process"
    say(f"[demo] starting vLLM ({mode}, CPU, fp32, weight_transfer_config backend='hal') ...")
    llm = start_engine(model_dir, seed=args.seed)
    say(f"[demo] engine up after {time.perf_counter() - t0:.1f} s")

    from vllm import SamplingParams

    gen = torch.Generator().manual_seed(args.seed)
    eval_prompts = random_prompts(gen, 4, spec.vocab_size)
    steps: list[dict[str, Any]] = []
    failures: list[str] = []
    if delta:
        config = SyncConfig(
            # by bytes: on loopback the wire costs almost nothing, so choosing by time would
            # send whole syncs here; the demo shows what deltas carry (docs/delta.md)
            delta=DeltaConfig(anchor_every=args.anchor_every, choose="bytes"),
            wire_dtype=None if wire_dtype == torch.float32 else wire_dtype,
            segment_bytes=DELTA_SEGMENT_BYTES,
        )
    else:
        config = SyncConfig(wire_dtype=None if wire_dtype == torch.float32 else wire_dtype)
    canary = demo_canary(args, trainer, reference, wire_dtype)
    sync = WeightSync([OfflineEngine(llm)], config=config, transport=args.transport, canary=canary)
    canary_head = f" {'canary':>9}" if canary is not None else ""
    try:
        sync.init()
        if canary is not None:
            tolerance = f"{canary.config.tolerance:g}" if canary.config.tolerance is not None else "the dtypes' tolerance"
            say(f"[demo] canary every {args.canary_every} syncs: the engine's log-probs of a fixed probe "
                f"({canary.config.sequences} x {canary.config.length} tokens) against the trainer's; 'canary' is the max "
                f"|delta log-prob| (within {tolerance}; '-': not checked at that sync, '!': fired)")
        say(f"[demo] trainer and engine worker joined one {sync.world_size}-rank group; {args.steps} steps, "
            f"reward = fraction of token {args.target_token} in {args.max_tokens}-token completions")
        if delta:
            say(f"[demo] delta syncs: a whole anchor every {args.anchor_every} syncs, {DELTA_SEGMENT_BYTES >> 10} KiB "
                f"segments, {args.wire_dtype} wire, {sync.transport} transport, lr {args.lr:g}"
                + (f"; the fp32 engine holds the trainer's weights rounded to {args.wire_dtype} and is checked against exactly those"
                   if reference is not None else ""))
            say(f"[demo] check per step: greedy tokens equal, and the engine's log-probabilities of them within "
                f"{LOGPROB_TOLERANCE:g} of the trainer's (logp gap); segs: segments sent dense / as indices / as bitmask")
            say(f"{'step':>5} {'reward':>7} {'loss':>8} {'sync s':>8} {'kind':>6} {'changed':>8} {'sent KiB':>9} "
                f"{'dense KiB':>9} {'sent %':>7} {'segs d/i/b':>10} {'engine v':>8} {'outputs':>8}{canary_head} {'logp gap':>8}  "
                "time: generate / train / check")
        else:
            if reference is not None:
                say(f"[demo] {args.wire_dtype} wire: the fp32 engine holds the trainer's weights rounded to "
                    f"{args.wire_dtype} and is checked against exactly those")
            say(f"{'step':>5} {'reward':>7} {'loss':>8} {'sync s':>8} {'GiB/s':>7} {'engine v':>8} {'outputs':>8}{canary_head}  "
                "time: generate / train / check")
        for step in range(1, args.steps + 1):
            step_start = time.perf_counter()
            canary_text = ""
            prompts = random_prompts(gen, args.prompts, spec.vocab_size)
            params = SamplingParams(
                n=args.samples, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=args.seed * 100003 + step
            )
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            gen_s = time.perf_counter() - step_start
            completions = [[list(c.token_ids) for c in o.outputs] for o in outs]
            rewards = [[c.count(args.target_token) / len(c) for c in comps] for comps in completions]
            reward = sum(map(sum, rewards)) / sum(map(len, rewards))
            loss = reinforce_step(trainer, optimizer, prompts, completions, rewards)

            train_s = time.perf_counter() - step_start - gen_s
            result = sync.sync(trainer, version=step)
            check_start = time.perf_counter()
            engine_version = next(iter(result.engine_versions.values()))
            expected_model = trainer if reference is None else round_to_wire(reference, trainer, wire_dtype)
            if delta:
                engine_out, engine_lp = engine_greedy_logprobs(llm, eval_prompts, args.max_tokens)
                trainer_lp = trainer_logprobs(expected_model, eval_prompts, engine_out)
                logprob_gap = max(abs(a - b) for xs, ys in zip(engine_lp, trainer_lp, strict=True) for a, b in zip(xs, ys, strict=True))
            else:
                engine_out = engine_greedy(llm, eval_prompts, args.max_tokens)
            match = engine_out == trainer_greedy(expected_model, eval_prompts, args.max_tokens)
            check_s = time.perf_counter() - check_start
            record = {
                "step": step,
                "reward": reward,
                "loss": loss,
                "sync_seconds": result.seconds,
                "gib_per_s": result.gib_per_s,
                "engine_version": engine_version,
                "outputs_match": match,
            }
            if delta:
                record.update(delta_record(result.metrics), logprob_gap=logprob_gap)
            if canary is not None:
                record.update(canary_record(result.canary))
                canary_text = f" {canary_cell(record):>9}"
                if result.canary is not None and result.canary.fired:
                    failures.append(f"step {step}: {result.canary.message()}")
            steps.append(record)
            times = f"{gen_s:.2f} / {train_s:.2f} / {check_s:.2f} s"
            if delta:
                m = record
                changed = "-" if m["changed_fraction"] is None else f"{100 * m['changed_fraction']:.1f}%"
                segs = m["segments_by_encoding"]
                segs_text = f"{segs.get('dense', 0)}/{segs.get('indices', 0)}/{segs.get('bitmask', 0)}"
                say(f"{step:>5} {reward:>7.3f} {loss:>8.3f} {result.seconds:>8.4f} {'delta' if m['delta'] else 'anchor':>6} "
                    f"{changed:>8} {m['wire_bytes'] / 2**10:>9.1f} {m['dense_wire_bytes'] / 2**10:>9.1f} "
                    f"{100 * m['wire_bytes'] / m['dense_wire_bytes']:>6.1f}% {segs_text:>10} "
                    f"{engine_version:>8} {'match' if match else 'DIFFER':>8}{canary_text} {logprob_gap:>8.1e}  {times}")
                if logprob_gap > LOGPROB_TOLERANCE:
                    failures.append(f"step {step}: engine log-probabilities differ from the trainer's by {logprob_gap:.2e} "
                                    f"(more than {LOGPROB_TOLERANCE:g})")
            else:
                say(f"{step:>5} {reward:>7.3f} {loss:>8.3f} {result.seconds:>8.4f} {result.gib_per_s:>7.3f} "
                    f"{engine_version:>8} {'match' if match else 'DIFFER':>8}{canary_text}  {times}")
            if not match:
                failures.append(f"step {step}: engine greedy output differs from the trainer's")
            if engine_version != str(step):
                failures.append(f"step {step}: engine reports weight version {engine_version!r}")
    finally:
        sync.close()
        shutdown_engine(llm)

    plot = out_dir / "demo.png"
    write_plot(plot, steps, model_name)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            keys = ("step", "reward", "sync_seconds", "engine_version", "outputs_match") + (DELTA_KEYS if delta else ())
            keys += CANARY_KEYS if canary is not None else ()
            json.dump({"steps": [{k: s[k] for k in keys} for s in steps]}, f, indent=2)
    first = sum(s["reward"] for s in steps[: max(1, len(steps) // 5)]) / max(1, len(steps) // 5)
    last = sum(s["reward"] for s in steps[-max(1, len(steps) // 5):]) / max(1, len(steps) // 5)
    say(f"[demo] reward {first:.3f} -> {last:.3f} (first vs last fifth of the run); "
        f"median sync {sorted(s['sync_seconds'] for s in steps)[len(steps) // 2]:.4f} s; plot {plot}"
        + (f"; json {args.json}" if args.json else ""))
    if delta:
        deltas = [s for s in steps if s["delta"]]
        if deltas:
            sent = sum(s["wire_bytes"] for s in deltas)
            dense = sum(s["dense_wire_bytes"] for s in deltas)
            say(f"[demo] {len(deltas)} delta syncs sent {sent / 2**10:.1f} KiB where dense syncs send {dense / 2**10:.1f} KiB "
                f"({100 * sent / dense:.1f}%); median words changed "
                f"{100 * median([s['changed_fraction'] for s in deltas]):.1f}%; "
                f"anchors at steps {[s['step'] for s in steps if not s['delta']]}; median sync: anchors "
                f"{median([s['sync_seconds'] for s in steps if not s['delta']]):.4f} s, deltas "
                f"{median([s['sync_seconds'] for s in deltas]):.4f} s")
    say(f"[demo] done in {time.perf_counter() - t0:.1f} s")
    if failures:
        for f in failures:
            print(f"[demo] FAIL {f}", file=sys.stderr)
        return 1
    return 0
