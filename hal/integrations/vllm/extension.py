"""The hal engine as a `worker_extension_cls`, for vLLM builds without the native weight
transfer API (reached through `collective_rpc`):

    LLM(model=..., worker_extension_cls="hal.integrations.vllm.HalWorkerExtension")
    llm.collective_rpc("hal_init", kwargs={"init_info": {...}})
    llm.collective_rpc("hal_update", kwargs={"update_info": {"version": 3}})
"""

from __future__ import annotations

import importlib
from typing import Any

from vllm.config.weight_transfer import WeightTransferConfig

from hal.integrations.vllm import internals as vllm_internals
from hal.integrations.vllm.engine import BACKEND_NAME, ENGINE_CLASS, HalWeightTransferEngine


class HalWorkerExtension:
    """The same engine through `worker_extension_cls`, for vLLM builds without the native API.

        LLM(model=..., worker_extension_cls="hal.integrations.vllm.HalWorkerExtension")
        llm.collective_rpc("hal_init", kwargs={"init_info": {...}})
        llm.collective_rpc("hal_update", kwargs={"update_info": {"version": 3}})

    Methods are mixed into vLLM's worker, which provides `vllm_config`, `device` and
    `model_runner`.
    """

    def _hal_engine(self) -> HalWeightTransferEngine:
        engine = getattr(self, "_hal_weight_engine", None)
        if engine is None:
            config = WeightTransferConfig(backend=BACKEND_NAME)
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            if vllm_internals.engine_owns_updates():
                engine = HalWeightTransferEngine(config, self.vllm_config, self.device, model)  # type: ignore[attr-defined]
            else:  # vLLM 0.23-0.24's engine API; looked up as register() does (engine_v023 builds on this module)
                engine_v023 = getattr(importlib.import_module(ENGINE_CLASS[False][0]), ENGINE_CLASS[False][1])
                vllm_config = self.vllm_config  # type: ignore[attr-defined]
                engine = engine_v023(config, vllm_config.parallel_config, model, vllm_config=vllm_config)
            self._hal_weight_engine = engine
        return engine

    def hal_init(self, init_info: dict[str, Any]) -> None:
        engine = self._hal_engine()
        engine.init_transfer_engine(engine.parse_init_info(init_info))

    def hal_update(self, update_info: dict[str, Any]) -> int | None:
        engine = self._hal_engine()
        engine.start_weight_update()
        engine.update_weights(update_info)
        return engine.version

    def _connected_engine(self) -> HalWeightTransferEngine:
        """The hal engine a trainer is connected to: vLLM's native one (`backend="hal"`)
        when it is initialised, else this extension's own."""
        native = getattr(self, "weight_transfer_engine", None)
        if isinstance(native, HalWeightTransferEngine) and native.connected:
            return native
        return self._hal_engine()

    def hal_version(self) -> int | None:
        return self._hal_engine().version

    def hal_state(self) -> dict[str, Any]:
        """This worker's `version`, `consistent` and `torn` (see `HalWeightTransferEngine.state`)
        for the connection in use: vLLM's native hal engine when initialised, else this extension's."""
        return self._connected_engine().state()

    def hal_metrics(self) -> dict[str, Any] | None:
        """This worker's metrics of the last sync it took (`SyncMetrics.as_dict()`; `bytes`:
        what it received, its shard and replicated tensors under a shard receive), or None."""
        metrics = self._connected_engine().last_metrics
        return None if metrics is None else metrics.as_dict()

    def hal_shutdown(self) -> None:
        engine = getattr(self, "_hal_weight_engine", None)
        if engine is not None:
            engine.shutdown()
