"""The backend contract: what every device backend declares and does.

A backend is a class whose identity is its class attributes (vLLM's platform
classes are the model) plus a small set of operations. The public methods live
here and own validation and error messages; backends implement the underscore
hooks (tinygrad's `_alloc` / `_copyin` pattern). Code outside `hal/backends/`
asks a backend, never a device module directly.

Streams and events follow the method names of `torch.Stream` / `torch.Event`
(`wait_stream`, `wait_event`, `record_event`, `synchronize`, `query`;
`record`, `wait`, `query`, `synchronize`, `elapsed_time`), so the CUDA and NPU
backends hand out the torch objects unchanged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Protocol, runtime_checkable

import torch


class BackendUnavailableError(RuntimeError):
    """A known backend that cannot be used in this process; the message says why."""


@runtime_checkable
class Stream(Protocol):
    def wait_stream(self, stream: "Stream") -> None: ...
    def wait_event(self, event: "Event") -> None: ...
    def record_event(self, event: "Event | None" = None) -> "Event": ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...


@runtime_checkable
class Event(Protocol):
    def record(self, stream: Stream | None = None) -> None: ...
    def wait(self, stream: Stream | None = None) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end_event: "Event") -> float: ...


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """Device memory in bytes, as the backend's runtime reports it."""

    free: int
    total: int


class Backend:
    """Base of every backend. Subclasses set the class attributes and the hooks."""

    # The value of VERL_DEVICE that selects this backend.
    name: ClassVar[str] = ""
    # The torch device type of tensors this backend computes on ("cuda", "npu", "cpu").
    device_type: ClassVar[str] = ""
    # torch.distributed backend for tensors on this device (NCCL, HCCL or gloo).
    dist_backend: ClassVar[str] = ""
    # Environment variable that hides devices from a process (CUDA_VISIBLE_DEVICES, ...); None: none.
    visible_devices_env: ClassVar[str | None] = None
    # Ray resource name of one device ("GPU", "NPU"); None: Ray schedules it as CPU only.
    ray_resource: ClassVar[str | None] = None
    # Page-locked host memory exists, so host<->device copies from it can be asynchronous.
    supports_pinned_memory: ClassVar[bool] = False
    # A tensor in `empty_shared` memory can be opened by another process on the node without a copy.
    supports_ipc: ClassVar[bool] = False
    # Work launched on a stream runs asynchronously to the host; waits matter.
    supports_async_streams: ClassVar[bool] = False
    # A collective issued under a stream is ordered after that stream's earlier work
    # (NCCL/HCCL). When False (gloo) the host must wait for the work first.
    collectives_follow_streams: ClassVar[bool] = False
    # With one receiver, many send/recv pairs move bytes faster than as many broadcasts
    # (gloo runs each broadcast through its worker threads, ~1 ms each on a small host).
    point_to_point_transfers: ClassVar[bool] = False

    # ---- availability ---------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot be used in this process, or None when it can."""
        return None

    @classmethod
    def is_available(cls) -> bool:
        return cls.unavailable_reason() is None

    def __repr__(self) -> str:
        return f"<hal backend {self.name!r}>"

    # ---- devices --------------------------------------------------------------------
    def device_count(self) -> int:
        return self._device_count()

    def current_device(self) -> int:
        return self._current_device()

    def set_device(self, index: int, /) -> None:
        self._check_index(index)
        self._set_device(index)

    def device(self, index: int | None = None, /) -> torch.device:
        """The `torch.device` of device `index` (the current one when None)."""
        if index is None:
            index = self.current_device()
        self._check_index(index)
        return self._torch_device(index)

    def _check_index(self, index: int) -> None:
        count = self.device_count()
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
            raise ValueError(
                f"device index {index!r} out of range for backend {self.name!r}: "
                f"{count} device(s) visible"
            )

    # ---- streams and events ---------------------------------------------------------
    def new_stream(self) -> Stream:
        return self._new_stream()

    def current_stream(self) -> Stream:
        return self._current_stream()

    @contextlib.contextmanager
    def stream(self, stream: Stream | None, /) -> Iterator[Stream | None]:
        """Make `stream` current inside the block (no-op for None)."""
        if stream is None:
            yield None
            return
        with self._stream_context(stream):
            yield stream

    def new_event(self, *, timing: bool = False) -> Event:
        return self._new_event(timing)

    def launch(self, stream: Stream | None, fn: Callable[..., Any], /, *args: Any) -> None:
        """Run `fn(*args)` as device work ordered on `stream` (the current stream when None).

        On CUDA/NPU the call enqueues kernels and returns; on `sim` it runs later on the
        stream's worker thread; on the CPU it runs now. The result is not returned: device
        work communicates through the tensors it writes.
        """
        self._launch(stream, fn, args)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, /, *, stream: Stream | None = None) -> None:
        """`dst.copy_(src)` as device work on `stream`, casting dtype if they differ."""
        if dst.numel() != src.numel():
            raise ValueError(
                f"copy_: destination has {dst.numel()} elements, source {src.numel()} "
                f"(shapes {tuple(dst.shape)} and {tuple(src.shape)})"
            )
        if dst.shape != src.shape:
            src = src.reshape(dst.shape)
        self._launch(stream, _copy_non_blocking, (dst, src))

    def synchronize(self) -> None:
        """Wait for all work on every stream of the current device."""
        self._synchronize()

    # ---- memory ---------------------------------------------------------------------
    def empty_pinned(self, shape: tuple[int, ...] | int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A host tensor, page-locked where `supports_pinned_memory` (ordinary memory otherwise)."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"empty_pinned: negative dimension in shape {shape}")
        try:
            return self._empty_pinned(shape, dtype)
        except RuntimeError as exc:
            nbytes = _nbytes(shape, dtype)
            raise MemoryError(
                f"backend {self.name!r}: could not allocate {nbytes} bytes of pinned host memory: {exc}"
            ) from exc

    def empty(self, shape: tuple[int, ...] | int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """An uninitialised tensor on the current device."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        try:
            return torch.empty(shape, dtype=dtype, device=self.device())
        except RuntimeError as exc:
            raise MemoryError(
                f"backend {self.name!r}: could not allocate {_nbytes(shape, dtype)} bytes on "
                f"{self.device()}: {exc}"
            ) from exc

    def memory_info(self) -> MemoryInfo:
        free, total = self._memory_info()
        return MemoryInfo(free=int(free), total=int(total))

    def empty_cache(self) -> None:
        """Return cached, unused device memory to the runtime."""
        self._empty_cache()

    # ---- same-node sharing ----------------------------------------------------------
    def empty_shared(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 device tensor that `export_ipc` can hand to another process."""
        self._require("supports_ipc", "empty_shared")
        if nbytes <= 0:
            raise ValueError(f"empty_shared: nbytes must be positive, got {nbytes}")
        return self._empty_shared(int(nbytes))

    def export_ipc(self, tensor: torch.Tensor) -> Any:
        """A picklable handle another process on this node passes to `import_ipc`."""
        self._require("supports_ipc", "export_ipc")
        return self._export_ipc(tensor)

    def import_ipc(self, handle: Any) -> torch.Tensor:
        self._require("supports_ipc", "import_ipc")
        return self._import_ipc(handle)

    def release_shared(self, tensor: torch.Tensor) -> None:
        """Give back memory from `empty_shared` (the exporter calls this when done)."""
        self._release_shared(tensor)

    # ---- misc -----------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        """Seed torch's CPU generator and every device generator of this backend."""
        torch.manual_seed(seed)
        self._manual_seed(seed)

    def dist_backend_string(self, *, with_cpu: bool = True) -> str:
        """The `backend=` argument for `torch.distributed.init_process_group`.

        With `with_cpu` an accelerator gets the mixed form (`"cuda:nccl,cpu:gloo"`) so that
        CPU tensors (object collectives, barriers) work in the same group.
        """
        if with_cpu and self.device_type != "cpu" and self.dist_backend != "gloo":
            return f"{self.device_type}:{self.dist_backend},cpu:gloo"
        return self.dist_backend

    def describe(self) -> dict[str, Any]:
        """The declared attributes, for `hal info` and logs."""
        return {
            "name": self.name,
            "device_type": self.device_type,
            "dist_backend": self.dist_backend,
            "visible_devices_env": self.visible_devices_env,
            "ray_resource": self.ray_resource,
            "supports_pinned_memory": self.supports_pinned_memory,
            "supports_ipc": self.supports_ipc,
            "supports_async_streams": self.supports_async_streams,
            "collectives_follow_streams": self.collectives_follow_streams,
            "point_to_point_transfers": self.point_to_point_transfers,
        }

    def _require(self, capability: str, operation: str) -> None:
        if not getattr(self, capability):
            raise NotImplementedError(f"backend {self.name!r} does not support {operation} ({capability} is False)")

    # ---- hooks ----------------------------------------------------------------------
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

    def _export_ipc(self, tensor: torch.Tensor) -> Any:
        raise NotImplementedError

    def _import_ipc(self, handle: Any) -> torch.Tensor:
        raise NotImplementedError

    def _release_shared(self, tensor: torch.Tensor) -> None:
        pass

    def _manual_seed(self, seed: int) -> None:
        pass


def _copy_non_blocking(dst: torch.Tensor, src: torch.Tensor) -> None:
    # non_blocking only matters between pinned host and device memory; elsewhere it is ignored.
    dst.copy_(src, non_blocking=True)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n
