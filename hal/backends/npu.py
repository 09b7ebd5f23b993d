"""Huawei Ascend NPUs through torch_npu (torch.npu) and HCCL via torch.distributed.

There are no HCCL Python bindings here: collectives go through torch.distributed with
backend "hccl", which torch_npu registers. Importing torch_npu happens only when the
backend's availability is asked, never when `hal` is imported; the driver and CANN
versions are read from `npu-smi` and the CANN toolkit's install-info file, without it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import platform
import re
import subprocess
from typing import Callable

import torch

from hal import env
from hal.backends._torch_device import TorchDeviceBackend

logger = logging.getLogger(__name__)

# First driver / CANN releases whose device memory IPC works (the releases verl checks for).
NPU_IPC_MIN_DRIVER = "25.3.rc1"
NPU_IPC_MIN_CANN = "8.3.rc1"
# What `runtime_versions()` runs to read the driver version (board information of NPU 1,
# as verl does), and how long it may take.
NPU_SMI_COMMAND = ("npu-smi", "info", "-t", "board", "-i", "1")
NPU_SMI_TIMEOUT_S = 30

# Ascend versions look like 25.5.0, 25.3.rc1, 25.3.rc1.2 (a hotfix of rc1) or 25.5.t3.b001
# (a test build of 25.5). Only major.minor and a third part (number or rcN) take part.
_ASCEND_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(?:(\d+)|rc(\d+)|t\w*))?(?:\..*)?$")


def ascend_version_key(text: str) -> tuple[int, int, int, int, int]:
    """A sort key for an Ascend driver or CANN version; a release candidate sorts before its release.

    `RuntimeError` for text that is no Ascend version.
    """
    match = _ASCEND_VERSION.match(text.strip().lower())
    if match is None:
        raise RuntimeError(f"unrecognised Ascend version {text!r} (expected e.g. 25.5.0 or 8.3.rc1)")
    major, minor, patch, rc = match.groups()
    if rc is not None:
        return int(major), int(minor), 0, 0, int(rc)
    return int(major), int(minor), int(patch or 0), 1, 0


def ipc_versions_supported(driver: str, cann: str) -> bool:
    """True when driver >= 25.3.rc1 and CANN >= 8.3.rc1, the releases with NPU memory IPC."""
    driver_ok = ascend_version_key(driver) >= ascend_version_key(NPU_IPC_MIN_DRIVER)
    cann_ok = ascend_version_key(cann) >= ascend_version_key(NPU_IPC_MIN_CANN)
    if not driver_ok:
        logger.info("NPU driver %s is older than %s: no device memory IPC", driver, NPU_IPC_MIN_DRIVER)
    elif not cann_ok:
        logger.info("CANN %s is older than %s: no device memory IPC", cann, NPU_IPC_MIN_CANN)
    return driver_ok and cann_ok


# Ascend chip generations by the product name torch_npu reports (`device_model()`), first
# match wins: the table verl's get_npu_versions uses (A5, A3, A2; any other Ascend: 999).
ASCEND_GENERATIONS = (("Ascend910_95", 5), ("Ascend950", 5), ("Ascend910_93", 3), ("Ascend910B", 2), ("A2G", 2))
ASCEND_GENERATION_UNKNOWN = 999


def ascend_generation(model: str | None) -> int:
    """The Ascend chip generation of a product name: 2 (A2), 3 (A3), 5 (A5), 999 for a
    name not in `ASCEND_GENERATIONS`, 0 for None (no NPU, or its name could not be read)."""
    if model is None:
        return 0
    for marker, generation in ASCEND_GENERATIONS:
        if marker in model:
            return generation
    return ASCEND_GENERATION_UNKNOWN


def read_npu_versions() -> dict[str, str]:
    """{"driver": npu-smi's Software Version, "cann": the toolkit's version=}, lower-cased.

    Raises RuntimeError naming what is missing: `npu-smi`, its version line, or the CANN
    toolkit's install-info file under ASCEND_HOME_PATH (hal.env).
    """
    try:
        result = subprocess.run(
            list(NPU_SMI_COMMAND), capture_output=True, text=True, check=True, timeout=NPU_SMI_TIMEOUT_S
        )
    except FileNotFoundError as exc:
        raise RuntimeError("npu-smi is not on PATH (no Ascend driver installed?)") from exc
    except subprocess.SubprocessError as exc:
        raise RuntimeError(f"npu-smi failed: {exc}") from exc
    driver = _field_after(result.stdout, "Software Version", ":")
    if not driver:
        raise RuntimeError("npu-smi printed no 'Software Version' line")

    info_file = os.path.join(env.ascend_home(), f"{platform.machine()}-linux", "ascend_toolkit_install.info")
    try:
        with open(info_file) as f:
            cann = _field_after(f.read(), "version", "=")
    except OSError as exc:
        raise RuntimeError(f"cannot read the CANN toolkit info file {info_file}: {exc}") from exc
    if not cann:
        raise RuntimeError(f"no 'version=' line in {info_file}")
    return {"driver": driver.lower(), "cann": cann.lower()}


def _field_after(text: str, key: str, sep: str) -> str | None:
    for line in text.splitlines():
        name, found, value = line.partition(sep)
        if found and name.strip() == key:
            return value.strip()
    return None


class NpuBackend(TorchDeviceBackend):
    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    ray_resource = "NPU"
    vendor = "huawei"

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

    def _ipc_rebuild_function(self) -> Callable[..., torch.Tensor]:
        # torch_npu replaces torch's reduce_tensor when imported, and exports the matching
        # rebuild function (in its __all__) since its 2025-07 IPC release; without it there is no NPU IPC.
        try:
            reductions = importlib.import_module("torch_npu.multiprocessing.reductions")
            return reductions.rebuild_npu_tensor
        except (ImportError, AttributeError) as exc:
            raise NotImplementedError(
                f"backend {self.name!r}: this torch_npu has no NPU memory IPC "
                f"(torch_npu.multiprocessing.reductions.rebuild_npu_tensor: {exc})"
            ) from exc

    def _set_allocator_settings(self, expandable_segments: bool) -> str | None:
        # torch_npu's private setter (torch_npu releases from 2025-10 on); torch's generic
        # _accelerator_setAllocatorSettings does not reach torch_npu's allocator.
        setter = getattr(getattr(self.module, "memory", None), "_set_allocator_settings", None)
        if setter is None:
            return f"backend {self.name!r}: this torch_npu cannot change allocator settings at run time"
        setter(f"expandable_segments:{expandable_segments}")
        return None

    def _runtime_versions(self) -> dict[str, str]:
        try:
            return read_npu_versions()
        except RuntimeError as exc:
            raise RuntimeError(f"backend {self.name!r}: runtime_versions: {exc}") from exc

    def _supports_device_memory_ipc(self) -> bool:
        versions = self.runtime_versions()
        return ipc_versions_supported(versions["driver"], versions["cann"])
