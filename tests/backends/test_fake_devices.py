"""The cuda and npu backends against fake device modules, on a machine with neither.

CUDA: `torch.cuda`'s functions and `torch.version.cuda` are monkeypatched in this process.
NPU: a fake `torch_npu` package (tests/conftest.py, FAKE_TORCH_NPU) renames PrivateUse1 to
"npu", which lasts for the rest of the process, so those checks run in a subprocess and
report back as JSON.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import platform

import pytest
import torch
from torch.multiprocessing import reductions

import hal
from hal import BackendUnavailableError
from hal.backends.cuda import CudaBackend
from hal.backends.npu import NpuBackend
from tests.conftest import run_python


class FakeStream:
    """Stands in for torch.cuda.Stream: only its identity matters to these tests."""


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing


class FakeCuda:
    """Enough of torch.cuda for the backend; calls that change state are logged in `calls`."""

    def __init__(self, count: int = 2) -> None:
        self.count = count
        self.index = 0
        self.calls: list[tuple] = []
        self.default_stream = self.current = FakeStream()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.version, "cuda", "12.8")
        for name, value in {
            "is_available": lambda: True,
            "device_count": lambda: self.count,
            "current_device": lambda: self.index,
            "set_device": self._set_device,
            "Stream": FakeStream,
            "Event": FakeEvent,
            "current_stream": lambda device=None: self.current,
            "stream": self._stream,
            "synchronize": lambda device=None: self.calls.append(("synchronize",)),
            "mem_get_info": lambda device=None: (5 * 2**30, 80 * 2**30),
            "empty_cache": lambda: self.calls.append(("empty_cache",)),
            "manual_seed_all": lambda seed: self.calls.append(("manual_seed_all", seed)),
            "get_device_capability": lambda device=None: {0: (8, 0), 1: (9, 0)}[device],
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(torch.version, "hip", None)
        # The allocator setters: torch's device-generic private one, and the older CUDA one.
        monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", self._log("allocator"), raising=False)
        monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", self._log("cuda.memory allocator"))

    def _log(self, name: str):
        return lambda *args: self.calls.append((name, *args))

    def _set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))
        self.index = index

    @contextlib.contextmanager
    def _stream(self, stream):
        saved, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = saved


@pytest.fixture
def fake_cuda(monkeypatch, hal_reset):
    fake = FakeCuda()
    fake.install(monkeypatch)
    return fake


# ---- CUDA, in process -------------------------------------------------------------


def test_fake_cuda_resolves_under_auto(fake_cuda, monkeypatch):
    assert CudaBackend.unavailable_reason() is None
    res = hal.resolve("auto")
    assert res.backend.name == "cuda"
    assert res.reason == "auto: cuda is the only usable accelerator"
    monkeypatch.setenv("VERL_DEVICE", "auto")
    assert hal.current().name == "cuda"


def test_fake_cuda_names(fake_cuda):
    backend = hal.get_backend("cuda")
    assert backend.device_type == "cuda"
    assert backend.dist_backend == "nccl"
    assert backend.visible_devices_env == "CUDA_VISIBLE_DEVICES"
    assert backend.ray_resource == "GPU"
    assert backend.dist_backend_string() == "cuda:nccl,cpu:gloo"
    assert backend.dist_backend_string(with_cpu=False) == "nccl"
    assert backend.supports_pinned_memory and backend.supports_ipc and backend.supports_async_streams
    assert backend.describe()["collective_traits"] == {"follows_streams": True, "point_to_point_for_one_receiver": False, "point_to_point_device_memory": True}


def test_fake_cuda_devices(fake_cuda):
    backend = hal.get_backend("cuda")
    assert backend.device_count() == 2
    backend.set_device(1)
    assert fake_cuda.calls[-1] == ("set_device", 1)
    assert backend.current_device() == 1
    assert backend.device() == torch.device("cuda", 1)
    assert backend.device(0) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="device index 2 out of range for backend 'cuda': 2 device"):
        backend.set_device(2)
    assert ("set_device", 2) not in fake_cuda.calls  # validated before reaching the runtime


def test_fake_cuda_streams_and_events(fake_cuda):
    backend = hal.get_backend("cuda")
    stream = backend.new_stream()
    assert isinstance(stream, FakeStream)
    assert backend.current_stream() is fake_cuda.default_stream
    with backend.stream(stream):
        assert backend.current_stream() is stream
    assert backend.current_stream() is fake_cuda.default_stream
    seen = []
    backend.launch(stream, lambda: seen.append(backend.current_stream()))
    assert seen == [stream]  # the work ran with the stream current
    backend.launch(None, lambda: seen.append(backend.current_stream()))
    assert seen[-1] is fake_cuda.default_stream
    assert backend.new_event(timing=True).enable_timing is True
    assert backend.new_event().enable_timing is False


def test_fake_cuda_runtime_calls(fake_cuda):
    backend = hal.get_backend("cuda")
    backend.synchronize()
    backend.empty_cache()
    backend.manual_seed(7)
    assert ("synchronize",) in fake_cuda.calls
    assert ("empty_cache",) in fake_cuda.calls
    assert ("manual_seed_all", 7) in fake_cuda.calls
    assert backend.memory_info() == hal.MemoryInfo(free=5 * 2**30, total=80 * 2**30)


class FakeGenericStream:
    """Stands in for torch.Stream: records the device it was made for, is its own context."""

    def __init__(self, runtime: "FakeAccelerator", device: torch.device) -> None:
        self.runtime, self.device = runtime, device

    def __enter__(self) -> "FakeGenericStream":
        self.saved, self.runtime.current = self.runtime.current, self
        return self

    def __exit__(self, *exc) -> None:
        self.runtime.current = self.saved


class FakeAccelerator:
    """torch's device-generic API (torch.accelerator, torch.Stream, torch.Event) speaking for
    a fake CUDA, as on a CUDA build with a GPU; every call is logged."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple] = []
        self.index, self.current = 0, None
        acc = torch.accelerator
        for name, value in {
            "current_accelerator": lambda check_available=False: torch.device("cuda"),
            "current_device_index": lambda: self.index,
            "device_count": lambda: 3,
            "set_device_index": lambda i: (self.calls.append(("set_device_index", i)), setattr(self, "index", i)),
            "current_stream": lambda device=None: self.current,
            "synchronize": lambda device=None: self.calls.append(("synchronize",)),
            "get_memory_info": lambda device=None: (7 * 2**30, 96 * 2**30),
            "empty_cache": lambda: self.calls.append(("empty_cache",)),
        }.items():
            monkeypatch.setattr(acc, name, value)
        monkeypatch.setattr(torch, "Stream", lambda device=None, priority=0: FakeGenericStream(self, device))
        monkeypatch.setattr(torch, "Event", lambda device=None, enable_timing=False: ("event", device, enable_timing))


def test_fake_cuda_through_torchs_device_generic_api(fake_cuda, monkeypatch):
    """Where torch's current accelerator is the backend's device, torch.accelerator,
    torch.Stream and torch.Event answer, not the device module (whose calls are logged
    in fake_cuda.calls and must not appear)."""
    generic = FakeAccelerator(monkeypatch)
    backend = hal.get_backend("cuda")
    assert backend.generic and backend.device_count() == 3
    backend.set_device(2)
    assert generic.calls[-1] == ("set_device_index", 2) and backend.current_device() == 2
    stream = backend.new_stream()
    assert isinstance(stream, FakeGenericStream) and stream.device == torch.device("cuda", 2)
    seen = []
    backend.launch(stream, lambda: seen.append(backend.current_stream()))
    assert seen == [stream] and backend.current_stream() is None  # the stream was current for the work only
    assert backend.new_event(timing=True) == ("event", torch.device("cuda", 2), True)
    backend.synchronize()
    backend.empty_cache()
    assert backend.memory_info() == hal.MemoryInfo(free=7 * 2**30, total=96 * 2**30)
    assert ("synchronize",) in generic.calls and ("empty_cache",) in generic.calls
    assert not [c for c in fake_cuda.calls if c[0] in ("set_device", "synchronize", "empty_cache")]
    backend.manual_seed(3)  # what the generic API lacks still goes to the device module
    assert fake_cuda.calls[-1] == ("manual_seed_all", 3)


def test_fake_cuda_ipc_rejects_host_tensor(fake_cuda):
    backend = hal.get_backend("cuda")
    with pytest.raises(ValueError, match="export_ipc on backend 'cuda': tensor is on cpu, expected cuda"):
        backend.export_ipc(torch.zeros(2))


# ---- CUDA runtime questions ----------------------------------------------------------


def test_fake_cuda_allocator_settings(fake_cuda, monkeypatch):
    backend = hal.get_backend("cuda")
    assert backend.set_allocator_settings(expandable_segments=True) is None
    assert fake_cuda.calls[-1] == ("allocator", "expandable_segments:True")
    with pytest.raises(ValueError, match="expandable_segments must be a bool, got int 1"):
        backend.set_allocator_settings(expandable_segments=1)
    assert len(fake_cuda.calls) == 1  # refused before reaching the runtime
    # A torch without the device-generic setter: the CUDA one.
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings")
    assert backend.set_allocator_settings(expandable_segments=False) is None
    assert fake_cuda.calls[-1] == ("cuda.memory allocator", "expandable_segments:False")


def test_fake_cuda_device_capability(fake_cuda):
    backend = hal.get_backend("cuda")
    assert backend.device_capability(1) == (9, 0)
    assert backend.device_capability() == (8, 0)  # the current device
    backend.set_device(1)
    assert backend.device_capability() == (9, 0)
    with pytest.raises(ValueError, match="device index 2 out of range for backend 'cuda'"):
        backend.device_capability(2)


def test_fake_cuda_runtime_versions_and_ipc(fake_cuda, monkeypatch):
    backend = hal.get_backend("cuda")
    assert backend.runtime_versions() == {"cuda": "12.8"}
    assert backend.supports_device_memory_ipc() is True
    monkeypatch.setattr(torch.version, "hip", "6.2")  # a ROCm build
    assert backend.runtime_versions() == {"hip": "6.2"}
    assert backend.supports_device_memory_ipc() is False


# ---- CUDA IPC handles: torch's reduction as JSON, with a fake reduction ----------------


class OnCuda(torch.Tensor):
    """A host tensor that reports itself on cuda:0, so export_ipc takes its device path on a CPU build."""

    @property
    def device(self):
        return torch.device("cuda", 0)


REF_COUNTER = b"/torch_4242_17_0"


class FakeReduction:
    """Stands in for torch's CUDA `reduce_tensor` / `rebuild_cuda_tensor`, in the same argument
    layout: a random 64-byte "memory handle" names a host storage in `shared`, as a CUDA IPC
    handle names an allocation, so a rebuilt tensor really shares the exporter's memory."""

    def __init__(self) -> None:
        self.shared: dict[bytes, torch.UntypedStorage] = {}
        self.rebuilt: list[tuple] = []
        self.rebuild = self._rebuild  # one object, so that `is` identifies it

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(reductions, "reduce_tensor", self.reduce_tensor)
        monkeypatch.setattr(reductions, "rebuild_cuda_tensor", self.rebuild)

    def reduce_tensor(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        handle = os.urandom(64)
        self.shared[handle] = storage
        args = (
            type(tensor), tensor.size(), tensor.stride(), tensor.storage_offset(), torch.storage.TypedStorage,
            tensor.dtype, 0, handle, storage.nbytes(), 0, tensor.requires_grad, REF_COUNTER, 3, bytes(range(64)), True,
        )  # fmt: skip
        return reductions.rebuild_cuda_tensor, args

    def _rebuild(self, *args):
        self.rebuilt.append(args)
        _, size, stride, offset, _, dtype, _, handle, nbytes, _, requires_grad, *_ = args
        if handle is None:
            return torch.empty(0, dtype=dtype)
        tensor = torch.empty(0, dtype=dtype).set_(self.shared[handle], offset, size, stride)
        return tensor.requires_grad_(requires_grad)


@pytest.fixture
def cuda_ipc(fake_cuda, monkeypatch):
    """(backend, fake reduction, exported handle of a (4, 4) float32 view at element 4, the view)."""
    fake = FakeReduction()
    fake.install(monkeypatch)
    backend = hal.get_backend("cuda")
    base = torch.arange(32, dtype=torch.float32)
    view = base[4:20].view(4, 4).as_subclass(OnCuda)
    return backend, fake, backend.export_ipc(view), base


def test_fake_cuda_ipc_handle_is_json(cuda_ipc):
    backend, fake, handle, _ = cuda_ipc
    assert json.loads(json.dumps(handle)) == handle
    storage_handle = next(iter(fake.shared))
    assert handle == {
        "kind": "cuda",
        "device": 0,
        "storage_handle": storage_handle.hex(),
        "storage_size_bytes": 128,
        "storage_offset_bytes": 0,
        "ref_counter_handle": REF_COUNTER.hex(),
        "ref_counter_offset": 3,
        "event_handle": bytes(range(64)).hex(),
        "event_sync_required": True,
        "tensor_offset": 4,
        "shape": [4, 4],
        "stride": [4, 1],
        "dtype": "float32",
        "requires_grad": False,
    }


def test_fake_cuda_ipc_round_trip_rebuilds_through_torch(cuda_ipc):
    backend, fake, handle, base = cuda_ipc
    tensor = backend.import_ipc(json.loads(json.dumps(handle)))
    assert tensor.tolist() == base[4:20].view(4, 4).tolist()
    tensor.fill_(-1.0)
    assert base[4:20].eq(-1.0).all() and base[:4].tolist() == [0.0, 1.0, 2.0, 3.0]  # shared, at its offset
    [args] = fake.rebuilt
    assert args[0] is torch.Tensor and args[4] is torch.storage.TypedStorage
    assert args[1] == torch.Size([4, 4]) and isinstance(args[1], torch.Size)
    assert args[2:4] == ((4, 1), 4)
    assert args[5] is torch.float32 and args[6] == 0
    assert isinstance(args[7], bytes) and args[7] in fake.shared
    assert args[8:11] == (128, 0, False)
    assert args[11:] == (REF_COUNTER, 3, bytes(range(64)), True)


def test_fake_cuda_ipc_empty_storage(cuda_ipc):
    backend, fake, handle, _ = cuda_ipc
    empty = {**handle, "storage_handle": None, "ref_counter_handle": None, "event_handle": None,
             "event_sync_required": None, "storage_size_bytes": 0, "tensor_offset": 0, "shape": [0], "stride": [1]}  # fmt: skip
    assert backend.import_ipc(empty).numel() == 0
    assert fake.rebuilt[-1][7] is None


def test_fake_cuda_export_refuses_another_reduction(fake_cuda, monkeypatch):
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (reductions.rebuild_tensor, (type(t), None, None)))
    backend = hal.get_backend("cuda")
    with pytest.raises(RuntimeError, match="reduce_tensor returned 'rebuild_tensor' with 3 arguments, expected 'rebuild_cuda_tensor' with 15"):
        backend.export_ipc(torch.zeros(4).as_subclass(OnCuda))


CUDA_MALFORMED = [
    pytest.param(lambda h: [h], "must be a dict", id="list"),
    pytest.param(lambda h: {**h, "kind": "shm"}, "'kind' is 'shm', expected 'cuda'", id="kind"),
    pytest.param(lambda h: {**h, "pickle": "gASV"}, "'pickle' is not part", id="extra"),
    pytest.param(lambda h: {k: v for k, v in h.items() if k != "dtype"}, "'dtype' is missing", id="missing"),
    pytest.param(lambda h: {**h, "device": 2}, "'device' must be <= 1", id="device-too-large"),
    pytest.param(lambda h: {**h, "device": -1}, "'device' must be >= 0", id="device-negative"),
    pytest.param(lambda h: {**h, "device": "0"}, "'device' must be an int", id="device-str"),
    pytest.param(lambda h: {**h, "storage_handle": "zz"}, "'storage_handle' is not lower-case hex", id="handle-not-hex"),
    pytest.param(lambda h: {**h, "storage_handle": "abc"}, "'storage_handle' is not lower-case hex", id="handle-odd"),
    pytest.param(lambda h: {**h, "storage_handle": h["storage_handle"].upper()}, "'storage_handle' is not lower-case", id="handle-upper"),
    pytest.param(lambda h: {**h, "storage_handle": ""}, "'storage_handle' is empty", id="handle-empty"),
    pytest.param(lambda h: {**h, "storage_handle": list(range(64))}, "'storage_handle' must be a hex str or None", id="handle-list"),
    pytest.param(lambda h: {**h, "storage_handle": "00" * 5000}, "'storage_handle' holds more than 4096 bytes", id="handle-huge"),
    pytest.param(lambda h: {**h, "storage_handle": None}, "'storage_handle' is None for a storage of 128 bytes", id="handle-none"),
    pytest.param(lambda h: {**h, "ref_counter_handle": b"/etc/passwd".hex()}, "'ref_counter_handle' does not name", id="refcount-path"),
    pytest.param(lambda h: {**h, "ref_counter_handle": b"/torch_1_2_3/../x".hex()}, "'ref_counter_handle' does not name", id="refcount-dotdot"),
    pytest.param(lambda h: {**h, "ref_counter_handle": None}, "'ref_counter_handle' does not name", id="refcount-none"),
    pytest.param(lambda h: {**h, "ref_counter_offset": -1}, "'ref_counter_offset' must be >= 0", id="refcount-offset"),
    pytest.param(lambda h: {**h, "event_handle": None}, "'event_handle' is None for a shared storage", id="event-none"),
    pytest.param(lambda h: {**h, "event_sync_required": "true"}, "'event_sync_required' must be a bool", id="sync-str"),
    pytest.param(lambda h: {**h, "event_sync_required": None}, "'event_sync_required' is None for a shared storage", id="sync-none"),
    pytest.param(lambda h: {**h, "storage_size_bytes": -128}, "'storage_size_bytes' must be >= 0", id="size-negative"),
    pytest.param(lambda h: {**h, "storage_size_bytes": 64}, "'shape' \\[4, 4\\] with stride \\[4, 1\\] at byte 16 reaches byte 80, past the 64", id="size-overrun"),
    pytest.param(lambda h: {**h, "storage_offset_bytes": 1.5}, "'storage_offset_bytes' must be an int", id="storage-offset-float"),
    pytest.param(lambda h: {**h, "tensor_offset": 20}, "reaches byte 144, past the 128", id="offset-overrun"),
    pytest.param(lambda h: {**h, "tensor_offset": -4}, "'tensor_offset' must be >= 0", id="offset-negative"),
    pytest.param(lambda h: {**h, "shape": [8, 4]}, "'shape' \\[8, 4\\] with stride \\[4, 1\\] at byte 16 reaches byte 144", id="shape-overrun"),
    pytest.param(lambda h: {**h, "shape": [4, -4]}, "'shape\\[1\\]' must be >= 0", id="shape-negative"),
    pytest.param(lambda h: {**h, "stride": [4]}, "'stride' has 1 entries for a shape of 2", id="stride-length"),
    pytest.param(lambda h: {**h, "stride": [4, "1"]}, "'stride\\[1\\]' must be an int", id="stride-str"),
    pytest.param(lambda h: {**h, "dtype": "object"}, "'dtype' names no allowed dtype: 'object'", id="dtype-unknown"),
    pytest.param(lambda h: {**h, "dtype": "float"}, "'dtype' names no allowed dtype: 'float'", id="dtype-alias"),
    pytest.param(lambda h: {**h, "requires_grad": 1}, "'requires_grad' must be a bool", id="grad-int"),
    pytest.param(lambda h: {**h, "dtype": "int64", "requires_grad": True}, "'requires_grad' is true for dtype torch.int64", id="grad-int-dtype"),
]


@pytest.mark.parametrize(("spoil", "message"), CUDA_MALFORMED)
def test_fake_cuda_malformed_handles_never_reach_torch(cuda_ipc, spoil, message):
    backend, fake, handle, _ = cuda_ipc
    with pytest.raises(ValueError, match=rf"import_ipc on backend 'cuda': handle.*{message}"):
        backend.import_ipc(spoil(copy.deepcopy(handle)))
    assert fake.rebuilt == []  # refused before torch's rebuild opened anything
    backend.import_ipc(handle)  # while the handle itself was good
    assert len(fake.rebuilt) == 1


def test_fake_cuda_pinned_failure_names_the_size(fake_cuda):
    # The CPU torch cannot pin: the backend's error must name size and backend.
    backend = hal.get_backend("cuda")
    with pytest.raises(MemoryError, match="backend 'cuda': could not allocate 4096 bytes of pinned host memory"):
        backend.empty_pinned((1024,), torch.float32)


def test_cuda_unusable_without_cuda_build(monkeypatch, hal_reset):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    assert "was built without CUDA" in CudaBackend.unavailable_reason()
    monkeypatch.setenv("VERL_DEVICE", "cuda")
    with pytest.raises(BackendUnavailableError, match="backend 'cuda' is not usable: torch .* was built without CUDA"):
        hal.current()


def test_cuda_unusable_without_devices_names_visible_devices(monkeypatch, hal_reset):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    reason = CudaBackend.unavailable_reason()
    assert "torch.cuda.is_available() is False" in reason
    assert "CUDA_VISIBLE_DEVICES=''" in reason
    res = hal.resolve("auto")
    assert res.backend.name == "cpu"
    assert "cuda: torch.cuda.is_available() is False" in res.reason


def test_npu_import_error_is_the_reason(monkeypatch, fake_torch_npu):
    # What a torch_npu without CANN does: the import itself fails with OSError.
    monkeypatch.syspath_prepend(str(fake_torch_npu))
    monkeypatch.setenv("FAKE_NPU_IMPORT_ERROR", "libhccl.so: cannot open shared object file")
    reason = NpuBackend.unavailable_reason()
    assert reason == "importing torch_npu failed: OSError: libhccl.so: cannot open shared object file"
    with pytest.raises(BackendUnavailableError, match="backend 'npu' is not usable: importing torch_npu failed: OSError"):
        hal.get_backend("npu")


def test_npu_reason_is_one_line(monkeypatch, fake_torch_npu):
    # torch_npu's errors run to several lines (a second one with a timestamp and error code)
    monkeypatch.syspath_prepend(str(fake_torch_npu))
    monkeypatch.setenv("FAKE_NPU_IMPORT_ERROR", "Two accelerators cannot be used at the same time\n[ERROR] 2026-11-25 ERR00007 PTA")
    assert NpuBackend.unavailable_reason() == "importing torch_npu failed: OSError: Two accelerators cannot be used at the same time"


# torch_npu's wheel installed without CANN: its import fails loading the CANN libraries.
NO_CANN_TORCH_NPU = 'raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")\n'


@pytest.mark.parametrize("verl_device", ["auto", "npu"])
def test_hal_info_with_torch_npu_but_no_cann_prints_the_reason(tmp_path, verl_device):
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(NO_CANN_TORCH_NPU)
    code = """
    from hal.cli import main
    raise SystemExit(main(["info"]))
    """
    result = run_python(code, env={"PYTHONPATH": str(tmp_path), "VERL_DEVICE": verl_device})
    reason = "npu: cannot import torch_npu: libhccl.so: cannot open shared object file: No such file or directory"
    if verl_device == "auto":  # falls back to the CPU and says why in the backend line
        assert result.returncode == 0, result.stderr
        assert reason in result.stdout.splitlines()[0]
    else:  # asked for: one line on stderr, no traceback
        assert result.returncode == 1
        assert result.stderr.strip() == f"hal info: error: backend 'npu' is not usable: {reason.removeprefix('npu: ')}"


# ---- NPU, in a subprocess ---------------------------------------------------------

NPU_PROBE = """
import json
import torch
import hal
from hal.compat import verl

out = {}
res = hal.resolution()
backend = res.backend
out["name"] = backend.name
out["reason"] = res.reason
out["accelerator"] = str(torch.accelerator.current_accelerator())
out["device_type"] = backend.device_type
out["device_count"] = backend.device_count()
backend.set_device(1)
out["current_device"] = backend.current_device()
out["device"] = str(backend.device())
try:
    backend.device(5)
except ValueError as exc:
    out["bad_index"] = str(exc)
out["dist"] = backend.dist_backend_string()
out["dist_plain"] = backend.dist_backend_string(with_cpu=False)
out["visible"] = backend.visible_devices_env
out["ray"] = backend.ray_resource
out["memory"] = [backend.memory_info().free, backend.memory_info().total]
backend.manual_seed(11)
backend.synchronize()
backend.empty_cache()
import torch_npu
out["calls"] = [list(c) for c in torch.npu.calls]
out["torch_device_is_npu_module"] = verl.get_torch_device() is torch.npu
out["verl"] = {
    "get_device_name": verl.get_device_name(),
    "get_nccl_backend": verl.get_nccl_backend(),
    "get_visible_devices_keyword": verl.get_visible_devices_keyword(),
    "get_resource_name": verl.get_resource_name(),
    "get_device_id": verl.get_device_id(),
    "is_npu_available": verl.is_npu_available,
    "is_cuda_available": verl.is_cuda_available,
    "is_torch_npu_available": verl.is_torch_npu_available(),
}
print(json.dumps(out))
"""


def _run_probe(code: str, fake_dir, **env: str) -> dict:
    result = run_python(code, env={"PYTHONPATH": str(fake_dir), **env}, timeout=120)
    assert result.returncode == 0, f"probe failed:\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("verl_device", ["auto", "npu"])
def test_fake_npu(fake_torch_npu, verl_device):
    out = _run_probe(NPU_PROBE, fake_torch_npu, VERL_DEVICE=verl_device)
    assert out["name"] == "npu"
    if verl_device == "auto":
        assert out["reason"] == "auto: npu is the only usable accelerator"
    else:
        assert out["reason"] == "VERL_DEVICE=npu"
    assert out["accelerator"] == "npu"
    assert out["device_type"] == "npu"
    assert out["device_count"] == 2
    assert out["current_device"] == 1
    assert out["device"] == "npu:1"
    assert "device index 5 out of range for backend 'npu': 2 device(s) visible" in out["bad_index"]
    assert out["dist"] == "npu:hccl,cpu:gloo"
    assert out["dist_plain"] == "hccl"
    assert out["visible"] == "ASCEND_RT_VISIBLE_DEVICES"
    assert out["ray"] == "NPU"
    assert out["memory"] == [3 * 2**30, 64 * 2**30]
    assert ["set_device", 1] in out["calls"]
    assert ["manual_seed_all", 11] in out["calls"]
    assert ["synchronize"] in out["calls"] and ["empty_cache"] in out["calls"]
    assert out["torch_device_is_npu_module"] is True
    assert out["verl"] == {
        "get_device_name": "npu",
        "get_nccl_backend": "hccl",
        "get_visible_devices_keyword": "ASCEND_RT_VISIBLE_DEVICES",
        "get_resource_name": "NPU",
        "get_device_id": 1,
        "is_npu_available": True,
        "is_cuda_available": False,
        "is_torch_npu_available": True,
    }


def test_fake_npu_without_devices(fake_torch_npu):
    code = """
    import json
    import hal
    from hal.backends.npu import NpuBackend
    out = {"reason": NpuBackend.unavailable_reason(), "auto": hal.resolve("auto").backend.name,
           "auto_reason": hal.resolve("auto").reason}
    try:
        hal.resolve("npu")
    except hal.BackendUnavailableError as exc:
        out["explicit"] = str(exc)
    print(json.dumps(out))
    """
    out = _run_probe(code, fake_torch_npu, FAKE_NPU_AVAILABLE="0", ASCEND_RT_VISIBLE_DEVICES="")
    assert out["reason"] == (
        "torch.npu.is_available() is False: no usable Ascend NPU or CANN driver (ASCEND_RT_VISIBLE_DEVICES='')"
    )
    assert out["auto"] == "cpu"
    assert "npu: torch.npu.is_available() is False" in out["auto_reason"]
    assert out["explicit"].startswith("backend 'npu' is not usable: torch.npu.is_available() is False")


def test_fake_npu_and_fake_cuda_both_usable_auto_raises(fake_torch_npu):
    code = """
    import json
    import torch
    import hal
    torch.version.cuda = "12.8"
    torch.cuda.is_available = lambda: True
    out = {}
    try:
        hal.current()
    except hal.BackendUnavailableError as exc:
        out["auto"] = str(exc)
    hal.reset()
    import os
    os.environ["VERL_DEVICE"] = "npu"
    out["explicit"] = hal.current().name
    print(json.dumps(out))
    """
    out = _run_probe(code, fake_torch_npu, VERL_DEVICE="auto")
    assert out["auto"] == (
        "VERL_DEVICE=auto found several usable accelerators (cuda, npu); set VERL_DEVICE to one of them"
    )
    assert out["explicit"] == "npu"


def test_fake_npu_hal_info(fake_torch_npu):
    code = """
    from hal.cli import main
    raise SystemExit(main(["info", "--json"]))
    """
    result = run_python(code, env={"PYTHONPATH": str(fake_torch_npu), "VERL_DEVICE": "auto"})
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["backend"] == "npu"
    assert info["dist_backend_string"] == "npu:hccl,cpu:gloo"
    assert info["visible_devices_env"] == "ASCEND_RT_VISIBLE_DEVICES"
    assert info["ray_resource"] == "NPU"
    assert info["device_count"] == 2


# ---- NPU runtime questions: a fake npu-smi and CANN install, no torch_npu needed -----------


@pytest.fixture
def ascend_host(tmp_path, monkeypatch):
    """Returns `install(board=..., cann=..., status=0)`: puts a fake `npu-smi` first on PATH that
    prints `board` and exits with `status` (None: no npu-smi), and a CANN install-info file
    with `version=<cann>` under ASCEND_HOME_PATH (None: no file). The fake logs its
    arguments to `tmp_path / "npu-smi.args"`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    info_dir = tmp_path / "ascend" / f"{platform.machine()}-linux"
    info_dir.mkdir(parents=True)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path / "ascend"))

    def install(board: str | None = None, cann: str | None = None, status: int = 0) -> None:
        script = bin_dir / "npu-smi"
        if board is not None:
            (tmp_path / "board.txt").write_text(board)
            script.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "npu-smi.args"}\ncat {tmp_path / "board.txt"}\nexit {status}\n')
            script.chmod(0o755)
        info = info_dir / "ascend_toolkit_install.info"
        if cann is not None:
            info.write_text(f"package_name=Ascend-cann-toolkit\n{cann}\n")

    return install


BOARD = "NPU ID                         : 1\n    Software Version               : {}\n    Firmware Version : 7.7.0.1\n"


def test_npu_runtime_versions_from_npu_smi_and_cann(ascend_host, tmp_path):
    ascend_host(board=BOARD.format("25.3.RC1.2"), cann="version=8.3.RC1")
    backend = NpuBackend()  # no device module is touched by these questions
    assert backend.runtime_versions() == {"driver": "25.3.rc1.2", "cann": "8.3.rc1"}
    assert (tmp_path / "npu-smi.args").read_text().split() == ["info", "-t", "board", "-i", "1"]
    assert backend.supports_device_memory_ipc() is True


@pytest.mark.parametrize(
    ("driver", "cann", "expected"),
    [("25.5.0", "8.3.rc1", True), ("25.2.0", "8.3.rc1", False), ("25.3.0", "8.2.rc1", False), ("25.5.t3.b001", "8.5.0", True)],
)
def test_npu_device_memory_ipc_needs_new_driver_and_cann(ascend_host, driver, cann, expected):
    ascend_host(board=BOARD.format(driver), cann=f"version={cann}")
    assert NpuBackend().supports_device_memory_ipc() is expected


@pytest.mark.parametrize(
    ("board", "cann", "status", "message"),
    [
        (None, "version=8.3.rc1", 0, "npu-smi is not on PATH \\(no Ascend driver installed\\?\\)"),
        (BOARD.format("25.3.rc1"), "version=8.3.rc1", 3, "npu-smi failed: .*exit status 3"),
        ("NPU ID : 1\nno versions here\n", "version=8.3.rc1", 0, "npu-smi printed no 'Software Version' line"),
        (BOARD.format("25.3.rc1"), None, 0, "cannot read the CANN toolkit info file .*ascend_toolkit_install.info"),
        (BOARD.format("25.3.rc1"), "package_name=x", 0, "no 'version=' line in .*ascend_toolkit_install.info"),
    ],
)
def test_npu_runtime_versions_say_what_is_missing(ascend_host, board, cann, status, message):
    ascend_host(board=board, cann=cann, status=status)
    backend = NpuBackend()
    with pytest.raises(RuntimeError, match=f"backend 'npu': runtime_versions: {message}"):
        backend.runtime_versions()
    with pytest.raises(RuntimeError, match=message):
        backend.supports_device_memory_ipc()  # cannot tell: says why, does not guess


def test_npu_unrecognised_version_is_an_error(ascend_host):
    ascend_host(board=BOARD.format("beta"), cann="version=8.3.rc1")
    with pytest.raises(RuntimeError, match="unrecognised Ascend version 'beta'"):
        NpuBackend().supports_device_memory_ipc()


# ---- NPU device-module hooks and IPC, in a subprocess with the fake torch_npu ---------------

# torch_npu's multiprocessing reductions, faked in the same argument layout as the CUDA fake,
# with torch_npu's own signatures (tests/hosts/ compares them with its wheel's sources).
FAKE_NPU_REDUCTIONS = """
import os
import torch

shared = {}
rebuilt = []


def reduce_tensor(tensor):
    storage = tensor.untyped_storage()
    handle = os.urandom(64)
    shared[handle] = storage
    return rebuild_npu_tensor, (
        type(tensor), tensor.size(), tensor.stride(), tensor.storage_offset(), torch.storage.TypedStorage,
        tensor.dtype, tensor.device.index, handle, storage.nbytes(), 0, tensor.requires_grad,
        b"/torch_7_8_9", 0, bytes(64), True,
    )


def rebuild_npu_tensor(
    tensor_cls,
    tensor_size,
    tensor_stride,
    tensor_offset,
    storage_cls,
    dtype,
    storage_device,
    storage_handle,
    storage_size_bytes,
    storage_offset_bytes,
    requires_grad,
    ref_counter_handle,
    ref_counter_offset,
    event_handle,
    event_sync_required,
):
    rebuilt.append((tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype, storage_device, storage_handle,
                    storage_size_bytes, storage_offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset,
                    event_handle, event_sync_required))
    return torch.empty(0, dtype=dtype).set_(shared[storage_handle], tensor_offset, tensor_size, tensor_stride)
"""

NPU_HOOKS_PROBE = """
import json
import sys
import types

import torch

import hal
from hal.compat import verl

backend = hal.current()
out = {}
out["capability"] = [backend.device_capability(), backend.device_capability(1)]
out["verl_capability"] = list(verl.get_device_capability(1))
out["allocator_missing"] = backend.set_allocator_settings(expandable_segments=True)
calls = []
torch.npu.memory = types.SimpleNamespace(_set_allocator_settings=calls.append)
out["allocator"] = backend.set_allocator_settings(expandable_segments=True)
verl.set_expandable_segments(False)
out["allocator_calls"] = calls
out["rocm"] = verl.is_rocm_visible_devices()

import torch_npu.multiprocessing.reductions as fake

torch.multiprocessing.reductions.reduce_tensor = fake.reduce_tensor  # as torch_npu does on import


class OnNpu(torch.Tensor):
    @property
    def device(self):
        return torch.device("npu", 1)


base = torch.arange(12, dtype=torch.bfloat16)
handle = backend.export_ipc(base[2:10].view(2, 4).as_subclass(OnNpu))
tensor = backend.import_ipc(json.loads(json.dumps(handle)))
out["handle"] = {k: handle[k] for k in ("kind", "device", "dtype", "tensor_offset", "shape", "stride")}
out["values"] = tensor.float().tolist()
out["rebuilt"] = len(fake.rebuilt)
try:
    backend.import_ipc({**handle, "device": 5})
except ValueError as exc:
    out["refused"] = str(exc)
out["rebuilt_after_refusal"] = len(fake.rebuilt)
sys.modules["torch_npu.multiprocessing.reductions"] = None  # a torch_npu without NPU IPC
try:
    backend.export_ipc(base.as_subclass(OnNpu))
except NotImplementedError as exc:
    out["no_ipc"] = str(exc)
print(json.dumps(out))
"""


def test_fake_npu_hooks_and_ipc(fake_torch_npu):
    package = fake_torch_npu / "torch_npu" / "multiprocessing"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "reductions.py").write_text(FAKE_NPU_REDUCTIONS)
    out = _run_probe(NPU_HOOKS_PROBE, fake_torch_npu, VERL_DEVICE="npu")
    assert out["capability"] == [None, None]  # NPUs have no compute capability
    assert out["verl_capability"] == [None, None]
    assert out["allocator_missing"] == "backend 'npu': this torch_npu cannot change allocator settings at run time"
    assert out["allocator"] is None
    assert out["allocator_calls"] == ["expandable_segments:True", "expandable_segments:False"]
    assert out["rocm"] is False
    assert out["handle"] == {"kind": "npu", "device": 1, "dtype": "bfloat16", "tensor_offset": 2, "shape": [2, 4], "stride": [4, 1]}
    assert out["values"] == [[2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 9.0]]
    assert out["rebuilt"] == 1
    assert "import_ipc on backend 'npu': handle field 'device' must be <= 1, got 5" in out["refused"]
    assert out["rebuilt_after_refusal"] == 1
    assert "this torch_npu has no NPU memory IPC" in out["no_ipc"]


# ---- NPU tensors beside a gloo group ------------------------------------------------------
GLOO_PROBE = """
import json
import torch
import torch_npu  # the fake: PrivateUse1 is "npu" from here on
from hal.backends.collectives import collective_traits, takes_device

out = {
    "capability": {k: list(v) for k, v in torch.distributed.Backend.backend_capability.items() if k in ("gloo", "nccl")},
    "gloo_npu": takes_device("gloo", "npu"),
    "gloo_cpu": takes_device("gloo", "cpu"),
    "gloo_cuda": takes_device("gloo", "cuda"),
    "hccl_npu_unregistered": takes_device("hccl", "npu"),
    "gloo_p2p_device_memory": collective_traits("gloo").point_to_point_device_memory,
}
print(json.dumps(out))
"""


def test_gloo_takes_no_npu_tensors(fake_torch_npu):
    # A PrivateUse1 device (torch_npu's "npu") has no gloo backend in a group: its tensors
    # fail there with "No backend type associated with device type npu" unless they go
    # through host memory, broadcasts included. torch's own table says so once PrivateUse1
    # is named "npu"; hal reads that table (takes_device) and gloo's traits stage
    # point-to-point transfers of device tensors already.
    out = _run_probe(GLOO_PROBE, fake_torch_npu)
    assert out["capability"] == {"gloo": ["cpu", "cuda"], "nccl": ["cuda"]}
    assert out["gloo_npu"] is False
    assert out["gloo_cpu"] is True and out["gloo_cuda"] is True
    assert out["hccl_npu_unregistered"] is False  # unknown to torch until torch_npu registers it: stage
    assert out["gloo_p2p_device_memory"] is False


def test_takes_device_reads_torchs_table(monkeypatch):
    from hal.backends.collectives import takes_device

    assert takes_device("gloo", "cuda") and takes_device(" GLOO ", "CPU") and takes_device("nccl", "cuda")
    assert not takes_device("nccl", "cpu")
    assert not takes_device("cuda:nccl,cpu:gloo", "cuda")  # a mixed string names no one library
    monkeypatch.setitem(torch.distributed.Backend.backend_capability, "hccl", ["npu"])  # as torch_npu registers it
    assert takes_device("hccl", "npu") and not takes_device("gloo", "npu")
    with pytest.raises(TypeError, match="takes_device: expected two str, got NoneType and str"):
        takes_device(None, "npu")


def test_control_messages_live_where_the_groups_library_takes_them(monkeypatch, fake_cuda):
    """Headers, statuses and agreements go in host memory when a library of the group takes
    host tensors (gloo, a mixed group), else on the device (NCCL or HCCL alone): one rule,
    `Backend.control_device`, for every integration and the trainer group."""
    from hal.backends.collectives import control_on_host

    monkeypatch.setitem(torch.distributed.Backend.backend_capability, "hccl", ["npu"])  # as torch_npu registers it
    assert control_on_host("gloo") and control_on_host("cuda:nccl,cpu:gloo") and control_on_host("npu:hccl,cpu:gloo")
    assert not control_on_host("nccl") and not control_on_host("hccl") and not control_on_host("")
    cuda = hal.get_backend("cuda")
    assert cuda.control_device() == cuda.device()  # nccl alone
    assert cuda.control_device("gloo") == torch.device("cpu")
    assert hal.get_backend("cpu").control_device() == torch.device("cpu")
    with pytest.raises(TypeError, match="control_on_host: dist_backend must be a str, got NoneType"):
        control_on_host(None)


class _GlooGroup:
    """A gloo group as a transport sees it before any transfer: its name, rank and size."""

    def __init__(self, config: str | None = None) -> None:
        self.config = config

    def name(self) -> str:
        return "gloo"

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


@pytest.mark.parametrize("device_type,host_only", [("npu", True), ("cuda", False), ("cpu", False)])
def test_a_gloo_transport_moves_a_device_it_cannot_take_through_host_memory(device_type, host_only):
    # the decision a BroadcastTransport takes in prepare(): gloo has no backend for an NPU
    # tensor, so every transfer of one, broadcasts too, is staged through host memory
    from hal.backends.collectives import collective_traits
    from hal.backends.cpu import CpuBackend
    from hal.sync import BroadcastTransport, build_plan
    from hal.sync.spec import TensorSpec

    class OnDevice(CpuBackend):  # host memory, but says it is that device
        pass

    OnDevice.device_type = device_type
    transport = BroadcastTransport(_GlooGroup(), src=0)
    transport.prepare(OnDevice(), build_plan([TensorSpec("w", (4,), torch.float32)], 4096))
    assert transport._traits == collective_traits("gloo")
    assert transport._host_only is host_only
    assert transport._stages(torch.empty(1, device="meta")) is True  # gloo's send/recv never read device memory


def test_the_library_of_a_one_library_group_holds_for_a_device_it_has_no_backend_for():
    from hal.sync.transport.base import _group_library

    class Named:
        def __init__(self, name):
            self._name = name

        def name(self):
            return self._name

    # outside c10d's registry a group says its one name; a mixed string names a library per device
    assert _group_library(Named("gloo"), "npu") == "gloo"
    assert _group_library(Named("cpu:gloo,cuda:gloo"), "npu") == "gloo"
    assert _group_library(Named("cuda:nccl,cpu:gloo"), "cuda") == "nccl"
    assert _group_library(Named("cuda:nccl,cpu:gloo"), "npu") is None


def _copy_through_float(dsts, srcs, non_blocking=False):
    """torch's multi-tensor copy as a GPU runs it: every floating element through a wider
    float and back, which keeps values and loses NaN signs and payloads (H200, 2026-11-27)."""
    for d, s in zip(dsts, srcs):
        d.copy_(s.to(torch.float64).to(d.dtype) if s.dtype.is_floating_point else s)


def test_fake_cuda_multi_tensor_copies_move_bits(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch, "_foreach_copy_", _copy_through_float)
    backend = hal.get_backend("cuda")
    nan_bits = torch.tensor([0x7FC1, -0x0001, 0x7F81, -0x8000], dtype=torch.int16)  # NaNs of other payloads and signs, -0.0
    src = nan_bits.view(torch.bfloat16)
    wider = torch.tensor([0x7FC00001, -0x00000002], dtype=torch.int32).view(torch.float32)
    # the emulation does lose them: a copy of values would fail below
    lost = torch.empty_like(src)
    _copy_through_float([lost], [src])
    assert not torch.equal(lost.view(torch.int16), nan_bits)
    for prepared in (False, True):
        dsts = [torch.empty_like(src), torch.empty_like(wider), torch.empty(4, dtype=torch.float32)]
        srcs = [src, wider, src]  # the last pair is a cast: a value copy, as copy_ does
        if prepared:
            backend.copy_prepared_(backend.prepare_copies(dsts, srcs))
        else:
            backend.copy_many_(dsts, srcs)
        assert torch.equal(dsts[0].view(torch.int16), nan_bits), prepared
        assert torch.equal(dsts[1].view(torch.int32), wider.view(torch.int32)), prepared
        assert torch.equal(dsts[2].isnan(), src.float().isnan()), prepared


def test_fake_cuda_export_has_the_drivers_file_removed_at_exit(cuda_ipc):
    from hal.backends import process_files

    assert (os.getpid(), CudaBackend.process_files) in process_files._at_exit


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: between capture_begin and capture_end the fake's
    multi-tensor copies are recorded, not run (as a stream being captured does); replay runs
    them with whatever stream is current then."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake, self.recorded, self.replays = fake, [], []

    def capture_begin(self, capture_error_mode: str = "global") -> None:
        assert capture_error_mode == "thread_local"  # other threads' device work is not refused
        assert self.fake.current is not self.fake.default_stream  # recorded on a side stream
        self.fake.capturing = self

    def capture_end(self) -> None:
        self.fake.capturing = None

    def replay(self) -> None:
        self.replays.append(self.fake.current)
        for dsts, srcs in self.recorded:
            for d, s in zip(dsts, srcs):
                d.copy_(s)


@pytest.fixture
def graph_cuda(fake_cuda, monkeypatch):
    """The fake CUDA module with graphs; host tensors stand in for device ones."""
    fake_cuda.capturing = None
    fake_cuda.graphs = []

    def new_graph():
        fake_cuda.graphs.append(FakeGraph(fake_cuda))
        return fake_cuda.graphs[-1]

    def foreach_copy(dsts, srcs, non_blocking=False):
        if fake_cuda.capturing is not None:
            fake_cuda.capturing.recorded.append((list(dsts), list(srcs)))
            return
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", new_graph, raising=False)
    monkeypatch.setattr(torch, "_foreach_copy_", foreach_copy)
    monkeypatch.setattr(CudaBackend, "_on_device", lambda self, pairs: all(t.device.type == "cpu" for ts in pairs for t in ts))
    return fake_cuda


def test_prepared_copies_are_recorded_as_a_graph_only_when_asked(graph_cuda, monkeypatch):
    from hal.backends._torch_device import COPY_GRAPHS_ENV, CapturedCopies

    backend = hal.get_backend("cuda")
    srcs = [torch.arange(6, dtype=torch.float32), torch.full((2, 3), 7, dtype=torch.bfloat16)]
    dsts = [torch.zeros(6, dtype=torch.float32), torch.zeros(2, 3, dtype=torch.bfloat16)]
    # unasked (the default): the pairs, run as one multi-tensor copy each time
    monkeypatch.delenv(COPY_GRAPHS_ENV, raising=False)
    plain = backend.prepare_copies(dsts, srcs)
    assert not isinstance(plain.handle, CapturedCopies) and graph_cuda.graphs == []
    # asked: recorded once, writing nothing while it records; each run replays it on the stream asked for
    monkeypatch.setenv(COPY_GRAPHS_ENV, "1")
    prepared = backend.prepare_copies(dsts, srcs)
    assert isinstance(prepared.handle, CapturedCopies) and len(graph_cuda.graphs) == 1
    assert all(not d.any() for d in dsts)
    stream = backend.new_stream()
    backend.copy_prepared_(prepared, stream=stream)
    assert graph_cuda.graphs[0].replays == [stream]
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    srcs[0].add_(1)  # the next sync's bytes, in the same memory: the same graph copies them
    backend.copy_prepared_(prepared, stream=stream)
    assert torch.equal(dsts[0], srcs[0]) and len(graph_cuda.graphs[0].replays) == 2
    # a pair not in this device's memory is never recorded
    monkeypatch.setattr(CudaBackend, "_on_device", lambda self, pairs: False)
    assert not isinstance(backend.prepare_copies(dsts, srcs).handle, CapturedCopies)


def test_a_graph_that_cannot_be_recorded_falls_back_to_the_multi_tensor_copy(graph_cuda, monkeypatch, caplog):
    from hal.backends._torch_device import COPY_GRAPHS_ENV, CapturedCopies

    def refuse(self, capture_error_mode="global"):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(FakeGraph, "capture_begin", refuse)
    monkeypatch.setenv(COPY_GRAPHS_ENV, "1")
    backend = hal.get_backend("cuda")
    srcs, dsts = [torch.arange(4, dtype=torch.int64)], [torch.zeros(4, dtype=torch.int64)]
    with caplog.at_level("WARNING", logger="hal.backends._torch_device"):
        prepared = backend.prepare_copies(dsts, srcs)
    assert not isinstance(prepared.handle, CapturedCopies)
    assert "recording 1 copies as a CUDAGraph failed (RuntimeError: operation not permitted" in caplog.text
    backend.copy_prepared_(prepared)
    assert torch.equal(dsts[0], srcs[0])
