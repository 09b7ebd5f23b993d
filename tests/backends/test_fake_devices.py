"""The cuda and npu backends against fake device modules, on a machine with neither.

CUDA: `torch.cuda`'s functions and `torch.version.cuda` are monkeypatched in this process.
NPU: a fake `torch_npu` package (tests/conftest.py, FAKE_TORCH_NPU) renames PrivateUse1 to
"npu", which lasts for the rest of the process, so those checks run in a subprocess and
report back as JSON.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

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
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)

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
    assert backend.collectives_follow_streams


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


def test_fake_cuda_ipc_rejects_host_tensor(fake_cuda):
    backend = hal.get_backend("cuda")
    with pytest.raises(ValueError, match="export_ipc on backend 'cuda': tensor is on cpu, expected cuda"):
        backend.export_ipc(torch.zeros(2))


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
