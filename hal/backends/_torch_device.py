"""Shared body of the backends whose runtime is a torch device module (torch.cuda, torch.npu).

`torch.get_device_module(device_type)` returns `torch.cuda` or the module torch_npu
registers as `torch.npu`; both expose the same functions, so the CUDA and NPU backends
differ only in their declared attributes and in how they find out if they are usable.
Streams and events are the module's own `Stream` / `Event` (subclasses of
`torch.Stream` / `torch.Event`), handed out unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from hal.backend import Backend


class TorchDeviceBackend(Backend):
    supports_pinned_memory = True
    supports_ipc = True
    supports_async_streams = True
    collectives_follow_streams = True

    @property
    def module(self) -> Any:
        """`torch.cuda` / `torch.npu`, looked up on use so that tests can substitute it."""
        return torch.get_device_module(self.device_type)

    def _device_count(self) -> int:
        return int(self.module.device_count())

    def _current_device(self) -> int:
        return int(self.module.current_device())

    def _set_device(self, index: int) -> None:
        self.module.set_device(index)

    def _new_stream(self) -> Any:
        return self.module.Stream()

    def _current_stream(self) -> Any:
        return self.module.current_stream()

    def _stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        return self.module.stream(stream)

    def _new_event(self, timing: bool) -> Any:
        return self.module.Event(enable_timing=timing)

    def _launch(self, stream: Any, fn: Callable[..., Any], args: tuple) -> None:
        if stream is None:
            fn(*args)  # kernels go to the current stream
            return
        with self.module.stream(stream):
            fn(*args)

    def _synchronize(self) -> None:
        self.module.synchronize()

    def _empty_pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def _memory_info(self) -> tuple[int, int]:
        return self.module.mem_get_info()

    def _empty_cache(self) -> None:
        self.module.empty_cache()

    def _empty_shared(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device())

    def _export_ipc(self, tensor: torch.Tensor) -> Any:
        # torch's own reduction: a device memory handle the receiving process rebuilds.
        from torch.multiprocessing.reductions import reduce_tensor

        if tensor.device.type != self.device_type:
            raise ValueError(f"export_ipc on backend {self.name!r}: tensor is on {tensor.device}, expected {self.device_type}")
        return reduce_tensor(tensor)

    def _import_ipc(self, handle: Any) -> torch.Tensor:
        rebuild, args = handle
        return rebuild(*args)

    def _manual_seed(self, seed: int) -> None:
        self.module.manual_seed_all(seed)
