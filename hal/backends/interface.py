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
import datetime
import operator
from typing import Any, Callable, ClassVar, Iterator, Sequence

import torch

from hal.backends.hooks import BackendHooks, copy_many_non_blocking, copy_non_blocking
from hal.backends.runtime import RuntimeQuestions
from hal.backends.types import BackendUnavailableError, Event, MemoryInfo, PreparedCopies, Stream

__all__ = [
    "Backend", "BackendUnavailableError", "Event", "MemoryInfo", "PreparedCopies", "Stream", "copy_many_non_blocking", "copy_non_blocking",
]


class Backend(RuntimeQuestions, BackendHooks):
    """Base of every backend. Subclasses set the class attributes and the hooks
    (hal.backends.hooks: what a backend implements, with their defaults); what a device's
    runtime says of itself is hal.backends.runtime's."""

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
    # Who makes the device ("nvidia", "huawei"; "cpu" for host memory). A build can say
    # otherwise at run time (a ROCm torch on the cuda backend): ask `vendor_name()`.
    vendor: ClassVar[str] = ""
    # Page-locked host memory exists, so host<->device copies from it can be asynchronous.
    supports_pinned_memory: ClassVar[bool] = False
    # A tensor in `empty_shared` memory can be opened by another process on the node without a copy.
    supports_ipc: ClassVar[bool] = False
    # Work launched on a stream runs asynchronously to the host; waits matter.
    supports_async_streams: ClassVar[bool] = False
    # How collectives order and which transfers they prefer is a property of the collective
    # library, not of the device: `hal.backends.collectives.collective_traits(dist_backend)`.

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
        work communicates through the tensors it writes. Given a host tensor, fn runs on
        the host at once on CUDA/NPU too, so the stream is synchronized first: fn sees what
        the stream's earlier work wrote there (a device-to-host pack, say). `copy_` does
        not wait: a copy is ordered on the stream whichever memory it touches.
        """
        self._launch(stream, fn, args)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, /, *, stream: Stream | None = None) -> None:
        """`dst.copy_(src)` as device work on `stream`, casting dtype if they differ.

        The shapes must be equal: a source of another shape is refused with `ValueError`
        naming both, even when the element counts agree (a transposed (896, 4864) weight
        copied into (4864, 896) would otherwise land scrambled, silently). Reshape
        explicitly where a flat copy is meant.
        """
        if dst.numel() != src.numel():
            raise ValueError(
                f"copy_: destination has {dst.numel()} elements, source {src.numel()} "
                f"(shapes {tuple(dst.shape)} and {tuple(src.shape)})"
            )
        if dst.shape != src.shape:
            raise ValueError(
                f"copy_: destination has shape {tuple(dst.shape)}, source {tuple(src.shape)} "
                f"(same {dst.numel()} elements; reshape the source explicitly if a flat copy is meant)"
            )
        self._copy(stream, dst, src)

    def copy_many_(
        self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], /, *, stream: Stream | None = None, shapes_checked: bool = False
    ) -> None:
        """`dst.copy_(src)` for every pair, as one piece of device work on `stream` (torch's
        multi-tensor copy): a segment of thousands of small tensors costs one launch, not
        one per tensor. Casts dtypes like `copy_`, and like it moves a same-dtype pair bit for
        bit (NaN payloads and signs too, which torch's multi-tensor copy alone does not do on
        a GPU: hal.backends._torch_device.bit_exact_pairs); every pair must have equal shapes, which
        is checked unless the caller says it compared them already (`shapes_checked`: the
        sync does, against the specs, for every tensor it packs or hands over)."""
        _check_pairs("copy_many_", dsts, srcs, shapes_checked)
        if dsts:
            self._copy_many(stream, list(dsts), list(srcs))

    def prepare_copies(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], /, *, shapes_checked: bool = False) -> PreparedCopies:
        """The pairs of a `copy_many_`, made ready once to run many times (`copy_prepared_`):
        a sync copies the same pairs every time its layout repeats, and what this backend
        does per pair to launch them is then done once (the host backend takes a view of
        each small tensor's bytes, copied without torch's cost per tensor). It holds the
        tensors and stays valid while each keeps its memory: the same address and strides
        (hal.sync.plan.steady checks that before running one again). Shapes as for `copy_many_`."""
        _check_pairs("prepare_copies", dsts, srcs, shapes_checked)
        return PreparedCopies(self.name, len(dsts), self._prepare_copies(list(dsts), list(srcs)))

    def copy_prepared_(self, prepared: PreparedCopies, /, *, stream: Stream | None = None) -> None:
        """Run copies made ready by `prepare_copies` of this backend, as one piece of device work on `stream`."""
        if prepared.backend != self.name:
            raise ValueError(f"copy_prepared_: copies prepared by backend {prepared.backend!r}, run on {self.name!r}")
        if prepared.count:
            self._copy_prepared(stream, prepared.handle)

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

    def export_ipc(self, tensor: torch.Tensor) -> dict[str, Any]:
        """A JSON-safe handle to `tensor` that another process on this node passes to `import_ipc`.

        The handle is a dict of str, int, bool, None and lists of those (bytes as hex
        strings, the dtype as its torch attribute name), so it can travel as JSON and the
        receiver never unpickles anything. Its `"kind"` names the format: `"shm"` for a
        shared-memory file (cpu, sim), the device type for device memory (cuda, npu).
        docs/device.md lists the fields. The tensor must come from `empty_shared` (or be a
        view of it) on cpu/sim; on cuda/npu any tensor on the backend's device will do.
        """
        self._require("supports_ipc", "export_ipc")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"export_ipc on backend {self.name!r}: expected a tensor, got {type(tensor).__name__}")
        handle = self._export_ipc(tensor)
        _check_json_safe(handle, f"export_ipc on backend {self.name!r}: handle")
        return handle

    def import_ipc(self, handle: dict[str, Any]) -> torch.Tensor:
        """The tensor an `export_ipc` handle names, sharing the exporter's memory.

        The handle is untrusted input: every field is checked (type, range, that the view
        lies inside the shared memory, the dtype against an allow-list, and on cpu/sim that
        the file is a plain file of this backend's shared-memory directory) before any
        memory is opened. A malformed or hostile handle raises `ValueError` naming the
        field; a well-formed one whose file the exporter has released raises
        `FileNotFoundError`.
        """
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

    def device_manual_seed(self, seed: int, /, *, all_devices: bool = False) -> None:
        """Seed the device's generator only: the current device's, or every device's with
        `all_devices`. On the CPU and sim backends the device generator is torch's CPU
        generator. (`manual_seed` seeds torch's CPU generator and every device at once.)"""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"device_manual_seed: seed must be an int, got {type(seed).__name__} {seed!r}")
        self._device_manual_seed(seed, bool(all_devices))

    def dist_backend_string(self, *, with_cpu: bool = True) -> str:
        """The `backend=` argument for `torch.distributed.init_process_group`.

        With `with_cpu` an accelerator gets the mixed form (`"cuda:nccl,cpu:gloo"`) so that
        CPU tensors (object collectives, barriers) work in the same group.
        """
        if with_cpu and self.device_type != "cpu" and self.dist_backend != "gloo":
            return f"{self.device_type}:{self.dist_backend},cpu:gloo"
        return self.dist_backend

    def control_device(self, dist_backend: str | None = None) -> torch.device:
        """Where a sync group's control messages live, for a group of `dist_backend` (by
        default this backend's own): host memory where the group's library takes it
        (`hal.backends.collectives.control_on_host`), else this backend's device."""
        from hal.backends.collectives import control_on_host

        library = self.dist_backend if dist_backend is None else dist_backend
        return torch.device("cpu") if control_on_host(library) else self.device()

    def new_process_group(self, store: Any, rank: int, size: int, timeout: datetime.timedelta, /) -> Any:
        """A `dist_backend` group object of `size` ranks over `store`, outside c10d's registry
        (what hal's sync group is: `hal.sync.wire.group.join_sync_group`). Every rank calls it;
        `timeout` bounds each collective. The default is torch.distributed's
        `ProcessGroup<NAME>(store, rank, size, timeout)`; a backend whose library's class lives
        elsewhere, or takes an options object, builds it its own way (the npu backend).
        ValueError naming the library when torch.distributed has no such class."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"backend {self.name!r}: new_process_group: size must be an int >= 1, got {size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"backend {self.name!r}: new_process_group: rank {rank!r} is not a rank of a group of {size}")
        if not isinstance(timeout, datetime.timedelta) or timeout <= datetime.timedelta(0):
            raise ValueError(f"backend {self.name!r}: new_process_group: timeout must be a positive timedelta, got {timeout!r}")
        return self._new_process_group(store, rank, size, timeout)

    def describe(self) -> dict[str, Any]:
        """The declared attributes, for `hal info` and logs (JSON-safe).

        `collective_traits` holds the traits of `dist_backend` as
        `hal.backends.collectives.collective_traits` gives them (`follows_streams`,
        `point_to_point_for_one_receiver`).
        """
        from dataclasses import asdict

        # Imported here: `import hal` imports no module of hal.backends.
        from hal.backends.collectives import collective_traits

        return {
            "name": self.name,
            "device_type": self.device_type,
            "dist_backend": self.dist_backend,
            "visible_devices_env": self.visible_devices_env,
            "ray_resource": self.ray_resource,
            "supports_pinned_memory": self.supports_pinned_memory,
            "supports_ipc": self.supports_ipc,
            "supports_async_streams": self.supports_async_streams,
            "collective_traits": asdict(collective_traits(self.dist_backend)),
        }

    def _require(self, capability: str, operation: str) -> None:
        if not getattr(self, capability):
            raise NotImplementedError(f"backend {self.name!r} does not support {operation} ({capability} is False)")


def _check_json_safe(value: Any, where: str) -> None:
    """TypeError unless `value` is made of dicts (str keys), lists, str, int, bool and None only."""
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json_safe(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: key {key!r} is not a str")
            _check_json_safe(item, f"{where}[{key!r}]")
        return
    raise TypeError(f"{where}: a {type(value).__name__} is not JSON-safe (dict, list, str, int, bool or None only)")


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


_shape_of = operator.attrgetter("shape")


def _check_pairs(what: str, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], shapes_checked: bool) -> None:
    """Refuse pairs a multi-tensor copy cannot take, naming the pair. torch's multi-tensor
    copy broadcasts like copy_, so shapes are compared here, one pair at a time inside `map`
    (a list of thousands of shapes alive at once would set off the garbage collector, which
    costs more than the copy); the loop only names the pair. `shapes_checked`: the caller
    compared them already (the sync does, against the specs)."""
    if len(dsts) != len(srcs):
        raise ValueError(f"{what}: {len(dsts)} destinations for {len(srcs)} sources")
    if not shapes_checked and any(map(operator.ne, map(_shape_of, dsts), map(_shape_of, srcs))):
        for i, (dst, src) in enumerate(zip(dsts, srcs)):
            if dst.shape != src.shape:
                raise ValueError(f"{what}: pair {i}: destination has shape {tuple(dst.shape)}, source {tuple(src.shape)}")
