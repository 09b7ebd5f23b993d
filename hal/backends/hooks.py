"""What a backend implements: the underscore hooks behind hal.backends.interface.Backend's public
methods (which validate, then call them), with their defaults: raise, or the answer for
host memory. A backend overrides what its device does differently (hal/backends/).
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, Callable

import torch

from hal.backends.types import Event, Stream


class BackendHooks:
    """The hooks; `Backend` subclasses this, and every backend subclasses `Backend`."""

    name: str
    device_type: str
    dist_backend: str
    vendor: str

    def _new_process_group(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        import torch.distributed as dist

        # ProcessGroupGloo, ProcessGroupNCCL, ProcessGroupMPI: the library's name in any case
        name = "ProcessGroup" + self.dist_backend.upper()
        cls = next((getattr(dist, n) for n in dir(dist) if n.lower() == name.lower()), None)
        if cls is None:
            raise ValueError(
                f"backend {self.name!r}: collective library {self.dist_backend!r}: torch.distributed has no {name} here "
                f"(is its package imported?)"
            )
        return cls(store, rank, size, timeout)

    def _device_count(self) -> int:
        raise NotImplementedError

    def _current_device(self) -> int:
        raise NotImplementedError

    def _set_device(self, index: int) -> None:
        raise NotImplementedError

    def _torch_device(self, index: int) -> torch.device:
        return torch.device(self.device_type, index)

    def _new_stream(self) -> Stream:
        raise NotImplementedError

    def _current_stream(self) -> Stream:
        raise NotImplementedError

    def _stream_context(self, stream: Stream) -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def _new_event(self, timing: bool) -> Event:
        raise NotImplementedError

    def _launch(self, stream: Stream | None, fn: Callable[..., Any], args: tuple) -> None:
        raise NotImplementedError

    def _copy(self, stream: Stream | None, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._launch(stream, copy_non_blocking, (dst, src))

    def _copy_many(self, stream: Stream | None, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        self._launch(stream, copy_many_non_blocking, (dsts, srcs))

    def _prepare_copies(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Any:
        # by default nothing is done ahead: the lists, run as one multi-tensor copy
        return dsts, srcs

    def _copy_prepared(self, stream: Stream | None, handle: Any) -> None:
        self._copy_many(stream, *handle)

    def _synchronize(self) -> None:
        raise NotImplementedError

    def _empty_pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def _memory_info(self) -> tuple[int, int]:
        raise NotImplementedError

    def _empty_cache(self) -> None:
        pass

    def _empty_shared(self, nbytes: int) -> torch.Tensor:
        raise NotImplementedError

    def _export_ipc(self, tensor: torch.Tensor) -> dict[str, Any]:
        raise NotImplementedError

    def _import_ipc(self, handle: Any) -> torch.Tensor:
        raise NotImplementedError

    def _release_shared(self, tensor: torch.Tensor) -> None:
        pass

    def _manual_seed(self, seed: int) -> None:
        pass

    def _device_manual_seed(self, seed: int, all_devices: bool) -> None:
        raise NotImplementedError

    def _vendor_name(self) -> str:
        return self.vendor

    def _device_model(self, index: int) -> str | None:
        return None  # host memory (cpu, sim): no device with a product name

    def _profiler_range(self, message: str) -> contextlib.AbstractContextManager | None:
        return None  # only CUDA has NVTX ranges

    def _profiler_control(self, start: bool) -> str | None:
        return f"backend {self.name!r} has no device profiler to {'start' if start else 'stop'}"

    def _set_allocator_settings(self, expandable_segments: bool) -> str | None:
        return f"backend {self.name!r} has no caching allocator with settings: nothing to configure"

    def _device_capability(self, index: int) -> tuple[int, int] | None:
        return None  # only CUDA devices have a compute capability

    def _runtime_versions(self) -> dict[str, str]:
        return {}

    def _supports_device_memory_ipc(self) -> bool:
        return False


def copy_non_blocking(dst: torch.Tensor, src: torch.Tensor) -> None:
    # non_blocking only matters between pinned host and device memory; elsewhere it is ignored.
    dst.copy_(src, non_blocking=True)


def copy_many_non_blocking(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    # Out of autograd: a sync may copy straight from parameters that require grad (a listed
    # source, hal.sync.plan.steady), and a copy into a buffer must not join their graph. Here, not
    # at the caller: a stream's worker thread (sim) has grad mode of its own.
    with torch.no_grad():
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
