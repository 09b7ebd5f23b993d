"""The canary (hal.canary) in verl's checkpoint engine "hal": after a completed update,
the trainer's log-probs of a fixed probe against each rollout worker's.

Where it runs, and why there. verl 0.9.1's `CheckpointEngineManager.update_weights()`
calls `send_weights` on every trainer rank and the rollout workers' `update_weights` (the
server adapter consuming `receive_weights`) at once, waits for both, and only then calls
`finalize()` on every worker (verl/checkpoint_engine/base.py, steps 5 and 6). A trainer
rank's `send_weights` returns once the bytes are received, not once the server adapter has
loaded them; so `finalize` is the first call of the checkpoint engine at which every
rollout engine holds the update, and the canary runs there, on every worker at once.

The engine's side. verl's serving path (its vLLM server actor's `generate`, which takes
`prompt_logprobs`) is reachable by actor name, but not from inside an update: the manager
aborts and parks every request before the update (`abort_replicas`, step 1) and releases
the KV cache (step 3), and resumes them only after `finalize` returns (steps 7 and 8), so a
probe sent from `finalize` would wait for a resume that comes after it. So each rollout
worker answers through a hook on its own side: `CanarySettings.engine_logprobs`
("package.module:function", called with the worker's server adapter and the probe), else
the server adapter's own `prompt_logprobs(sequences)`. A rollout worker with neither
answers with that error, and the canary fires naming it.

The exchange, over sync group 0 (trainer rank 0, sync rank 0; rollout worker i, sync
rank 1 + i; with senders "all" trainer rank 0's group), each step one all-gather of bytes
(JSON, never pickles), bounded by the canary's timeout:

1. trainer rank 0 says whether this update is checked (every trainer rank counts alike)
   and the probe; each rollout worker says whether it has a way to answer (a hook, or its
   adapter's `prompt_logprobs`) and, if not, why;
2. every trainer rank computes the reference with its module (an FSDP2 forward is a
   collective of the trainer group: every rank takes part); each rollout worker asks its
   engine; then each rollout worker sends its answer;
3. trainer rank 0 compares (`Canary.judge`, which logs) and hands the report to every
   trainer rank over the trainer's group; each trainer rank then returns it or, in
   "enforce" mode, raises the same `CanaryError` naming the rollout worker.

The canary nobody configured (`Canary.default()`: no `canary` in engine_kwargs['hal'])
never fails an update: a trainer without a module it can run the probe through, rollout
workers without a way to answer, and a worker whose answer is an error are said once, in
trainer rank 0's log, to be not checked. When no rollout worker has a way to answer,
trainer rank 0 tells the other trainer ranks (one small all-gather of the trainer group,
between steps 1 and 2) and no rank runs the forward.

The checkpoint engine holds a `CanaryDuty` (the canary's state across updates, the
check at `finalize()`, its numbers for the next `send_weights`). It sends the engines a
probe and nothing else: no weight or version changes. Imports no verl.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from hal.canary import Canary, CanaryError, CanaryReport, Probe, dtype_of, module_logprobs, vocab_size_of
from hal.integrations.verl import internals as verl_internals
from hal.integrations.verl.settings import CanarySettings
from hal.sync import SyncConfig
from hal.sync.wire import trainer_channel
from hal.threads import in_daemon_thread

# The largest canary message (a probe, one engine's log-probs, a report): far above any
# probe of a few hundred tokens.
PAYLOAD_LIMIT = 16 << 20


def engine_name(sync_rank: int) -> str:
    """How the report names the rollout worker at `sync_rank` of group 0."""
    return f"rollout worker {sync_rank - 1}"


def _encode(value: Any) -> bytes:
    return json.dumps(value).encode()


def trainer_check(
    canary: Canary,
    module: torch.nn.Module | None,
    version: int,
    *,
    rollouts: Any,
    trainers: Any,
    timeout_s: float,
    wire_dtype: torch.dtype | None = None,
    missing: str | None = None,
    on_device: Callable[[], Any] | None = None,
) -> CanaryReport | None:
    """A trainer rank's part after a completed update of `version` (see the module doc).

    `rollouts`: sync group 0's channel on trainer rank 0, None on the other trainer ranks;
    `trainers`: the trainer group's channel (None: this is the only trainer rank). `module`
    is the trainer's model (`missing` says why there is none: then nothing is checked, the
    rollout workers are told so, and ValueError names the reason on every trainer rank; the
    default canary says it once in the log instead); `on_device()` is a context the forward
    runs in (verl's engine with parameter offload loads the parameters there).
    Returns the report when this update is checked, else None; `CanaryError` in "enforce"."""
    started = time.perf_counter()
    due = canary.due()
    probe: Probe | None = None
    if due and module is not None:
        probe = canary.probe_for(vocab_size_of(module))
    unable: dict[str, str] = {}
    if rollouts is not None:
        message = {"version": version, "due": probe is not None, "probe": [list(s) for s in probe.sequences] if probe else None}
        with rollouts.bounded(timeout_s):
            rows = rollouts.all_gather_bytes(_encode(message), "canary probe", limit=PAYLOAD_LIMIT)
        words = [json.loads(row.decode()) if row else {} for row in rows[1:]]
        unable = {engine_name(rank): word["unable"] for rank, word in enumerate(words, start=1) if word.get("unable")}
    if not due:
        return None
    lead = trainers is None or trainers.rank == 0  # says what the default did not check
    if module is None:
        if not canary.by_default:
            raise ValueError(f"checkpoint engine 'hal': the canary needs the trainer's model: {missing}")
        if lead:
            canary.not_checked("the trainer's model", str(missing))
        return None
    if canary.by_default and not _worth_a_forward(canary, unable, rollouts=rollouts, trainers=trainers, timeout_s=timeout_s):
        if rollouts is not None:  # the rollout workers were told to answer: hear them out
            with rollouts.bounded(timeout_s):
                rollouts.all_gather_bytes(b"", "canary log-probs", limit=PAYLOAD_LIMIT)
        return None
    began = time.perf_counter()
    reference: list[list[float]] | None = None
    try:
        with on_device() if on_device is not None else contextlib.nullcontext():
            reference = module_logprobs(module, probe)  # every trainer rank in step: FSDP2's gathers
    except Exception as exc:
        if not canary.by_default:
            raise
        if lead:  # the rollout workers and the other trainer ranks still hear from this rank below
            canary.not_checked("the trainer's model", f"its forward on the probe failed: {type(exc).__name__}: {exc}")
    reference_s = time.perf_counter() - began
    payload = b"null"
    report: CanaryReport | None = None
    if rollouts is not None:
        with rollouts.bounded(timeout_s):
            rows = rollouts.all_gather_bytes(b"", "canary log-probs", limit=PAYLOAD_LIMIT)
        answers: dict[str, Any] = {}
        seconds: dict[str, float] = {}
        for rank, row in enumerate(rows[1:], start=1):
            answer = json.loads(row.decode())
            if answer.get("none"):
                continue  # this worker does not answer for its engine (a TP rank other than the first)
            name = engine_name(rank)
            if name in unable and canary.by_default:
                continue  # said in step 1
            answers[name] = CanaryError(answer["error"]) if "error" in answer else answer["logprobs"]
            if answer.get("seconds") is not None:
                seconds[name] = float(answer["seconds"])
        if not answers and not canary.by_default:
            answers["rollout"] = CanaryError("no rollout worker answered the probe (every hook returned None)")
        judged = canary.set_aside(answers) if reference is not None else {}
        if judged:
            report = canary.judge(
                version, probe, reference, judged, dtypes=(dtype_of(module), wire_dtype), seconds=seconds, reference_s=reference_s
            )
            report.seconds = time.perf_counter() - started
            payload = _encode(report.as_dict())
    if trainers is not None and trainers.world_size > 1:
        with trainers.bounded(timeout_s):
            rows = trainers.all_gather_bytes(payload, "canary report", limit=PAYLOAD_LIMIT)
        told = json.loads(rows[0].decode() or "null")
        report = CanaryReport.from_dict(told) if told else None
        if report is not None:
            canary.last = report
    if report is None:  # (a trainer rank 0 without a sync group, or the default with no answer to judge)
        return None
    canary.enforce(report)
    return report


def _worth_a_forward(canary: Canary, unable: dict[str, str], *, rollouts: Any, trainers: Any, timeout_s: float) -> bool:
    """The default canary, after step 1: whether any rollout worker can answer (trainer rank
    0 says each one that cannot, once, grouped by reason), agreed by every trainer rank."""
    go = True
    if rollouts is not None:
        by_reason: dict[str, list[str]] = {}
        for name, why in unable.items():
            by_reason.setdefault(why, []).append(name)
        for why, names in by_reason.items():
            canary.not_checked(", ".join(names), why)
        go = len(unable) < rollouts.world_size - 1
    if trainers is not None and trainers.world_size > 1:
        with trainers.bounded(timeout_s):
            rows = trainers.all_gather_bytes(b"1" if go else b"0", "canary: whether any rollout worker answers", limit=PAYLOAD_LIMIT)
        go = rows[0] == b"1"  # trainer rank 0 heard the rollout workers
    return go


def rollout_answer(rollouts: Any, answer: Callable[[list[list[int]]], Any], *, timeout_s: float, refusal: str | None = None) -> bool:
    """A rollout worker's part after a completed update: say whether it has a way to answer
    (`refusal`: why not) and hear whether it is checked; if so, `answer(sequences)` (the
    engine's log-probs, or None: not this worker's to answer) and send it, or the error it
    raised. Returns whether the update was checked."""
    with rollouts.bounded(timeout_s):
        rows = rollouts.all_gather_bytes(_encode({"unable": refusal}) if refusal else b"", "canary probe", limit=PAYLOAD_LIMIT)
    message = json.loads(rows[0].decode())
    if not message.get("due"):
        return False
    began = time.perf_counter()
    try:
        got = answer([list(s) for s in message["probe"]])
        reply: dict[str, Any] = {"none": True} if got is None else {"logprobs": [[float(x) for x in row] for row in got]}
    except Exception as exc:  # the engine could not compute the probe: the trainer's report says so
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    reply["seconds"] = time.perf_counter() - began
    with rollouts.bounded(timeout_s):
        rollouts.all_gather_bytes(_encode(reply), "canary log-probs", limit=PAYLOAD_LIMIT)
    return True


def answer_refusal(settings: CanarySettings, adapter: Any) -> str | None:
    """Why this rollout worker has no way to answer the probe (no hook that loads, no
    `prompt_logprobs` method on its server adapter), or None."""
    if settings.engine_logprobs is not None:
        try:
            load_hook(settings.engine_logprobs)
        except ValueError as exc:
            return str(exc)
        return None
    if not callable(getattr(adapter, "prompt_logprobs", None)):
        return _no_method(adapter)
    return None


def _no_method(adapter: Any) -> str:
    return (
        f"the rollout worker's server adapter ({type(adapter).__name__}) has no prompt_logprobs(sequences) method "
        "and engine_kwargs['hal'].canary.engine_logprobs names no hook"
    )


def engine_answer(settings: CanarySettings, adapter: Any) -> Callable[[list[list[int]]], Any]:
    """How this rollout worker gets its engine's log-probs of a probe: the settings' hook
    called with `adapter` (verl's server adapter of this worker), else the adapter's own
    `prompt_logprobs(sequences)`. An awaitable result is run to completion on a thread of
    its own (verl calls `finalize` from its worker's event loop)."""
    if settings.engine_logprobs is not None:
        try:
            hook = load_hook(settings.engine_logprobs)
        except ValueError as exc:  # answered as this worker's error: the trainer's report names it
            failure = exc

            def ask(sequences: list[list[int]]) -> Any:
                raise failure

        else:

            def ask(sequences: list[list[int]]) -> Any:
                return hook(adapter, sequences)

    else:
        method = getattr(adapter, "prompt_logprobs", None)
        if not callable(method):
            reason = _no_method(adapter)

            def ask(sequences: list[list[int]]) -> Any:
                raise ValueError(reason)
        else:
            ask = method

    def answer(sequences: list[list[int]]) -> Any:
        result = ask(sequences)
        if inspect.isawaitable(result):
            import asyncio

            async def wait() -> Any:
                return await result

            result = in_daemon_thread("hal-verl-canary", lambda: asyncio.run(wait())).result()
        return result

    return answer


def load_hook(path: str) -> Callable[..., Any]:
    """The function "package.module:function" names; ValueError naming it when it is not one."""
    module_name, _, name = path.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"checkpoint engine 'hal': canary.engine_logprobs {path!r}: {type(exc).__name__}: {exc}") from None
    if not callable(function):
        raise ValueError(f"checkpoint engine 'hal': canary.engine_logprobs {path!r} is not callable")
    return function


class CanaryDuty:
    """The canary's part in the checkpoint engine "hal" on one worker, across updates: the
    update completed here since the last `finalize()` (`completed`), the check at
    `finalize()` (`check`: a trainer rank's `trainer_check`, a rollout worker's
    `rollout_answer`), and the last report's numbers for the next `send_weights` to return
    (`take_metrics`: verl drops what `finalize()` returns)."""

    def __init__(self, settings: CanarySettings, config: SyncConfig) -> None:
        self.settings = settings
        """`engine_kwargs["hal"]["canary"]` (hal.integrations.verl.settings.CanarySettings)."""
        self.timeout_s = settings.timeout_s or config.timeout_s
        self.wire_dtype = config.wire_dtype
        self.canary: Canary | None = Canary(settings.config, by_default=settings.by_default) if settings.enabled else None
        """The canary's state across updates (trainer ranks count and judge; rollout workers answer); None when off."""
        self.report: CanaryReport | None = None
        """The last check's report on a trainer rank."""
        self._version: int | None = None  # the update completed here since the last check
        self._metrics: dict[str, float] = {}  # the last report's, for the next send_weights to return

    def completed(self, version: int | None) -> None:
        """An update of `version` completed on this worker: the next `check` is of it."""
        self._version = version

    def take_metrics(self) -> dict[str, float]:
        """The last report's numbers, once (verl merges them into the next update's metrics)."""
        metrics, self._metrics = self._metrics, {}
        return metrics

    def check(self, role: str | None, rollouts: Any, *, worker: Any, engine: Any) -> None:
        """After an update (`finalize()`, on every worker at once): the canary, when on and
        due. `role` is the worker's ("trainer" or a rollout worker's); `rollouts` sync group
        0's channel (None on a trainer rank outside it); `worker` the verl worker that holds
        the checkpoint engine (a rollout worker's server adapter answers); `engine` a trainer
        rank's training engine (None: not found). In "enforce" mode a canary that fires
        raises `CanaryError` on every trainer rank, naming the rollout worker."""
        version, self._version = self._version, None
        if self.canary is None or version is None or role is None:
            return
        if role != "trainer":
            adapter = verl_internals.server_adapter(worker)
            answer = engine_answer(self.settings, adapter)
            rollout_answer(rollouts, answer, timeout_s=self.timeout_s, refusal=answer_refusal(self.settings, adapter))
            return
        trainers = trainer_channel() if dist.is_initialized() else None
        first = trainers is None or trainers.rank == 0  # trainer rank 0: sync rank 0 of group 0
        module, missing = None, None
        if engine is None:
            missing = "found no training engine (the checkpoint engine's worker holds none as `engine` or `actor.engine`)"
        else:
            missing = verl_internals.canary_refusal(engine)
            module = verl_internals.training_module(engine) if missing is None else None
        try:
            report = trainer_check(
                self.canary, module, version, rollouts=rollouts if first else None, trainers=trainers, timeout_s=self.timeout_s,
                wire_dtype=self.wire_dtype, missing=missing,
                on_device=(lambda: verl_internals.module_on_device(engine)) if module is not None else None,
            )
        except CanaryError as exc:
            self._reported(exc.report)
            raise CanaryError(f"checkpoint engine 'hal': {exc}", report=exc.report) from None
        if report is not None:
            self._reported(report)

    def _reported(self, report: CanaryReport | None) -> None:
        self.report = report
        if report is not None:
            self._metrics = report.as_metrics("checkpoint_engine/hal/canary/")
            self._metrics["checkpoint_engine/hal/canary/version"] = report.version
