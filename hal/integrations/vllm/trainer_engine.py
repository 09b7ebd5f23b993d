"""hal behind vLLM's trainer-side factory: `WeightTransferTrainerFactory.trainer_init(HalTrainerInitInfo(...), client=..., source=...)`.

    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from hal.integrations.vllm.client import HalTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        HalTrainerInitInfo(rank=0, num_workers=1), client=HTTPVLLMWeightSyncClient(url), source=model)
    engine.send_weights(version=step)

A `WeightSync` of one engine underneath: `client` is any vLLM `VLLMWeightSyncClient`
(completed by `ClientEngine` with version read-back and the prefix-cache reset) or an
`Engine` of hal.integrations.vllm.engines. Importing this module registers "hal" in vLLM's
trainer factory (through hal.integrations.vllm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from hal.integrations.vllm.engine import BACKEND_NAME
from hal.integrations.vllm.engines import as_engine
from hal.integrations.vllm.weight_sync import SyncResult, WeightSync
from hal.sync import SyncConfig


@dataclass(kw_only=True)
class HalTrainerInitInfo(TrainerInitInfo):
    """`WeightTransferTrainerFactory.trainer_init(HalTrainerInitInfo(rank=0), client=..., source=model)`."""

    backend: ClassVar[str] = BACKEND_NAME
    num_workers: int = 1
    """The engine's workers (tensor x pipeline x data parallel size), for a client; an
    `Engine` passed as the client counts its own."""
    master_address: str = "127.0.0.1"
    master_port: int | None = None
    bucket_bytes: int | None = None
    verify: bool = False
    timeout_s: float = 120.0
    token: str | None = None
    """The engines' sync token (default: `VERL_HAL_SYNC_TOKEN`)."""


class HalTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    """vLLM's trainer-side engine interface over `WeightSync` (one client, rank 0 sends)."""

    init_info_cls = HalTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True, sync: WeightSync | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.sync_driver = sync
        self.step = 0

    @classmethod
    def trainer_init(cls, init_info: HalTrainerInitInfo, *, client: Any, source: Any = None) -> "HalTrainerWeightTransferEngine":
        if source is None:
            raise ValueError("hal trainer weight transfer needs a source (a module or hal/vLLM WeightSource)")
        if not init_info.is_sender:
            raise NotImplementedError("hal trainer weight transfer: only rank 0 sends; gather on the trainer first")
        driver = WeightSync(
            [as_engine(client, num_workers=init_info.num_workers)],
            config=SyncConfig(bucket_bytes=init_info.bucket_bytes, verify=init_info.verify, timeout_s=init_info.timeout_s),
            token=init_info.token,
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            timeout_s=init_info.timeout_s,
        )
        driver.init()
        return cls(client=client, source=source, sync=driver)

    def send_weights(self, version: int | None = None) -> SyncResult:
        """One full sync; `version` defaults to one more than the last."""
        if self.sync_driver is None:
            raise RuntimeError("hal trainer weight transfer: not initialized; create it with trainer_init()")
        self.step = self.step + 1 if version is None else version
        return self.sync_driver.sync(_VllmSourceAdapter.wrap(self.source), self.step)

    def shutdown(self) -> None:
        if self.sync_driver is not None:
            self.sync_driver.close()


class _VllmSourceAdapter:
    """A vLLM `WeightSource` (ParamMeta metadata) seen as a hal source (TensorSpec metadata)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    @classmethod
    def wrap(cls, source: Any) -> Any:
        """`source` as hal reads it: a vLLM `WeightSource` (metadata of vLLM's `ParamMeta`)
        wrapped, anything else (a module, a hal source, pairs) as it is."""
        import torch

        from hal.sync import TensorSpec, WeightSource

        if isinstance(source, torch.nn.Module) or not isinstance(source, WeightSource):
            return source
        meta = source.metadata()
        if meta and not isinstance(meta[0], TensorSpec):  # vLLM ParamMeta, not hal TensorSpec
            return cls(source)
        return source

    def metadata(self) -> list:
        from hal.sync import TensorSpec

        return [TensorSpec(m.name, tuple(m.shape), m.dtype) for m in self.source.metadata()]

    def __iter__(self):
        return iter(self.source)
