"""The model families of the engine matrix (test_vllm_families*.py): shapes, probes, checks.

Each family is a tiny random model of the shape users train, built locally: Llama untied
and tied, Qwen2 (q/k/v biases), Qwen3 (q/k norms), Qwen3-MoE, Qwen2-MoE (routed experts
and a shared one), Mixtral. Head size 64 (vLLM 0.23's CPU attention needs it), norms drawn
around 1 (a norm that was not loaded changes what the model computes), and a vocabulary of
96 rows, which vLLM pads to 128: a multiple of 64 hides the padded-embedding failure
(issue 39, case 1). One family keeps a vocabulary of 128 to show the unpadded one.

A sync is right when the engine computes what the trainer computes: after every sync the
engine's prompt log-probs must equal the trainer's within a tolerance measured on the same
engine before any sync, and its greedy continuation must equal the trainer's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch

from hal.tools.tiny_model import TinyModelSpec

PROMPTS = [
    [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [1, 9, 10, 11, 12, 13, 30, 31, 32, 33],
    [1, 40, 41, 42, 43, 44, 50, 60, 70, 80, 90, 95],
    [1, 88, 3, 17, 64, 65, 66, 94],
]
MAX_TOKENS = 8
# Buckets of 64 KiB: every model below takes at least 8 of them (an embedding alone is 48 KiB).
BUCKET_BYTES = 64 << 10

_BASE = TinyModelSpec(
    vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, init_std=0.1, norm_std=0.1, router_std=0.5, num_experts=16, num_experts_per_tok=2,
    moe_intermediate_size=64, seed=7,
)
FAMILIES: dict[str, TinyModelSpec] = {
    "llama": replace(_BASE, architecture="llama"),
    "llama-tied": replace(_BASE, architecture="llama", tie_word_embeddings=True, seed=8),
    "llama-vocab128": replace(_BASE, architecture="llama", vocab_size=128, seed=9),
    "qwen2-tied": replace(_BASE, architecture="qwen2", tie_word_embeddings=True, seed=10),
    "qwen3": replace(_BASE, architecture="qwen3", seed=11),
    "qwen3_moe": replace(_BASE, architecture="qwen3_moe", seed=12),
    "qwen2_moe": replace(_BASE, architecture="qwen2_moe", seed=13),
    "mixtral": replace(_BASE, architecture="mixtral", seed=14),
}
MOE_FAMILIES = [name for name, spec in FAMILIES.items() if spec.moe]


@dataclass(frozen=True)
class Engine:
    """One family's live engine: the vLLM `LLM`, the `WeightSync` into it, the trainer's model."""

    llm: Any
    sync: Any
    model: torch.nn.Module
    dtype: torch.dtype
    tolerance: float
    """4 x the engine's noise before any sync, plus 1e-5: the largest |engine - trainer|
    prompt log-prob, and for bf16 also the largest greedy gap (`largest_greedy_gap`)."""


def trainer_reference(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """What the engine should compute with: the trainer's model itself (fp32), or for a bf16
    engine a copy whose weights are the trainer's rounded to bf16, computed in fp32."""
    if dtype == torch.float32:
        return model
    import copy

    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(dtype).float())
    return rounded


def trainer_logprobs(model: torch.nn.Module, dtype: torch.dtype) -> list[list[float]]:
    from hal.canary import Probe, module_logprobs

    return module_logprobs(trainer_reference(model, dtype), Probe(tuple(tuple(p) for p in PROMPTS)))


def engine_logprobs(llm: Any) -> list[list[float]]:
    from hal.integrations.vllm.canary import llm_prompt_logprobs

    return llm_prompt_logprobs(llm, PROMPTS)


def largest_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


def largest_greedy_gap(continuations: list[list[int]], reference: torch.nn.Module) -> tuple[float, str]:
    """How far below its own best the trainer (`reference`) ranks the tokens an engine chose
    greedily after each prompt: the largest gap, and where it is."""
    largest, where = 0.0, "no gap"
    with torch.no_grad():
        for prompt, tokens in zip(PROMPTS, continuations, strict=True):
            logprobs = torch.log_softmax(reference(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)
            for step, token in enumerate(tokens):
                row = logprobs[len(prompt) - 1 + step]
                gap = float(row.max() - row[token])
                if gap > largest:
                    largest = gap
                    where = (f"after {prompt + tokens[:step]} the engine chose token {token}, which the trainer "
                             f"scores {gap:.3g} below its best {int(row.argmax())}")
    return largest, where


def trainer_greedy(model: torch.nn.Module, dtype: torch.dtype) -> list[list[int]]:
    from hal.tools.demo_rl import trainer_greedy as greedy

    return greedy(trainer_reference(model, dtype), PROMPTS, MAX_TOKENS)


def assert_engine_computes_the_trainers(engine: Engine, what: str) -> float:
    """The engine's log-probs within `engine.tolerance` of the trainer's, and its greedy
    continuation the trainer's; returns the largest log-prob difference.

    fp32: the same tokens. bf16 computes with other roundings than the trainer's fp32 (and
    may route a token near the top-k boundary to another expert), so where two tokens are
    within bf16's noise of each other the engine may take either: there every token the
    engine chose must be one the trainer, scoring the engine's own continuation, ranks
    within twice the tolerance of its best (a continuation runs further from the weights'
    rounding than a scored prompt: one flip changes the context of every later token).
    A tensor misplaced, stale or packed wrong moves log-probs by several nats (2.8-16 in
    issue 39's cases), beyond either bound."""
    from hal.tools.demo_rl import engine_greedy

    difference = largest_difference(engine_logprobs(engine.llm), trainer_logprobs(engine.model, engine.dtype))
    assert difference <= engine.tolerance, (
        f"{what}: the engine's prompt log-probs differ from the trainer's by {difference:.4g} "
        f"(tolerance {engine.tolerance:.3g}, measured before any sync)"
    )
    got = engine_greedy(engine.llm, PROMPTS, MAX_TOKENS)
    if engine.dtype == torch.float32:
        want = trainer_greedy(engine.model, engine.dtype)
        assert got == want, f"{what}: engine greedy {got} != trainer greedy {want}"
        return difference
    gap, where = largest_greedy_gap(got, trainer_reference(engine.model, engine.dtype))
    assert gap <= 2 * engine.tolerance, f"{what}: {where} (tolerance {2 * engine.tolerance:.3g})"
    return difference


@contextlib.contextmanager
def family_engine(tmp_path_factory: Any, family: str, dtype: torch.dtype) -> Iterator[Engine]:
    """A live in-process engine on `family`'s model, its `WeightSync` initialised (buckets of
    `BUCKET_BYTES`; a bf16 wire into a bf16 engine), and the tolerance measured before any sync."""
    from hal.integrations.vllm.client import OfflineEngine, WeightSync
    from hal.sync import SyncConfig
    from hal.tools.tiny_model import build_tiny_model, load_trainer_model
    from tests.integrations.vllm.llm import in_process_llm

    spec = FAMILIES[family]
    model_dir = build_tiny_model(tmp_path_factory.mktemp(f"{family}-{str(dtype).removeprefix('torch.')}"), spec)
    model = load_trainer_model(model_dir)
    config = SyncConfig(bucket_bytes=BUCKET_BYTES, segment_bytes=16 << 10, wire_dtype=None if dtype == torch.float32 else dtype)
    with in_process_llm(model_dir, dtype=str(dtype).removeprefix("torch."), max_model_len=256) as llm:
        from hal.tools.demo_rl import engine_greedy

        before = largest_difference(engine_logprobs(llm), trainer_logprobs(model, dtype))
        if dtype != torch.float32:
            before = max(before, largest_greedy_gap(engine_greedy(llm, PROMPTS, MAX_TOKENS), trainer_reference(model, dtype))[0])
        sync = WeightSync([OfflineEngine(llm)], config=config, timeout_s=60)
        try:
            sync.init()
            yield Engine(llm=llm, sync=sync, model=model, dtype=dtype, tolerance=4 * before + 1e-5)
        finally:
            with contextlib.suppress(Exception):
                sync.close()


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.02) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


# ---- MoE: one expert changed moves only the positions routed to it ---------------------------
def last_layer_routes(model: torch.nn.Module) -> list[list[set[int]]]:
    """For each prompt and position, the experts the model's last layer routes it to (its
    router's top-k), as the trainer computes them."""
    router = model.model.layers[-1].mlp.gate
    routes: list[list[set[int]]] = []

    def record(_module: Any, _inputs: Any, output: Any) -> None:
        indices = output[2]  # (router_logits, scores, indices) in every transformers-5 MoE router
        routes.append([set(row.tolist()) for row in indices])

    handle = router.register_forward_hook(record)
    try:
        with torch.no_grad():
            for prompt in PROMPTS:
                model(torch.tensor([prompt]))
    finally:
        handle.remove()
    return routes


def change_one_expert(model: torch.nn.Module, expert: int, seed: int) -> None:
    """Perturb expert `expert` of the last layer only (its rows of the 3-D expert tensors)."""
    gen = torch.Generator().manual_seed(seed)
    experts = model.model.layers[-1].mlp.experts
    with torch.no_grad():
        for name, p in experts.named_parameters(recurse=False):
            p[expert].add_(torch.randn(p[expert].shape, generator=gen) * 0.2)

