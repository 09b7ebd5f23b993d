"""Shared body of the backends whose runtime is a torch device module (torch.cuda, torch.npu).

Where torch's device-generic API covers a need (`torch.accelerator` for devices, the
current stream, synchronize and memory; `torch.Stream` / `torch.Event`, a stream being its
own context manager), it is used: when the backend's device type is torch's current
accelerator, which it is on a CUDA build with a GPU and with torch_npu imported. Otherwise
(and for what the generic API lacks: seeds, device names, IPC rebuild) the device module
`torch.get_device_module(device_type)` answers, `torch.cuda` or the module torch_npu
registers as `torch.npu`; both expose the same functions, so the CUDA and NPU backends
differ only in their declared attributes and in how they find out if they are usable.
Streams and events are handed out unchanged.

IPC goes through torch's own device-tensor reduction (`torch.multiprocessing.reductions.
reduce_tensor`, which torch_npu replaces for NPU tensors when it is imported), but its
result is written out as plain JSON fields instead of being pickled, and read back
through the device's public rebuild function (`rebuild_cuda_tensor`, torch_npu's
`rebuild_npu_tensor`) only after every field has been checked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import Any, Callable

import torch

from hal.backends.interface import Backend
from hal.backends.hooks import copy_many_non_blocking, copy_non_blocking
from hal.backends._ipc import HandleReader, check_view, dtype_name, to_hex
from hal.backends.process_files import remove_at_exit

# The arguments of torch's device-tensor reduction, in its order: `reduce_tensor(t)` returns
# `(rebuild, args)` with these, and `rebuild_cuda_tensor` / torch_npu's `rebuild_npu_tensor`
# take them (torch/multiprocessing/reductions.py, torch_npu/multiprocessing/reductions.py).
REDUCTION_ARGS = (
    "tensor_cls",
    "shape",
    "stride",
    "tensor_offset",
    "storage_cls",
    "dtype",
    "device",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
# The name torch gives the shared-memory file of IPC reference counters
# (at::NewProcessWideShmHandle: "/torch_<pid>_<random>_<counter>"; torch_npu uses the same).
# The receiver decrements a counter in that file, so a handle may name no other file.
_REF_COUNTER_NAME = re.compile(rb"/torch_[0-9]+_[0-9]+_[0-9]+")

logger = logging.getLogger(__name__)


# The integer dtype of each element size: a copy between two of them moves bits unchanged.
_BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_exact_pairs(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The pairs of a multi-tensor copy with every same-dtype pair viewed as integers of its
    element size. On the device torch's multi-tensor copy converts each element through
    its compute type (float for bf16, fp16, fp8): a NaN comes out as the canonical NaN, its
    sign and payload lost (seen on an H200, 2026-11-27: 0.3% of random bf16 bytes changed),
    where `copy_` moves the bits. A sync must land the trainer's bytes; a pair of two
    dtypes is a cast, which stays one. Views of the same memory and strides (any strides)."""
    out_dsts: list[torch.Tensor] = []
    out_srcs: list[torch.Tensor] = []
    bits = _BITS_OF_SIZE
    with torch.no_grad():  # a parameter's integer view cannot require grad
        for dst, src in zip(dsts, srcs):
            dtype = dst.dtype
            if dtype is src.dtype and (dtype.is_floating_point or dtype.is_complex):
                as_bits = bits.get(dtype.itemsize)
                if as_bits is not None:
                    dst, src = dst.view(as_bits), src.view(as_bits)
            out_dsts.append(dst)
            out_srcs.append(src)
    return out_dsts, out_srcs


class CapturedCopies:
    """Prepared copies recorded once as a device graph (`graph`), replayed on a stream per
    sync: one launch whatever the pair count. Keeps the pairs (views of the tensors) so that
    the memory the graph reads and writes stays allocated while it may run."""

    __slots__ = ("graph", "pairs")

    def __init__(self, graph: Any, pairs: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
        self.graph, self.pairs = graph, pairs


# Experimental: VERL_HAL_COPY_GRAPHS=1 makes `prepare_copies` on a backend that declares
# `copy_graph_class` record its copies as a device graph (docs/design.md, "Copies recorded
# as a graph"). Off by default until a lent GPU has measured and checked it.
COPY_GRAPHS_ENV = "VERL_HAL_COPY_GRAPHS"


class TorchDeviceBackend(Backend):
    supports_pinned_memory = True
    supports_ipc = True
    supports_async_streams = True
    # What the runtime leaves in /dev/shm for a process that exported device memory
    # (hal.backends.process_files): removed when that process ends.
    process_files: tuple[str, ...] = ()
    # The device module's graph class (`torch.cuda.CUDAGraph`) prepared copies may be
    # recorded with (COPY_GRAPHS_ENV); None: never recorded.
    copy_graph_class: str | None = None

    @property
    def module(self) -> Any:
        """`torch.cuda` / `torch.npu`, looked up on use so that tests can substitute it."""
        return torch.get_device_module(self.device_type)

    @property
    def generic(self) -> bool:
        """Whether torch's device-generic API speaks for this device: it is torch's current
        accelerator and its runtime answers (a PrivateUse1 device renamed without one, as
        the tests' stand-in for torch_npu, does not). Asked each time: cheap, and tests
        substitute the device module."""
        current = torch.accelerator.current_accelerator()
        if current is None or current.type != self.device_type:
            return False
        try:
            torch.accelerator.current_device_index()  # torch's runtime hooks for it, not Python's module
        except RuntimeError:  # "PyTorch is not linked with support for npu devices"
            return False
        return True

    def _device_count(self) -> int:
        return int(torch.accelerator.device_count() if self.generic else self.module.device_count())

    def _current_device(self) -> int:
        return int(torch.accelerator.current_device_index() if self.generic else self.module.current_device())

    def _set_device(self, index: int) -> None:
        if self.generic:
            torch.accelerator.set_device_index(index)
        else:
            self.module.set_device(index)

    def _new_stream(self) -> Any:
        return torch.Stream(device=self.device()) if self.generic else self.module.Stream()

    def _current_stream(self) -> Any:
        return torch.accelerator.current_stream() if self.generic else self.module.current_stream()

    def _stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        return stream if self.generic else self.module.stream(stream)  # a torch.Stream is its own context

    def _new_event(self, timing: bool) -> Any:
        return torch.Event(device=self.device(), enable_timing=timing) if self.generic else self.module.Event(enable_timing=timing)

    def _launch(self, stream: Any, fn: Callable[..., Any], args: tuple) -> None:
        if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args):
            # On host memory fn runs on the host, now, not behind the stream: let the
            # stream's earlier work (a device-to-host pack into that memory) finish first.
            (stream or self.module.current_stream()).synchronize()
        self._enqueue(stream, fn, args)

    def _copy(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        # a copy is ordered on the stream even with host memory at one end: no host wait
        self._enqueue(stream, copy_non_blocking, (dst, src))

    def _copy_many(self, stream: Any, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        self._enqueue(stream, copy_many_non_blocking, bit_exact_pairs(dsts, srcs))  # like _copy: ordered on the stream, no host wait

    def _prepare_copies(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Any:
        pairs = bit_exact_pairs(dsts, srcs)  # the views once per layout, not per sync
        if not (self.copy_graphs() and self._on_device(pairs)):
            return pairs
        graph = self._record(pairs)
        return pairs if graph is None else CapturedCopies(graph, pairs)

    def _copy_prepared(self, stream: Any, handle: Any) -> None:
        if isinstance(handle, CapturedCopies):
            self._enqueue(stream, handle.graph.replay, ())  # a graph launches on the current stream
        else:
            self._enqueue(stream, copy_many_non_blocking, handle)

    def copy_graphs(self) -> bool:
        """Whether `prepare_copies` records its copies as a device graph (COPY_GRAPHS_ENV)."""
        return self.copy_graph_class is not None and os.environ.get(COPY_GRAPHS_ENV, "0") == "1"

    def _on_device(self, pairs: tuple[list[torch.Tensor], list[torch.Tensor]]) -> bool:
        # a graph may hold only this device's memory (a copy to or from pinned host memory
        # would be recorded too, pageable memory would not: neither is tried)
        device_type = self.device_type
        return all(t.device.type == device_type for tensors in pairs for t in tensors)

    def _record(self, pairs: tuple[list[torch.Tensor], list[torch.Tensor]]) -> Any:
        """The multi-tensor copy of `pairs` recorded as a graph, or None where recording
        failed (the copies then run as they do without graphs; a warning says why)."""
        graph = getattr(self.module, self.copy_graph_class)()
        side = self._new_stream()  # recording needs a stream other than the legacy default
        try:
            with self._stream_context(side):
                # thread_local: other threads' work on the device (an engine, a trainer) is
                # neither recorded nor refused while this records
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    copy_many_non_blocking(*pairs)
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - any failure to record falls back, never fails a sync
            logger.warning(
                "backend %r: recording %d copies as a %s failed (%s: %s); they run as a multi-tensor copy instead",
                self.name, len(pairs[0]), self.copy_graph_class, type(exc).__name__, exc,
            )
            return None
        return graph

    def _enqueue(self, stream: Any, fn: Callable[..., Any], args: tuple) -> None:
        if stream is None:
            fn(*args)  # kernels go to the current stream
            return
        with self._stream_context(stream):
            fn(*args)

    def _synchronize(self) -> None:
        if self.generic:
            torch.accelerator.synchronize()
        else:
            self.module.synchronize()

    def _empty_pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def _memory_info(self) -> tuple[int, int]:
        return tuple(torch.accelerator.get_memory_info()) if self.generic else self.module.mem_get_info()

    def _empty_cache(self) -> None:
        if self.generic:
            torch.accelerator.empty_cache()
        else:
            self.module.empty_cache()

    def _empty_shared(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device())

    # ---- IPC: torch's reduction as JSON fields -----------------------------------------
    # The device handle (all fields JSON-safe; docs/device.md has the table):
    #   kind                  the device type ("cuda", "npu")
    #   device                index of the exporter's device
    #   storage_handle        hex of the runtime's memory handle of the allocation (None: empty storage)
    #   storage_size_bytes    bytes of the tensor's storage
    #   storage_offset_bytes  where that storage starts in the allocation
    #   ref_counter_handle    hex of the name of torch's reference-counter file ("/torch_<pid>_<n>_<n>")
    #   ref_counter_offset    this tensor's counter in that file
    #   event_handle          hex of the runtime's IPC event handle; the receiver waits on it
    #   event_sync_required   whether the receiver must wait on that event
    #   tensor_offset         the tensor's offset in its storage, in elements
    #   shape, stride         lists of ints, in elements
    #   dtype                 torch attribute name, from an allow-list
    #   requires_grad         bool
    def _ipc_rebuild_function(self) -> Callable[..., torch.Tensor]:
        """The public function that rebuilds a device tensor from `REDUCTION_ARGS`."""
        raise NotImplementedError(f"backend {self.name!r} names no IPC rebuild function")

    def _reduce_tensor(self, tensor: torch.Tensor) -> tuple[Callable[..., Any], tuple]:
        # Looked up on use: torch_npu replaces reduce_tensor when it is imported.
        from torch.multiprocessing import reductions

        return reductions.reduce_tensor(tensor)

    def _export_ipc(self, tensor: torch.Tensor) -> dict[str, Any]:
        where = f"export_ipc on backend {self.name!r}"
        if tensor.device.type != self.device_type:
            raise ValueError(f"{where}: tensor is on {tensor.device}, expected {self.device_type}")
        dtype = dtype_name(tensor.dtype, operation=where)
        rebuild, args = self._reduce_tensor(tensor)
        expected = self._ipc_rebuild_function()
        if rebuild is not expected or len(args) != len(REDUCTION_ARGS):
            raise RuntimeError(
                f"{where}: torch's reduce_tensor returned {getattr(rebuild, '__qualname__', rebuild)!r} with "
                f"{len(args)} arguments, expected {expected.__qualname__!r} with {len(REDUCTION_ARGS)}; "
                f"this torch's IPC layout is not supported (nested or sparse tensors never are)"
            )
        remove_at_exit(self.process_files)
        fields = dict(zip(REDUCTION_ARGS, args))
        if fields["storage_cls"] is not torch.storage.TypedStorage:
            raise RuntimeError(f"{where}: torch's reduce_tensor used storage class {fields['storage_cls']!r}, expected TypedStorage")
        sync = fields["event_sync_required"]
        return {
            "kind": self.device_type,
            "device": int(fields["device"]),
            "storage_handle": to_hex(fields["storage_handle"]),
            "storage_size_bytes": int(fields["storage_size_bytes"]),
            "storage_offset_bytes": int(fields["storage_offset_bytes"]),
            "ref_counter_handle": to_hex(fields["ref_counter_handle"]),
            "ref_counter_offset": int(fields["ref_counter_offset"]),
            "event_handle": to_hex(fields["event_handle"]),
            "event_sync_required": None if sync is None else bool(sync),
            "tensor_offset": int(fields["tensor_offset"]),
            "shape": [int(d) for d in fields["shape"]],
            "stride": [int(d) for d in fields["stride"]],
            "dtype": dtype,
            "requires_grad": bool(fields["requires_grad"]),
        }

    def _import_ipc(self, handle: Any) -> torch.Tensor:
        reader = HandleReader(handle, backend=self.name, kind=self.device_type)
        count = self.device_count()
        device = reader.integer("device", maximum=max(count - 1, 0))
        storage_handle = reader.hex_bytes("storage_handle", nullable=True)
        storage_size = reader.integer("storage_size_bytes")
        storage_offset = reader.integer("storage_offset_bytes")
        ref_counter_handle = reader.hex_bytes("ref_counter_handle", nullable=True)
        ref_counter_offset = reader.integer("ref_counter_offset")
        event_handle = reader.hex_bytes("event_handle", nullable=True)
        event_sync_required = reader.flag("event_sync_required", nullable=True)
        tensor_offset = reader.integer("tensor_offset")
        shape = reader.integers("shape")
        stride = reader.integers("stride")
        dtype = reader.dtype("dtype")
        requires_grad = reader.flag("requires_grad")
        reader.done()
        if device >= count:
            reader.fail("device", f"is {device}, but {count} device(s) are visible here")
        if storage_handle is None:
            if storage_size:
                reader.fail("storage_handle", f"is None for a storage of {storage_size} bytes")
        else:
            # torch's rebuild takes the sharing path: every piece it needs must be there.
            if not storage_handle:
                reader.fail("storage_handle", "is empty")
            if ref_counter_handle is None or not _REF_COUNTER_NAME.fullmatch(ref_counter_handle):
                reader.fail("ref_counter_handle", "does not name a torch IPC reference-counter file (/torch_<pid>_<n>_<n>)")
            if event_handle is None:
                reader.fail("event_handle", "is None for a shared storage")
            if event_sync_required is None:
                reader.fail("event_sync_required", "is None for a shared storage")
        if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
            reader.fail("requires_grad", f"is true for dtype {dtype}, which cannot require gradients")
        check_view(reader, shape, stride, dtype.itemsize, tensor_offset * dtype.itemsize, storage_size,
                   offset_field="tensor_offset", size_field="storage_size_bytes")
        rebuild = self._ipc_rebuild_function()
        return rebuild(
            torch.Tensor,  # a plain tensor; a Parameter is not rebuilt as one
            torch.Size(shape),
            stride,
            tensor_offset,
            torch.storage.TypedStorage,
            dtype,
            device,
            storage_handle,
            storage_size,
            storage_offset,
            requires_grad,
            ref_counter_handle,
            ref_counter_offset,
            event_handle,
            event_sync_required,
        )

    def _manual_seed(self, seed: int) -> None:
        self.module.manual_seed_all(seed)

    def _device_model(self, index: int) -> str | None:
        return self.module.get_device_name(index)

    def _device_manual_seed(self, seed: int, all_devices: bool) -> None:
        if all_devices:
            self.module.manual_seed_all(seed)
        else:
            self.module.manual_seed(seed)
