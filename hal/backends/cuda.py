"""NVIDIA GPUs through torch.cuda and NCCL (and AMD GPUs on a ROCm build of torch).

Code here may assume a torch build with CUDA when the backend is usable; deciding
usability must not initialise a CUDA context beyond what `torch.cuda.is_available()` does.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch

from hal.backends._torch_device import TorchDeviceBackend


def _is_rocm() -> bool:
    return getattr(torch.version, "hip", None) is not None


class CudaBackend(TorchDeviceBackend):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    ray_resource = "GPU"
    vendor = "nvidia"
    # the driver's file of a process's IPC events, never removed by the driver (H200, 2026-11-27)
    process_files = ("cuda.shm.*.{pid:x}.*",)
    copy_graph_class = "CUDAGraph"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if torch.version.cuda is None and not _is_rocm():
            return f"torch {torch.__version__} was built without CUDA"
        if not torch.cuda.is_available():
            visible = os.environ.get(cls.visible_devices_env)
            hint = f" ({cls.visible_devices_env}={visible!r})" if visible is not None else ""
            return f"torch.cuda.is_available() is False: no usable NVIDIA GPU or driver{hint}"
        return None

    def _ipc_rebuild_function(self) -> Callable[..., torch.Tensor]:
        from torch.multiprocessing import reductions

        return reductions.rebuild_cuda_tensor

    def _set_allocator_settings(self, expandable_segments: bool) -> str | None:
        setting = f"expandable_segments:{expandable_segments}"
        # torch has no public setter for a running allocator (torch 2.13: only the
        # PYTORCH_ALLOC_CONF variable, read at start). The device-generic private call
        # replaced torch.cuda.memory._set_allocator_settings, which still exists but warns
        # (FutureWarning) where the generic one exists; older torch has only the CUDA one.
        generic: Callable[[str], Any] | None = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        if generic is not None:
            generic(setting)
        else:
            self.module.memory._set_allocator_settings(setting)
        return None

    def _device_capability(self, index: int) -> tuple[int, int]:
        return self.module.get_device_capability(index)

    def _runtime_versions(self) -> dict[str, str]:
        # torch.version names what torch was built with; the driver's own version needs
        # NVML or nvidia-smi, neither of them a cheap or public torch call.
        if _is_rocm():
            return {"hip": str(torch.version.hip)}
        return {"cuda": str(torch.version.cuda)} if torch.version.cuda else {}

    def _vendor_name(self) -> str:
        return "amd" if _is_rocm() else self.vendor

    def _profiler_range(self, message: str) -> contextlib.AbstractContextManager:
        return self.module.nvtx.range(message)

    def _profiler_control(self, start: bool) -> str | None:
        if start:
            self.module.profiler.start()
        else:
            self.module.profiler.stop()
        return None

    def _supports_device_memory_ipc(self) -> bool:
        # On ROCm, rebuilding HIP IPC handles fails in vLLM workers (as verl decides too).
        return not _is_rocm()
