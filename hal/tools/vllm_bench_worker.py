"""Worker-side helpers for `hal bench --engine vllm` (a `worker_extension_cls`).

    LLM(..., worker_extension_cls="hal.tools.vllm_bench_worker.BenchWorkerExtension")

Adds, beside `HalWorkerExtension`'s methods, what the benchmark's baselines and
reference times need inside the worker process:

- `bench_reload_bytes(data)`: vLLM's reload from safetensors bytes that came through
  `collective_rpc` (the `rpc_bytes` baseline).
- `bench_time_apply(path)`: the engine's own apply time: the checkpoint at `path` is
  loaded into memory first (untimed), then `model_runner.reload_weights` is timed.
- `bench_floor_recv(nbytes)`: receive one flat `nbytes` broadcast on the hal group (the
  trainer times the matching send): the transport floor for the same bytes.
- `bench_last_metrics()`: the hal receiver's metrics of the last sync on this worker.
- `bench_refreshed_tied()`: the tied modules the hal engine refreshed after its last update.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import hal
from hal.integrations.vllm import internals as vllm_internals
from hal.integrations.vllm.extension import HalWorkerExtension


class BenchWorkerExtension(HalWorkerExtension):
    def _reload(self, pairs: Any) -> None:
        vllm_internals.reload_weights(self, pairs)

    def bench_reload_bytes(self, data: bytes) -> float:
        from safetensors.torch import load

        start = time.perf_counter()
        self._reload(iter(load(data).items()))
        return time.perf_counter() - start

    def bench_time_apply(self, path: str) -> float:
        from safetensors.torch import load_file

        tensors = load_file(path)
        start = time.perf_counter()
        self._reload(iter(tensors.items()))
        return time.perf_counter() - start

    def _native_engine(self) -> Any:
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not engine.connected:
            raise RuntimeError("bench: the native hal weight-transfer engine is not initialized on this worker")
        return engine

    def bench_floor_recv(self, nbytes: int, timeout_s: float = 120.0) -> float:
        group = self._native_engine().trainer_groups[0]
        buf = hal.current().empty(int(nbytes))
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = timedelta(seconds=timeout_s)
        flag = torch.zeros(1)
        group.broadcast([flag], opts).wait()  # both sides are here
        start = time.perf_counter()
        group.broadcast([buf], opts).wait()
        hal.current().synchronize()
        return time.perf_counter() - start

    def bench_refreshed_tied(self) -> list[str]:
        """The tied modules the native hal engine refreshed after its last update."""
        return list(self._native_engine().refreshed_tied)

    def bench_last_metrics(self) -> dict[str, Any] | None:
        metrics = getattr(self._native_engine(), "last_metrics", None)
        return None if metrics is None else metrics.as_dict()
