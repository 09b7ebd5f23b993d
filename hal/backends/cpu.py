"""The CPU backend: real, synchronous, gloo collectives, shared-memory files for IPC.

Code here may assume nothing but a CPU build of torch. Work "launched on a stream"
runs at once on the calling thread, so streams and events are bookkeeping only;
the `sim` backend (sim.py) subclasses this one to make them asynchronous.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import stat
import tempfile
import threading
import time
import uuid
from typing import Any, Callable

import torch

from hal.backend import Backend, Event, Stream
from hal.backends._ipc import HandleReader, check_view, dtype_name


class ImmediateEvent:
    """An event on a synchronous device: complete as soon as it is recorded."""

    def __init__(self, timing: bool = False) -> None:
        self.timing = timing
        self._time: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: "ImmediateEvent") -> float:
        """Milliseconds from this event to `end_event`, as torch.cuda.Event reports it."""
        _check_timing(self, end_event)
        return (end_event._time - self._time) * 1000.0


def _check_timing(start: Any, end: Any) -> None:
    if not (start.timing and end.timing):  # ValueError, as torch.cuda.Event says it (torch >= 2.11)
        raise ValueError("elapsed_time needs both events created with timing=True")
    if start._time is None or end._time is None:
        raise RuntimeError("elapsed_time: both events must have been recorded and completed")


class ImmediateStream:
    """A stream on a synchronous device: every operation has already finished."""

    def wait_stream(self, stream: Stream) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def record_event(self, event: ImmediateEvent | None = None) -> ImmediateEvent:
        event = event or ImmediateEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


# The IPC handle of a tensor in a shared-memory file (JSON-safe; see `CpuBackend._export_ipc`):
#   kind            "shm"
#   file            the file's name inside the shm directory: SHM_PREFIX + pid + "-" + 12 hex digits
#   storage_nbytes  bytes of the file the exporter mapped (the whole `empty_shared` buffer)
#   byte_offset     where the tensor's first element lies in the file, in bytes
#   shape, stride   lists of ints, in elements, as torch reports them
#   dtype           torch attribute name of the dtype ("bfloat16"), from an allow-list
SHM_HANDLE_KIND = "shm"
# Every shared-memory file this backend creates is named with this prefix; import_ipc opens no other.
SHM_PREFIX = "verl-hal-"
_SHM_NAME = re.compile(re.escape(SHM_PREFIX) + r"[0-9]+-[0-9a-f]{12}")


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


# Shared-memory files this process created and has not released. Files in /dev/shm outlive
# their creator, so whatever is left at exit is removed then: no process can be served by
# an exporter that is gone. (Keyed by path; the pid guards against a forked child's exit.)
_UNRELEASED: dict[str, int] = {}
_UNRELEASED_LOCK = threading.Lock()


@atexit.register
def _remove_unreleased() -> None:
    with _UNRELEASED_LOCK:
        mine = [path for path, pid in _UNRELEASED.items() if pid == os.getpid()]
        _UNRELEASED.clear()
    for path in mine:
        with contextlib.suppress(OSError):
            os.unlink(path)


class CpuBackend(Backend):
    """Host memory and gloo: the backend every machine has."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    visible_devices_env = None
    ray_resource = None
    vendor = "cpu"  # host memory: no accelerator vendor
    supports_pinned_memory = False  # pinning needs an accelerator runtime
    supports_ipc = True  # through files in /dev/shm
    supports_async_streams = False

    def __init__(self) -> None:
        self._local = threading.local()
        self._default_stream = self._make_default_stream()
        self._shared_paths: dict[int, str] = {}  # storage data_ptr -> file, for export_ipc
        self._shared_lock = threading.Lock()

    def _make_default_stream(self) -> Any:
        return ImmediateStream()

    # devices: one, the host
    def _device_count(self) -> int:
        return 1

    def _current_device(self) -> int:
        return 0

    def _set_device(self, index: int) -> None:
        pass

    def _torch_device(self, index: int) -> torch.device:
        return torch.device("cpu")

    # streams
    def _new_stream(self) -> Any:
        return ImmediateStream()

    def _current_stream(self) -> Any:
        stack = getattr(self._local, "streams", None)
        return stack[-1] if stack else self._default_stream

    @contextlib.contextmanager
    def _stream_context(self, stream: Any):
        stack = self._local.__dict__.setdefault("streams", [])
        stack.append(stream)
        try:
            yield
        finally:
            stack.pop()

    def _new_event(self, timing: bool) -> Any:
        return ImmediateEvent(timing)

    def _launch(self, stream: Any, fn: Callable[..., Any], args: tuple) -> None:
        fn(*args)

    def _synchronize(self) -> None:
        pass

    def _device_manual_seed(self, seed: int, all_devices: bool) -> None:
        torch.manual_seed(seed)  # the device is the host: its generator is torch's CPU one

    # memory
    def _memory_info(self) -> tuple[int, int]:
        fields: dict[str, int] = {}
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    fields[key] = int(rest.split()[0]) * 1024
        except OSError:
            pass
        if "MemAvailable" in fields and "MemTotal" in fields:
            return fields["MemAvailable"], fields["MemTotal"]
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    # IPC through shared-memory files: any process on the node can map them by name.
    def _empty_shared(self, nbytes: int) -> torch.Tensor:
        path = os.path.join(_shm_dir(), f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
        tensor = torch.empty(0, dtype=torch.uint8).set_(storage)
        with self._shared_lock:
            self._shared_paths[storage.data_ptr()] = path
        with _UNRELEASED_LOCK:
            _UNRELEASED[path] = os.getpid()
        return tensor

    def _export_ipc(self, tensor: torch.Tensor) -> dict[str, Any]:
        storage = tensor.untyped_storage()
        with self._shared_lock:
            path = self._shared_paths.get(storage.data_ptr())
        if path is None or tensor.device.type != "cpu":
            raise ValueError(
                f"export_ipc: tensor of shape {tuple(tensor.shape)} is not in shared memory on "
                f"backend {self.name!r}; allocate it with empty_shared()"
            )
        return {
            "kind": SHM_HANDLE_KIND,
            "file": os.path.basename(path),
            "storage_nbytes": storage.nbytes(),
            "byte_offset": tensor.storage_offset() * tensor.element_size(),
            "shape": list(tensor.shape),
            "stride": list(tensor.stride()),
            "dtype": dtype_name(tensor.dtype, operation=f"export_ipc on backend {self.name!r}"),
        }

    def _import_ipc(self, handle: Any) -> torch.Tensor:
        reader = HandleReader(handle, backend=self.name, kind=SHM_HANDLE_KIND)
        name = reader.text("file")
        if not _SHM_NAME.fullmatch(name):
            reader.fail(
                "file",
                f"{name!r} is not the name of a shared-memory file of this backend "
                f"({SHM_PREFIX}<pid>-<12 hex digits>, a plain name without directories)",
            )
        storage_nbytes = reader.integer("storage_nbytes", minimum=1)
        byte_offset = reader.integer("byte_offset")
        shape = reader.integers("shape")
        stride = reader.integers("stride")
        dtype = reader.dtype("dtype")
        reader.done()
        check_view(reader, shape, stride, dtype.itemsize, byte_offset, storage_nbytes,
                   offset_field="byte_offset", size_field="storage_nbytes")

        directory = _shm_dir()
        path = os.path.join(directory, name)
        # The name has no directory part, so the file is in `directory`. Open it without
        # following a symlink, then check what was opened: a regular file at least as large
        # as the handle claims. The mapping below goes through this descriptor
        # (/proc/self/fd where it exists), so the file checked is the file mapped.
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise FileNotFoundError(f"import_ipc: shared-memory file {path} is gone (exporter released it)") from None
        except OSError as exc:
            reader.fail("file", f"{name!r} cannot be opened as a plain file in {directory}: {exc.strerror}")
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                reader.fail("file", f"{name!r} is not a regular file")
            if storage_nbytes > info.st_size:
                reader.fail("storage_nbytes", f"{storage_nbytes} overruns the file, which holds {info.st_size} bytes")
            by_fd = f"/proc/self/fd/{fd}"
            storage = torch.UntypedStorage.from_file(
                by_fd if os.path.exists(by_fd) else path, shared=True, nbytes=storage_nbytes
            )
        finally:
            os.close(fd)
        # Set the typed view directly on the storage: viewing the whole uint8 storage as
        # `dtype` first fails when its byte length is not a multiple of the element size.
        return torch.empty(0, dtype=dtype).set_(storage, byte_offset // dtype.itemsize, shape, stride)

    def _release_shared(self, tensor: torch.Tensor) -> None:
        with self._shared_lock:
            path = self._shared_paths.pop(tensor.untyped_storage().data_ptr(), None)
        if path is not None:
            with _UNRELEASED_LOCK:
                _UNRELEASED.pop(path, None)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
