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

Writes a PNG of reward and sync time per step; `--json PATH` writes the per-step record.
Exits non-zero if outputs stop matching or the engine reports another version.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PROMPT_LEN = 6
ARCHITECTURES = ("llama", "qwen2")  # hal.integrations.tiny_model.ARCHITECTURES, without importing torch here

def say(line: str) -> None:
    print(line, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20, help="RL steps (each ends with one weight sync); default 20")
    parser.add_argument("--out-dir", default="hal-demo-out", help="where the model, plot and JSON go; default ./hal-demo-out")
    parser.add_argument("--json", metavar="PATH", help="write {'steps': [...]} to PATH")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-token", type=int, default=7, help="the token the reward counts; default 7")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step; default 16")
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt; default 4")
    parser.add_argument("--max-tokens", type=int, default=12, help="completion length; default 12")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate; default 3e-3")
    parser.add_argument(
        "--arch", choices=ARCHITECTURES, default="llama",
        help="model architecture: llama (no biases) or qwen2 (q/k/v biases); default llama",
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
        "--in-process",
        action="store_true",
        help="run vLLM's engine core and worker inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); faster start",
    )


def _quiet_vllm() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("transformers", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


def start_engine(model_dir: Path, *, seed: int, max_model_len: int = 256):
    """A vLLM `LLM` on `model_dir` in fp32 with the hal weight-transfer backend."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    return LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=128 * 2**20,
        seed=seed,
        weight_transfer_config=WeightTransferConfig(backend="hal"),
    )


def shutdown_engine(llm: Any) -> None:
    from hal.integrations import vllm_internals

    with contextlib.suppress(Exception):
        vllm_internals.shutdown_llm(llm)


def engine_greedy(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def trainer_greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy completions from the transformers model, one prompt at a time (no padding)."""
    import torch

    model.eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
            outs.append(out[0, len(prompt):].tolist())
    return outs


def random_prompts(gen: Any, n: int, vocab_size: int) -> list[list[int]]:
    import torch

    from hal.integrations.tiny_model import BOS, SPECIAL_TOKENS

    body = torch.randint(len(SPECIAL_TOKENS), vocab_size, (n, PROMPT_LEN - 1), generator=gen)
    return [[BOS, *row] for row in body.tolist()]


def reinforce_step(model: Any, optimizer: Any, prompts: list[list[int]], completions: list[list[list[int]]], rewards: list[list[float]]) -> float:
    """One policy-gradient step: advantage = reward minus the mean of the prompt's samples."""
    import torch

    model.train()
    seqs, advs = [], []
    for prompt, comps, rs in zip(prompts, completions, rewards):
        baseline = sum(rs) / len(rs)
        for comp, r in zip(comps, rs):
            seqs.append(prompt + comp)
            advs.append(r - baseline)
    ids = torch.tensor(seqs)
    adv = torch.tensor(advs)
    logits = model(input_ids=ids).logits[:, PROMPT_LEN - 1 : -1]
    targets = ids[:, PROMPT_LEN:]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    loss = -(adv.unsqueeze(1) * logp).sum(dim=1).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def write_plot(path: Path, steps: list[dict[str, Any]], model_name: str = "Llama") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["step"] for s in steps]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax1.plot(xs, [s["reward"] for s in steps], marker="o")
    ax1.set_ylabel("reward (target-token fraction)")
    ax1.set_title(f"hal demo: RL on a tiny {model_name}, trainer -> live vLLM engine")
    ax1.grid(alpha=0.3)
    ax2.bar(xs, [s["sync_seconds"] * 1000 for s in steps], color="tab:orange")
    ax2.set_ylabel("sync (ms)")
    ax2.set_xlabel("step (= weight version)")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "ray", False):
        if args.tied or args.in_process:
            raise ValueError("--ray runs its own engine actor: --tied and --in-process do not apply")
        from hal.demo_ray import main as ray_main

        return ray_main(args)
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    _quiet_vllm()
    import torch

    from hal.integrations.tiny_model import TinyModelSpec, build_tiny_model, load_trainer_model
    from hal.integrations.vllm_client import OfflineEngine, WeightSync

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = TinyModelSpec(seed=args.seed, architecture=args.arch, tie_word_embeddings=args.tied)
    model_name = {"llama": "Llama", "qwen2": "Qwen2"}[spec.architecture] + (" (tied)" if spec.tie_word_embeddings else "")
    if not 3 <= args.target_token < spec.vocab_size:
        raise ValueError(f"--target-token must be a word id in 3..{spec.vocab_size - 1}, got {args.target_token}")
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model_dir = build_tiny_model(out_dir / "model", spec)
    say(f"[demo] tiny {model_name} ({spec.nbytes_fp32() / 2**20:.1f} MiB fp32) in {model_dir}")
    trainer = load_trainer_model(model_dir)
    optimizer = torch.optim.Adam(trainer.parameters(), lr=args.lr)
    mode = "in-process" if args.in_process else "multi-process"
    say(f"[demo] starting vLLM ({mode}, CPU, fp32, weight_transfer_config backend='hal') ...")
    llm = start_engine(model_dir, seed=args.seed)
    say(f"[demo] engine up after {time.perf_counter() - t0:.1f} s")

    from vllm import SamplingParams

    gen = torch.Generator().manual_seed(args.seed)
    eval_prompts = random_prompts(gen, 4, spec.vocab_size)
    steps: list[dict[str, Any]] = []
    failures: list[str] = []
    sync = WeightSync([OfflineEngine(llm)])
    try:
        sync.init()
        say(f"[demo] trainer and engine worker joined one {sync.world_size}-rank group; {args.steps} steps, "
            f"reward = fraction of token {args.target_token} in {args.max_tokens}-token completions")
        say(f"{'step':>5} {'reward':>7} {'loss':>8} {'sync s':>8} {'GiB/s':>7} {'engine v':>8} {'outputs':>8}  time: generate / train / check")
        for step in range(1, args.steps + 1):
            step_start = time.perf_counter()
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
            match = engine_greedy(llm, eval_prompts, args.max_tokens) == trainer_greedy(trainer, eval_prompts, args.max_tokens)
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
            steps.append(record)
            say(f"{step:>5} {reward:>7.3f} {loss:>8.3f} {result.seconds:>8.4f} {result.gib_per_s:>7.3f} "
                f"{engine_version:>8} {'match' if match else 'DIFFER':>8}  {gen_s:.2f} / {train_s:.2f} / {check_s:.2f} s")
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
            json.dump({"steps": [{k: s[k] for k in ("step", "reward", "sync_seconds", "engine_version", "outputs_match")} for s in steps]}, f, indent=2)
    first = sum(s["reward"] for s in steps[: max(1, len(steps) // 5)]) / max(1, len(steps) // 5)
    last = sum(s["reward"] for s in steps[-max(1, len(steps) // 5):]) / max(1, len(steps) // 5)
    say(f"[demo] reward {first:.3f} -> {last:.3f} (first vs last fifth of the run); "
        f"median sync {sorted(s['sync_seconds'] for s in steps)[len(steps) // 2]:.4f} s; plot {plot}"
        + (f"; json {args.json}" if args.json else ""))
    say(f"[demo] done in {time.perf_counter() - t0:.1f} s")
    if failures:
        for f in failures:
            print(f"[demo] FAIL {f}", file=sys.stderr)
        return 1
    return 0
