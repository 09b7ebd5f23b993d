"""Huawei Ascend NPUs through torch_npu (torch.npu) and HCCL via torch.distributed.

There are no HCCL Python bindings here: collectives go through torch.distributed with
backend "hccl", which torch_npu registers. Importing torch_npu happens only when the
backend's availability is asked, never when `hal` is imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

from hal.backends._torch_device import TorchDeviceBackend


class NpuBackend(TorchDeviceBackend):
    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    ray_resource = "NPU"

    @classmethod
    def runtime_installed(cls) -> bool:
        """torch_npu is installed (found on the path, not imported: importing it loads CANN)."""
        return importlib.util.find_spec("torch_npu") is not None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            importlib.import_module("torch_npu")
        except ImportError as exc:
            return f"cannot import torch_npu: {exc}"
        except Exception as exc:  # torch_npu raises OSError/RuntimeError when CANN is missing
            return f"importing torch_npu failed: {type(exc).__name__}: {exc}"
        npu = getattr(torch, "npu", None)
        if npu is None:
            return "torch_npu imported but registered no torch.npu module"
        if not npu.is_available():
            visible = os.environ.get(cls.visible_devices_env)
            hint = f" ({cls.visible_devices_env}={visible!r})" if visible is not None else ""
            return f"torch.npu.is_available() is False: no usable Ascend NPU or CANN driver{hint}"
        return None
