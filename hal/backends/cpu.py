"""The CPU backend: real, synchronous, gloo collectives, anonymous shared memory (memfd) for IPC.

Code here may assume nothing but a CPU build of torch. Work "launched on a stream"
runs at once on the calling thread, so streams and events are bookkeeping only;
the `sim` backend (sim.py) subclasses this one to make them asynchronous.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
import time
import uuid
from typing import Any, Callable

import torch

from hal.backends.interface import Backend
from hal.backends.types import Event, Stream
from hal.backends._host_copies import HostCopies
from hal.backends._ipc import HandleReader, check_view, dtype_name


class ImmediateEvent:
    """An event on a synchronous device: complete as soon as it is recorded."""

    def __init__(self, timing: bool = False) -> None:
        self.timing = timing
        self.recorded_at: float | None = None
        """When the event completed (`time.perf_counter()`), None before."""

    def record(self, stream: Stream | None = None) -> None:
        self.recorded_at = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: "ImmediateEvent") -> float:
        """Milliseconds from this event to `end_event`, as torch.cuda.Event reports it."""
        return elapsed_ms(self, end_event)


def elapsed_ms(start: Any, end: Any) -> float:
    """Milliseconds between two completed host-timed events (`timing`, `recorded_at`), with
    torch.cuda.Event's errors: this backend's and the simulated one's `elapsed_time`."""
    if not (start.timing and end.timing):  # ValueError, as torch.cuda.Event says it (torch >= 2.11)
        raise ValueError("elapsed_time needs both events created with timing=True")
    if start.recorded_at is None or end.recorded_at is None:
        raise RuntimeError("elapsed_time: both events must have been recorded and completed")
    return (end.recorded_at - start.recorded_at) * 1000.0


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


# Shared memory is an anonymous memory file (memfd): it has no name in any directory, so
# nothing of it can outlive the processes that use it. The exporter keeps its descriptor
# open until `release_shared`; an importer reopens it through /proc/<pid>/fd/<fd> and maps
# it; the kernel frees the memory when the last descriptor and mapping go, on SIGKILL too.
# (A file in /dev/shm outlived a killed rank until reboot: issue 18.)
#
# The IPC handle of a tensor in such memory (JSON-safe; see `CpuBackend._export_ipc`):
#   kind            "shm"
#   name            the memory file's name: SHM_PREFIX + pid + "-" + 12 hex digits
#   pid, fd         the exporting process and its descriptor of the memory file
#   storage_nbytes  bytes of the file the exporter mapped (the whole `empty_shared` buffer)
#   byte_offset     where the tensor's first element lies in the file, in bytes
#   shape, stride   lists of ints, in elements, as torch reports them
#   dtype           torch attribute name of the dtype ("bfloat16"), from an allow-list
SHM_HANDLE_KIND = "shm"
# Every memory file this backend creates is named with this prefix; import_ipc maps no other.
SHM_PREFIX = "verl-hal-"
_SHM_NAME = re.compile(re.escape(SHM_PREFIX) + r"[0-9]+-[0-9a-f]{12}")
MAX_PID = 2**22  # the kernel's ceiling for pid_max (PID_MAX_LIMIT on 64-bit)
MAX_FD = 2**31 - 1


def _memfd_available() -> bool:
    """Linux with /proc: what same-node sharing on the host needs (memfd_create, and another
    process reopening the descriptor through /proc/<pid>/fd)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def _memfd_link(name: str) -> str:
    """What /proc/<pid>/fd/<fd> reads for an open memfd of this name (Linux's format)."""
    return f"/memfd:{name} (deleted)"


class CpuBackend(Backend):
    """Host memory and gloo: the backend every machine has."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    visible_devices_env = None
    ray_resource = None
    vendor = "cpu"  # host memory: no accelerator vendor
    supports_pinned_memory = False  # pinning needs an accelerator runtime
    supports_ipc = _memfd_available()  # anonymous memory files (memfd), reopened through /proc
    supports_async_streams = False

    def __init__(self) -> None:
        self._local = threading.local()
        self._default_stream = self._make_default_stream()
        self._shared_files: dict[int, tuple[str, int]] = {}  # storage data_ptr -> (name, fd), for export_ipc
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

    def _prepare_copies(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> HostCopies:
        return HostCopies(dsts, srcs)  # small pairs as byte copies (hal/backends/_host_copies.py)

    def _copy_prepared(self, stream: Any, handle: HostCopies) -> None:
        self._launch(stream, handle.run, ())  # sim: on the stream's worker thread

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

    # IPC through anonymous memory files: any process of this node and PID namespace maps them.
    def _empty_shared(self, nbytes: int) -> torch.Tensor:
        name = f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)
        except BaseException:
            os.close(fd)
            raise
        tensor = torch.empty(0, dtype=torch.uint8).set_(storage)
        with self._shared_lock:
            self._shared_files[storage.data_ptr()] = (name, fd)
        return tensor

    def _export_ipc(self, tensor: torch.Tensor) -> dict[str, Any]:
        storage = tensor.untyped_storage()
        with self._shared_lock:
            shared = self._shared_files.get(storage.data_ptr())
        if shared is None or tensor.device.type != "cpu":
            raise ValueError(
                f"export_ipc: tensor of shape {tuple(tensor.shape)} is not in shared memory on "
                f"backend {self.name!r}; allocate it with empty_shared()"
            )
        name, fd = shared
        return {
            "kind": SHM_HANDLE_KIND,
            "name": name,
            "pid": os.getpid(),
            "fd": fd,
            "storage_nbytes": storage.nbytes(),
            "byte_offset": tensor.storage_offset() * tensor.element_size(),
            "shape": list(tensor.shape),
            "stride": list(tensor.stride()),
            "dtype": dtype_name(tensor.dtype, operation=f"export_ipc on backend {self.name!r}"),
        }

    def _import_ipc(self, handle: Any) -> torch.Tensor:
        reader = HandleReader(handle, backend=self.name, kind=SHM_HANDLE_KIND)
        name = reader.text("name")
        if not _SHM_NAME.fullmatch(name):
            reader.fail("name", f"{name!r} is not the name of a shared-memory file of this backend ({SHM_PREFIX}<pid>-<12 hex digits>)")
        pid = reader.integer("pid", minimum=1, maximum=MAX_PID)
        fd = reader.integer("fd", minimum=0, maximum=MAX_FD)
        storage_nbytes = reader.integer("storage_nbytes", minimum=1)
        byte_offset = reader.integer("byte_offset")
        shape = reader.integers("shape")
        stride = reader.integers("stride")
        dtype = reader.dtype("dtype")
        reader.done()
        check_view(reader, shape, stride, dtype.itemsize, byte_offset, storage_nbytes,
                   offset_field="byte_offset", size_field="storage_nbytes")

        # Reopen the exporter's descriptor, then check what was opened, through our own
        # descriptor (the exporter's number may have been reused meanwhile): an anonymous
        # memory file of this backend with that name, at least as large as the handle says.
        # Anything else (a regular file, a socket, another program's memfd) is refused
        # before it is mapped. The mapping below goes through the descriptor checked.
        where = f"/proc/{pid}/fd/{fd}"
        try:
            ours = os.open(where, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"import_ipc: shared memory {name} is gone (process {pid} released it or exited)"
            ) from None
        except OSError as exc:
            reader.fail("fd", f"descriptor {fd} of process {pid} cannot be opened ({where}: {exc.strerror})")
        try:
            mine = f"/proc/self/fd/{ours}"
            if os.readlink(mine) != _memfd_link(name):
                reader.fail("name", f"descriptor {fd} of process {pid} is not the shared memory {name!r}")
            info = os.fstat(ours)
            if not stat.S_ISREG(info.st_mode):
                reader.fail("fd", f"descriptor {fd} of process {pid} is not a memory file")
            if storage_nbytes > info.st_size:
                reader.fail("storage_nbytes", f"{storage_nbytes} overruns the file, which holds {info.st_size} bytes")
            storage = torch.UntypedStorage.from_file(mine, shared=True, nbytes=storage_nbytes)
        finally:
            os.close(ours)
        # Set the typed view directly on the storage: viewing the whole uint8 storage as
        # `dtype` first fails when its byte length is not a multiple of the element size.
        return torch.empty(0, dtype=dtype).set_(storage, byte_offset // dtype.itemsize, shape, stride)

    def _release_shared(self, tensor: torch.Tensor) -> None:
        # The memory stays while any process still maps it; closing our descriptor means no
        # new process can open it.
        with self._shared_lock:
            shared = self._shared_files.pop(tensor.untyped_storage().data_ptr(), None)
        if shared is not None:
            with contextlib.suppress(OSError):
                os.close(shared[1])
