"""The public names of verl's `verl/utils/device.py`, answered by `hal.current()`.

A trainer written against verl changes its device layer by changing one import:

    from verl.utils.device import get_device_name, get_nccl_backend   # before
    from hal.compat.verl import get_device_name, get_nccl_backend     # after

Matched against verl-project/verl commit addf8056956991e76db9367706108e426be7bc2f
(docs/verl-compat.md has the table). verl decides with module-level probes of
the device modules at import time; here every answer comes from the backend
VERL_DEVICE resolved, so `VERL_DEVICE=cpu` on a GPU host makes every answer "cpu".
Where verl's answer for the CPU is a GPU/NPU name that would fail later (NCCL's),
the CPU's real answer (`"gloo"`) is given instead; the doc lists each such case.

verl's names are device-specific by nature (compute capability is a CUDA notion), so
this module compares `backend.device_type` strings; the device modules themselves are
reached through `torch.get_device_module`, never imported by name.

`is_cuda_available` and `is_npu_available` are module attributes in verl; here they are
computed on first access (PEP 562), so importing this module resolves nothing.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import subprocess
import types
from typing import Any

import torch

import hal
from hal import env

logger = logging.getLogger(__name__)

__all__ = [
    "auto_set_ascend_device_name",
    "auto_set_device",
    "check_ipc_version_support",
    "get_device_capability",
    "get_device_id",
    "get_device_name",
    "get_nccl_backend",
    "get_npu_versions",
    "get_resource_name",
    "get_torch_device",
    "get_visible_devices_keyword",
    "is_ascend_npu_available",
    "is_cuda_available",
    "is_npu_available",
    "is_rocm_visible_devices",
    "is_support_ipc",
    "is_torch_npu_available",
    "set_expandable_segments",
]

# verl's answer when the backend hides no devices (the CPU): setting it is harmless there.
_DEFAULT_VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
# Ray's built-in resource for a worker that needs no accelerator.
_CPU_RAY_RESOURCE = "CPU"
# First NPU driver / CANN releases whose device memory IPC works (per verl's check).
_NPU_IPC_MIN_DRIVER = "25.3.rc1"
_NPU_IPC_MIN_CANN = "8.3.rc1"


def __getattr__(name: str) -> Any:
    # Only the two flags verl exports as variables; anything else is a plain AttributeError.
    if name == "is_cuda_available":
        return hal.current().device_type == "cuda"
    if name == "is_npu_available":
        return hal.current().device_type == "npu"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def is_torch_npu_available(check_device: bool = True) -> bool:
    """True when the resolved backend computes on Ascend NPUs.

    With `check_device=False`, verl asks only whether the torch_npu package is there;
    that is answered from the installed packages without importing it.
    """
    if not check_device:
        from hal.backends.npu import NpuBackend

        return NpuBackend.runtime_installed()
    return hal.current().device_type == "npu"


def is_ascend_npu_available() -> bool:
    """Older verl name of `is_torch_npu_available()`."""
    return is_torch_npu_available()


def get_resource_name() -> str:
    """The Ray resource one worker of this backend asks for: "GPU", "NPU", or "CPU"."""
    return hal.current().ray_resource or _CPU_RAY_RESOURCE


def get_visible_devices_keyword() -> str:
    """The environment variable that hides devices from a process on this backend."""
    return hal.current().visible_devices_env or _DEFAULT_VISIBLE_DEVICES_ENV


def get_device_name() -> str:
    """The torch device type tensors go to: "cuda", "npu" or "cpu" (also for `sim`)."""
    return hal.current().device_type


def is_rocm_visible_devices() -> bool:
    """True when the CUDA backend runs on a ROCm (HIP) build of torch."""
    return hal.current().device_type == "cuda" and getattr(torch.version, "hip", None) is not None


def get_torch_device() -> types.ModuleType:
    """The torch device module of the backend (`torch.get_device_module`), e.g. torch.cpu on the CPU."""
    return torch.get_device_module(hal.current().device_type)


def get_device_id() -> int:
    """Index of the current device (0 on the CPU)."""
    return hal.current().current_device()


def get_nccl_backend() -> str:
    """The torch.distributed backend for device tensors: nccl, hccl, or gloo on the CPU."""
    return hal.current().dist_backend


def set_expandable_segments(enable: bool) -> None:
    """Switch the CUDA caching allocator's expandable segments; a no-op on other backends."""
    if hal.current().device_type != "cuda":
        return
    memory = torch.get_device_module("cuda").memory
    memory._set_allocator_settings(f"expandable_segments:{bool(enable)}")


def auto_set_device(config: Any) -> None:
    """Set `config.trainer.device` to the resolved backend's device type.

    Like verl, an explicit "cpu" is kept; unlike verl (which only corrects NPU hosts),
    any other value that disagrees with the backend is replaced, with a warning.
    """
    trainer = getattr(config, "trainer", None) if config else None
    if trainer is None or not hasattr(trainer, "device"):
        return
    wanted = hal.current().device_type
    if trainer.device in ("cpu", wanted):
        return
    logger.warning(
        "config.trainer.device=%r does not match the resolved hal backend %r; using %r",
        trainer.device,
        hal.current().name,
        wanted,
    )
    trainer.device = wanted


def auto_set_ascend_device_name(config: Any) -> None:
    """Older verl name of `auto_set_device`."""
    auto_set_device(config)


def get_device_capability(device_id: int = 0) -> tuple[int | None, int | None]:
    """(major, minor) compute capability of CUDA device `device_id`; (None, None) elsewhere."""
    if hal.current().device_type != "cuda":
        return None, None
    major, minor = torch.get_device_module("cuda").get_device_capability(device_id)
    return int(major), int(minor)


def get_npu_versions() -> tuple[str, str]:
    """(driver software version, CANN toolkit version) of this Ascend host, lower-cased.

    Raises RuntimeError naming what is missing: `npu-smi`, its version line, or the CANN
    toolkit's install-info file under ASCEND_HOME_PATH.
    """
    try:
        result = subprocess.run(
            ["npu-smi", "info", "-t", "board", "-i", "1"], capture_output=True, text=True, check=True, timeout=30
        )
    except FileNotFoundError as exc:
        raise RuntimeError("get_npu_versions: npu-smi is not on PATH (no Ascend driver installed?)") from exc
    except subprocess.SubprocessError as exc:
        raise RuntimeError(f"get_npu_versions: npu-smi failed: {exc}") from exc
    driver = _field_after(result.stdout, "Software Version", ":")
    if driver is None:
        raise RuntimeError("get_npu_versions: npu-smi printed no 'Software Version' line")

    arch = platform.machine()
    info_file = os.path.join(env.ascend_home(), f"{arch}-linux", "ascend_toolkit_install.info")
    try:
        with open(info_file) as f:
            cann = _field_after(f.read(), "version", "=")
    except OSError as exc:
        raise RuntimeError(f"get_npu_versions: cannot read the CANN toolkit info file {info_file}: {exc}") from exc
    if cann is None:
        raise RuntimeError(f"get_npu_versions: no 'version=' line in {info_file}")
    return driver.lower(), cann.lower()


def _field_after(text: str, key: str, sep: str) -> str | None:
    for line in text.splitlines():
        name, found, value = line.partition(sep)
        if found and name.strip() == key:
            return value.strip()
    return None


# Ascend versions look like 25.5.0, 25.3.rc1, 25.3.rc1.2 (a hotfix of rc1) or 25.5.t3.b001
# (a test build of 25.5). Only major.minor and a third part (number or rcN) take part.
_ASCEND_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(?:(\d+)|rc(\d+)|t\w*))?(?:\..*)?$")


def _ascend_version_key(text: str) -> tuple[int, int, int, int, int]:
    match = _ASCEND_VERSION.match(text.strip().lower())
    if match is None:
        raise RuntimeError(f"unrecognised Ascend version {text!r} (expected e.g. 25.5.0 or 8.3.rc1)")
    major, minor, patch, rc = match.groups()
    if rc is not None:  # a release candidate sorts before the release it leads to
        return int(major), int(minor), 0, 0, int(rc)
    return int(major), int(minor), int(patch or 0), 1, 0


def check_ipc_version_support(software_version: str, cann_version: str) -> bool:
    """True when driver >= 25.3.rc1 and CANN >= 8.3.rc1, the releases with NPU memory IPC."""
    driver_ok = _ascend_version_key(software_version) >= _ascend_version_key(_NPU_IPC_MIN_DRIVER)
    cann_ok = _ascend_version_key(cann_version) >= _ascend_version_key(_NPU_IPC_MIN_CANN)
    if not driver_ok:
        logger.info("NPU driver %s is older than %s: no device memory IPC", software_version, _NPU_IPC_MIN_DRIVER)
    elif not cann_ok:
        logger.info("CANN %s is older than %s: no device memory IPC", cann_version, _NPU_IPC_MIN_CANN)
    return driver_ok and cann_ok


def is_support_ipc() -> bool:
    """True when device memory can be shared with another process through an IPC handle.

    verl's meaning is device memory (CUDA/NPU IPC handles), so the CPU and sim backends
    answer False although `Backend.supports_ipc` is True for their shared-memory files.
    ROCm answers False (rebuilding HIP IPC handles fails in vLLM workers); an NPU needs
    the driver and CANN releases that `check_ipc_version_support` names.
    """
    backend = hal.current()
    if not backend.supports_ipc or backend.device_type == "cpu":
        return False
    if is_rocm_visible_devices():
        return False
    if backend.device_type == "npu":
        return check_ipc_version_support(*get_npu_versions())
    return True
