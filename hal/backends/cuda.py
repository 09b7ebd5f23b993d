"""NVIDIA GPUs through torch.cuda and NCCL.

Code here may assume a torch build with CUDA when the backend is usable; deciding
usability must not initialise a CUDA context beyond what `torch.cuda.is_available()` does.
"""

from __future__ import annotations

import os

import torch

from hal.backends._torch_device import TorchDeviceBackend


class CudaBackend(TorchDeviceBackend):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    ray_resource = "GPU"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return f"torch {torch.__version__} was built without CUDA"
        if not torch.cuda.is_available():
            visible = os.environ.get(cls.visible_devices_env)
            hint = f" ({cls.visible_devices_env}={visible!r})" if visible is not None else ""
            return f"torch.cuda.is_available() is False: no usable NVIDIA GPU or driver{hint}"
        return None
