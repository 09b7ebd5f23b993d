"""vLLM's engines and workers as hal reaches them: the config of the worker building an
engine (vLLM 0.23-0.24), an offline `LLM`'s processes, settings and shutdown, a worker's
model and vLLM's own reload from tensors, and vLLM's tracebacks of a sync hal refused.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Iterator

import torch

from hal.integrations.vllm.internals.versions import engine_owns_updates, require_supported_vllm


# ---- the worker that builds an engine (vLLM 0.23-0.24) ---------------------------------------
def creating_worker_vllm_config(parallel_config: Any) -> Any:
    """The `VllmConfig` of the worker that is building a weight-transfer engine, for vLLM
    0.23-0.24, which hand the engine only `(config, parallel_config, model)`.

    Both workers that build one there, vLLM's `Worker.load_model` and vllm-ascend 0.23's
    `NPUWorker.load_model`, call `WeightTransferEngineFactory.create_engine(...,
    self.vllm_config.parallel_config, ...)` from a method of the worker, outside any
    `set_current_vllm_config` block. So the config is the worker's: the nearest caller on
    the stack whose `self.vllm_config.parallel_config` is the very object the engine was
    handed (identity, so another config can never be taken for it); vLLM's current config
    first, when one is set and it is that config's. RuntimeError naming what was looked for
    otherwise."""
    import sys

    from vllm.config import get_current_vllm_config_or_none

    current = get_current_vllm_config_or_none()
    if current is not None and getattr(current, "parallel_config", None) is parallel_config:
        return current
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        config = getattr(owner, "vllm_config", None)
        if config is not None and getattr(config, "parallel_config", None) is parallel_config:
            return config
        frame = frame.f_back
    raise RuntimeError(
        "hal weight transfer: vLLM built the engine as Engine(config, parallel_config, model) from no worker "
        "whose vllm_config holds that parallel_config; build it from the worker (load_model), or pass vllm_config="
    )


# ---- engines and workers ----------------------------------------------------------------------
def engine_process_ids(llm: Any) -> list[int]:
    """The processes an offline `LLM` started (their descendants are found from them): the
    engine core processes of the multi-process client
    (`engine_core.resources.engine_manager.processes`), or, with the engine core in this
    process (VLLM_ENABLE_V1_MULTIPROCESSING=0), its executor's worker processes
    (`engine_core.engine_core.model_executor.workers[i].proc`). Empty when it runs none."""
    client = llm.llm_engine.engine_core
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    if manager is not None:
        procs = list(getattr(manager, "processes", ()))
    else:
        executor = getattr(getattr(client, "engine_core", None), "model_executor", None)
        procs = [getattr(w, "proc", None) for w in getattr(executor, "workers", None) or ()]
    return [p.pid for p in procs if p is not None and p.pid is not None]


_RECORDED: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def record_llm_processes(llm: Any) -> None:
    """Record an offline `LLM`'s processes and the /dev/shm names they hold now, while all
    of them run (hal does when it is handed the `LLM`: `OfflineEngine`, `ExtensionEngine`):
    a worker that dies later (killed, crashed) takes its names with it from a record made
    at the stop, and `shutdown_llm` then unlinks them from this one. Once per `LLM`."""
    from hal.engine_processes import EngineProcesses

    if llm in _RECORDED:
        return
    try:
        _RECORDED[llm] = EngineProcesses.record(engine_process_ids(llm))
    except Exception:  # noqa: BLE001 - not an offline LLM of a known release: the stop records what it can
        pass


def shutdown_llm(llm: Any, timeout_s: float = 30.0) -> None:
    """Stop an offline `LLM`'s engine core now (`llm.llm_engine.engine_core.shutdown(timeout=)`)
    and leave nothing of it behind: without the stop, its processes outlive a test and exit
    prints logging errors. `timeout_s` is how long its processes get to exit before vLLM
    kills them (vLLM's own default, a few seconds, ran out for tensor-parallel workers on a
    loaded 2-core machine). A killed process leaves the shared memory it created
    (`psm_*`, `vllm_dist_*`) in /dev/shm, so the engine's processes and the names they hold
    are recorded first, and after vLLM's shutdown whatever is left of either is removed
    (hal.engine_processes), with what `record_llm_processes` recorded while they all ran."""
    from hal.engine_processes import EngineProcesses

    try:
        engine = EngineProcesses.record(engine_process_ids(llm))
    except Exception:  # noqa: BLE001 - an engine that failed to start has no processes to find
        engine = EngineProcesses()
    earlier = _RECORDED.pop(llm, None)  # a process dead by now is only in this one
    if earlier is not None:
        engine = earlier.merged(engine)
    try:
        llm.llm_engine.engine_core.shutdown(timeout=timeout_s)
    finally:
        engine.release()


def logprobs_mode(llm: Any) -> str:
    """What an offline `LLM` returns as log-probs (`llm.llm_engine.vllm_config.model_config.logprobs_mode`:
    "raw_logprobs" by default; the "*_logits" modes return logits instead). The canary
    (hal.integrations.vllm.canary) reads it before comparing an engine's prompt log-probs."""
    require_supported_vllm()
    return str(llm.llm_engine.vllm_config.model_config.logprobs_mode)


def lora_enabled(llm: Any) -> bool:
    """Whether an offline `LLM` serves LoRA adapters (`llm.llm_engine.vllm_config.lora_config`
    is set): the canary then avoids prompt log-probs (hal.integrations.vllm.canary)."""
    require_supported_vllm()
    return llm.llm_engine.vllm_config.lora_config is not None


def worker_closes_failed_updates(llm: Any) -> bool:
    """Whether an offline `LLM`'s workers end an update whose `update_weights` raised, so
    that a `finish_weight_update` after it is refused ("without a matching start"). From
    vLLM 0.25 on the engine owns an update and vLLM's worker ends a failed one. On 0.23-0.24
    the worker owns it: vLLM's own workers end it (`Worker.update_weights`; CPUWorker and
    the others inherit it), vllm-ascend 0.23's `NPUWorker` keeps it open until finish
    (tests/hosts/ reads both). A worker class of another package
    (`llm.llm_engine.vllm_config.parallel_config.worker_cls`) counts as keeping it open: a
    finish it refuses is only an error in the log, a start it refused would fail every sync after."""
    if engine_owns_updates():
        return True
    worker_cls = llm.llm_engine.vllm_config.parallel_config.worker_cls
    name = worker_cls if isinstance(worker_cls, str) else f"{worker_cls.__module__}.{worker_cls.__qualname__}"
    return name.startswith("vllm.")


def worker_model(worker: Any) -> torch.nn.Module:
    """The model a vLLM worker runs (`worker.model_runner.get_model()`)."""
    return worker.model_runner.get_model()


def reload_weights(worker: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """vLLM's own reload from tensors in a worker (`model_runner.reload_weights`)."""
    worker.model_runner.reload_weights(weights_iterator=weights)


# ---- vLLM's tracebacks of a refused sync -----------------------------------------------------
# Where vLLM logs a failed call to a worker, traceback and all (loggers are module paths, so
# private): the worker process's RPC loop, and the engine core's utility call, which sees the
# worker's error as text ("Worker failed with error '...'").
RPC_FAILURE_LOGS = (
    ("vllm.v1.executor.multiproc_executor", "WorkerProc hit an exception."),
    ("vllm.v1.engine.core", "Invocation of %s method failed"),
)
# vLLM's HTTP server runs under uvicorn, which logs an exception that left a route (a
# failed POST /update_weights) with its traceback, after vLLM's own one line for it
# ("Exception caught. Request id: ..."). uvicorn's, not vLLM's: no needs table reads it.
SERVER_FAILURE_LOG = ("uvicorn.error", "Exception in ASGI application\n")


class _RefusedSyncFilter(logging.Filter):
    """Drops the ERROR record, traceback and all, of a call that failed with an error whose
    text carries `mark`: a sync hal's engine refused and logged in one line
    (hal.integrations.vllm.engine). Any other record of the logger passes."""

    def __init__(self, message: str, mark: str) -> None:
        super().__init__()
        self.message, self.mark = message, mark

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (record.msg == self.message and exc is not None and self.mark in str(exc))


def quiet_refused_syncs(mark: str) -> None:
    """In this process, drop vLLM's tracebacks (`RPC_FAILURE_LOGS`, `SERVER_FAILURE_LOG`) of
    calls that failed with an error whose text carries `mark`. Idempotent."""
    for name, message in (*RPC_FAILURE_LOGS, SERVER_FAILURE_LOG):
        target = logging.getLogger(name)
        if not any(isinstance(f, _RefusedSyncFilter) and f.mark == mark for f in target.filters):
            target.addFilter(_RefusedSyncFilter(message, mark))
