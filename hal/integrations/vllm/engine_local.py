"""A vLLM engine in this process: an offline `LLM` (`OfflineEngine`), or one reached through
hal's worker extension (`ExtensionEngine`); and the weight version an `LLM` reports.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from hal.integrations.vllm import internals as vllm_internals
from hal.integrations.vllm.engine_clients import RecordedVersion

logger = logging.getLogger(__name__)

# The versions `OfflineEngine` kept for each offline LLM, where vLLM keeps none (before 0.27):
# shared by every adapter of one LLM, gone with it.
_LLM_VERSIONS: "weakref.WeakKeyDictionary[Any, RecordedVersion]" = weakref.WeakKeyDictionary()


def weight_version(llm: Any) -> str:
    """The weight version an offline `LLM` serves: vLLM's own (`llm.get_weight_version()`,
    0.27 on); before, the one hal's syncs established on it (`RecordedVersion`; "" before
    the first)."""
    if vllm_internals.keeps_weight_versions():
        return llm.get_weight_version()
    recorded = _LLM_VERSIONS.get(llm)
    return "" if recorded is None else recorded.get_weight_version()


# ---- hal's adapters, where vLLM has no client -----------------------------------------------
class OfflineEngine:
    """An offline `vllm.LLM` in this process (its workers may run in child processes)."""

    same_node = True  # its workers run on this machine, so buckets can be shared in memory

    def __init__(self, llm: Any, *, name: str = "llm", num_workers: int | None = None) -> None:
        self.llm = llm
        self.name = name
        self._update_open = False
        vllm_internals.record_llm_processes(llm)  # while every process runs: see shutdown_llm
        if num_workers is None:
            pc = llm.llm_engine.vllm_config.parallel_config
            num_workers = pc.world_size * max(1, getattr(pc, "data_parallel_size_local", 1) or 1)
        self.num_workers = num_workers

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        if self._update_open:
            self._end_failed_update()
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            self.llm.update_weights({"update_info": update_info})
        except BaseException:
            # vLLM 0.23-0.24: the worker owns the update; vLLM's own workers end a failed one,
            # vllm-ascend 0.23's NPUWorker keeps it open until finish_weight_update
            self._update_open = not vllm_internals.worker_closes_failed_updates(self.llm)
            raise

    def _end_failed_update(self) -> None:
        """Close an update whose `update_weights` failed before the next one starts (hal's engine
        already put every layer back). Not for vLLM's own workers, which closed it themselves
        and would refuse (with an error and a traceback in the engine's log)."""
        self._update_open = False
        try:
            self.llm.finish_weight_update()
        except Exception as exc:  # noqa: BLE001 - a worker of another platform that closed it after all
            logger.debug("engine %s: closing the failed update: %s", self.name, exc)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if vllm_internals.keeps_weight_versions():
            self.llm.finish_weight_update(weight_version)
            return
        self.llm.finish_weight_update()  # vLLM 0.23-0.26: no version; hal keeps it (RecordedVersion)
        if weight_version is not None:
            self.update_weight_version(weight_version)

    def update_weight_version(self, weight_version: str) -> None:
        if vllm_internals.keeps_weight_versions():
            self.llm.update_weight_version(weight_version)
        else:
            _LLM_VERSIONS.setdefault(self.llm, RecordedVersion()).update_weight_version(weight_version)

    def get_weight_version(self) -> str:
        return weight_version(self.llm)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def shutdown_weight_transfer_engine(self) -> None:
        if vllm_internals.engines_can_be_shut_down():  # vLLM 0.29-0.31 have no such call: the engine stays until exit
            self.llm.shutdown_weight_transfer_engine()


class ExtensionEngine:
    """An offline `LLM` started with `worker_extension_cls="hal.integrations.vllm.HalWorkerExtension"`.

    For vLLM builds without the native weight-transfer API: the same engine and transport,
    reached through `collective_rpc`. The version is tracked by the hal receiver on each
    worker (and mirrored into vLLM's weight version where that API exists).
    """

    same_node = True

    def __init__(self, llm: Any, *, name: str = "llm-ext", num_workers: int | None = None) -> None:
        self.llm = llm
        self.name = name
        self.num_workers = OfflineEngine(llm).num_workers if num_workers is None else num_workers
        vllm_internals.record_llm_processes(llm)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("hal_init", kwargs={"init_info": init_info})

    def start_weight_update(self) -> None:
        pass  # hal_update starts and finishes the layerwise reload itself

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("hal_update", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is not None:
            self.update_weight_version(weight_version)

    def update_weight_version(self, weight_version: str) -> None:
        setter = getattr(self.llm, "update_weight_version", None)  # absent in the builds this engine is for
        if callable(setter):
            setter(weight_version)

    def get_weight_version(self) -> str:
        versions = set(self.llm.collective_rpc("hal_version"))
        if len(versions) != 1:
            raise RuntimeError(f"engine {self.name}: workers hold different weight versions {sorted(map(str, versions))}")
        (version,) = versions
        return "" if version is None else str(version)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.collective_rpc("hal_shutdown")
