"""The backend hooks verl's platform questions are answered by (hal.integrations.verl.platform,
hal.compat.verl): vendor, device product name, device-only seeding, profiler ranges."""

from __future__ import annotations

import contextlib

import pytest
import torch

import hal
from hal.backends.cuda import CudaBackend
from hal.backends.npu import NpuBackend


@pytest.mark.parametrize("name", ["cpu", "sim"])
def test_host_backends(name):
    with hal.use(name) as backend:
        assert backend.vendor_name() == "cpu"
        assert backend.device_model() is None
        with pytest.raises(ValueError):
            backend.device_model(1)
        assert isinstance(backend.profiler_range("step"), contextlib.nullcontext)
        assert backend.profiler_control(start=True) == f"backend {name!r} has no device profiler to start"
        assert backend.profiler_control(start=False) == f"backend {name!r} has no device profiler to stop"
        backend.device_manual_seed(3)
        first = torch.rand(2)
        backend.device_manual_seed(3, all_devices=True)
        assert torch.equal(first, torch.rand(2))


def test_bad_arguments_are_refused_by_name():
    with hal.use("cpu") as backend:
        with pytest.raises(ValueError, match="device_manual_seed: seed must be an int, got bool True"):
            backend.device_manual_seed(True)
        with pytest.raises(ValueError, match="profiler_range: message must be a str, got int"):
            backend.profiler_range(3)
        with pytest.raises(ValueError, match="profiler_control: start must be a bool, got str"):
            backend.profiler_control(start="yes")


def test_cuda_hooks_with_a_fake_torch_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: f"NVIDIA H100 #{i}")
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda s: calls.append(("manual_seed", s)))
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda s: calls.append(("manual_seed_all", s)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda msg: calls.append(("push", msg)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append(("start",)))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append(("stop",)))
    monkeypatch.setattr(torch.version, "hip", None)
    backend = CudaBackend()
    assert backend.vendor_name() == "nvidia"
    assert backend.device_model() == "NVIDIA H100 #1" and backend.device_model(0) == "NVIDIA H100 #0"
    backend.device_manual_seed(5)
    backend.device_manual_seed(6, all_devices=True)
    with backend.profiler_range("sync"):
        pass
    assert backend.profiler_control(start=True) is None and backend.profiler_control(start=False) is None
    assert calls == [("manual_seed", 5), ("manual_seed_all", 6), ("push", "sync"), ("pop",), ("start",), ("stop",)]
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert backend.vendor_name() == "amd"


def test_npu_declares_its_vendor_and_no_profiler_ranges():
    backend = NpuBackend()
    assert NpuBackend.vendor == "huawei" and backend.vendor_name() == "huawei"
    assert isinstance(backend.profiler_range("sync"), contextlib.nullcontext)
