"""What the canary that runs by default (`Canary.default()`, hal.canary) checks after a
`WeightSync` sync, and what it leaves alone.

A canary of the user's own (`canary=CanaryConfig(...)`) asks every engine and fails by
name where it cannot (in "enforce" mode; in "log" its warning names it). The default was
asked for by nobody, so it checks only what it can check without help and never fails a
sync; what it leaves alone it says once, in the log (`Canary.not_checked`):

    the sync's source is not a module            the trainer's log-probs cannot be computed from it
    senders="all"                                every rank would have to agree on the engines it asks
    trainer_group with one sending rank and      the other ranks do not run the forward
      a sharded module
    an engine over HTTP or in a Ray actor        it may be asleep or paused, which the trainer cannot
                                                 see from here: the probe would wait out the sync's
                                                 timeout (and a Ray actor's next call, a wake_up,
                                                 would queue behind it)
    an offline engine that is asleep             the same, seen (vLLM's `is_sleeping`: a sleep, a
                                                 partial wake_up, a paused scheduler)
    an engine that serves LoRA                   its probe is S x (L - 1) forced decode steps
    an engine the canary knows no way to ask     (no `prompt_logprobs(prompts)` method)
    an engine whose answer is an error           left out of the judgement (`Canary.set_aside`)
    the trainer's forward on the probe fails     (a module that is not a causal LM)
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from hal.integrations.vllm import internals as vllm_internals
from hal.canary import Canary


def engines_to_ask(
    canary: Canary, engines: Sequence[Any], *, source: Any, module: torch.nn.Module | None, channel: Any, gathering: bool,
) -> list[Any]:
    """The engines the default `canary` asks after a due sync of `source` (`module` its
    module, or None); [] when it checks nothing. Says once what it leaves alone, and why."""
    if channel is not None:
        canary.not_checked(
            "this sync (senders='all')",
            "every trainer rank sends, and the ranks would have to agree on which engines the default may ask; "
            "pass the same CanaryConfig on every rank to check it",
        )
        return []
    if module is None and canary.reference is None:
        canary.not_checked(
            f"the sync's source ({type(source).__name__})",
            "it is not a module, so the trainer's log-probs cannot be computed from it "
            "(sync the model, or give Canary(config, reference=fn) a function of the probe)",
        )
        return []
    if gathering and canary.reference is None and module is not None and any(hasattr(p, "full_tensor") for p in module.parameters()):
        canary.not_checked(
            f"the sync's source ({type(module).__name__})",
            "it is sharded over trainer_group, and with one sending rank the other ranks do not run the canary's forward "
            "(senders='all' with a CanaryConfig on every rank checks it)",
        )
        return []
    asked = []
    for engine in engines:
        why = refusal(engine)
        if why is None:
            asked.append(engine)
        else:
            canary.not_checked(f"engine {getattr(engine, 'name', type(engine).__name__)!r}", why)
    return asked


def refusal(engine: Any) -> str | None:
    """Why the default canary does not ask `engine` (one of `WeightSync`'s engines), or None."""
    from hal.integrations.vllm.engine_clients import ClientEngine
    from hal.integrations.vllm.engine_local import ExtensionEngine, OfflineEngine

    if callable(getattr(engine, "prompt_logprobs", None)):  # an engine of the user's that computes them itself
        return None
    inner = getattr(engine, "inner", None)  # a wrapper (hal-lora's LoraEngine)
    if inner is not None:
        return refusal(inner)
    _, http_client, ray_client = vllm_internals.weight_sync_clients()
    if isinstance(engine, ClientEngine) and isinstance(engine.client, (http_client, ray_client)):
        return (
            f"it is reached through {type(engine.client).__name__}: it may be asleep or paused, which the trainer cannot "
            "see from here, and a probe into it would wait out the sync's timeout"
        )
    if not isinstance(engine, (OfflineEngine, ExtensionEngine)):
        return f"the canary knows no way to ask a {type(engine).__name__} (give it a prompt_logprobs(prompts) method)"
    if asleep(engine.llm):
        return "it is asleep (a sleep, a partial wake_up or a paused scheduler): the probe would wait for its wake-up"
    try:
        lora = vllm_internals.lora_enabled(engine.llm)
    except Exception:  # noqa: BLE001 - an LLM stand-in: asked, and its answer or error tells
        lora = False
    if lora:
        return "it serves LoRA, where the probe takes a forced decode step per token (S x (L - 1) requests)"
    return None


def asleep(llm: Any) -> bool:
    """Whether an offline `LLM` would hold a request until it is woken (`llm.llm_engine.is_sleeping()`:
    a sleep of any level, a partial `wake_up`, a paused scheduler). False for an object
    without that method (a stand-in): its answer, or its error, tells."""
    is_sleeping = getattr(getattr(llm, "llm_engine", None), "is_sleeping", None)
    return bool(is_sleeping()) if callable(is_sleeping) else False
