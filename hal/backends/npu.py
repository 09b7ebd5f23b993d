"""Huawei Ascend NPUs through torch_npu (torch.npu) and HCCL via torch.distributed.

There are no HCCL Python bindings here: collectives go through torch.distributed with
backend "hccl", which torch_npu registers. Importing torch_npu happens only when the
backend's availability is asked, never when `hal` is imported; the driver and CANN
versions are read from `npu-smi` and the CANN toolkit's install-info file, without it.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import logging
import os
import platform
import re
import subprocess
from typing import Any, Callable

import torch

from hal import env
from hal.host_needs import Call, Need
from hal.backends._torch_device import REDUCTION_ARGS, TorchDeviceBackend

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


def _first_line(exc: BaseException) -> str:
    """An exception's message as one line: torch_npu's errors run to several (a second one
    with a timestamp and an error code), and a reason is one line (`hal info`)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


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
        except ImportError as exc:  # without CANN: "libhccl.so: cannot open shared object file ..."
            return f"cannot import torch_npu: {_first_line(exc)}"
        except Exception as exc:  # torch_npu raises OSError/RuntimeError when CANN is missing
            return f"importing torch_npu failed: {type(exc).__name__}: {_first_line(exc)}"
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

    def _new_process_group(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        # torch.distributed has no ProcessGroupHCCL: torch_npu's class lives in its extension
        # and takes an options object, not a timeout. Built the way torch_npu's own registry
        # builds it (`torch_npu._init.registry.distributed._new_process_group_hccl_helper`):
        # Options with `_timeout`, no high-priority stream.
        c10d = importlib.import_module("torch_npu._C._distributed_c10d")
        options = c10d.ProcessGroupHCCL.Options()
        options._timeout = timeout
        options.is_high_priority_stream = False
        return c10d.ProcessGroupHCCL(store, rank, size, options)

    def _runtime_versions(self) -> dict[str, str]:
        try:
            return read_npu_versions()
        except RuntimeError as exc:
            raise RuntimeError(f"backend {self.name!r}: runtime_versions: {exc}") from exc

    def _supports_device_memory_ipc(self) -> bool:
        versions = self.runtime_versions()
        return ipc_versions_supported(versions["driver"], versions["cann"])


# ---- what this backend relies on in torch_npu -------------------------------------------------
# Every torch_npu name the npu backend uses, with how it calls it: `torch.npu` is the module
# torch_npu registers (`torch_npu.npu`), reached through `TorchDeviceBackend.module`.
# tests/hosts/ checks this table against the Python sources of torch_npu's wheel (never
# importing it), and the fake torch_npu of the tests against the same sources
# (tests/hosts/sources.py has the target syntax).
_NPU = "torch_npu.npu"
TORCH_NPU_NEEDS: tuple[Need, ...] = (
    # availability, devices and visibility
    Need(target=f"{_NPU}:is_available", call=Call(0), why="unavailable_reason"),
    Need(target=f"{_NPU}:device_count", call=Call(0), why="device_count"),
    Need(target=f"{_NPU}:_parse_visible_devices", text=NpuBackend.visible_devices_env, why="visible_devices_env"),
    Need(target=f"{_NPU}:current_device", call=Call(0), why="current_device"),
    Need(target=f"{_NPU}:set_device", call=Call(1), why="set_device"),
    Need(target=f"{_NPU}:get_device_name", call=Call(1), why="device_model"),
    Need(target=f"{_NPU}:_is_in_bad_fork", call=Call(0), why="torch's device-module checks (the fake has it)"),
    # streams and events (hal.backends.types.Stream / Event name the methods)
    Need(target=f"{_NPU}:Stream", call=Call(0), why="new_stream"),
    *(Need(target=f"{_NPU}:Stream.{method}", call=Call(n), why="hal.backends.types.Stream")
      for method, n in (("wait_stream", 1), ("wait_event", 1), ("record_event", 0), ("synchronize", 0), ("query", 0))),
    Need(target=f"{_NPU}:Event", call=Call(0, "enable_timing"), why="new_event"),
    *(Need(target=f"{_NPU}:Event.{method}", call=Call(n), why="hal.backends.types.Event")
      for method, n in (("record", 1), ("wait", 1), ("query", 0), ("synchronize", 0), ("elapsed_time", 1))),
    Need(target=f"{_NPU}:current_stream", call=Call(0), why="current_stream"),
    Need(target=f"{_NPU}:stream", call=Call(1), why="stream, launch"),
    Need(target=f"{_NPU}:synchronize", call=Call(0), why="synchronize"),
    # memory and seeds
    Need(target=f"{_NPU}:mem_get_info", call=Call(0), why="memory_info"),
    Need(target=f"{_NPU}:empty_cache", call=Call(0), why="empty_cache"),
    Need(target=f"{_NPU}:memory._set_allocator_settings", call=Call(1), why="set_allocator_settings"),
    Need(target=f"{_NPU}:manual_seed_all", call=Call(1), why="manual_seed, device_manual_seed"),
    Need(target=f"{_NPU}:manual_seed", call=Call(1), why="device_manual_seed"),
    # IPC: torch_npu's reduction replaces torch's, and hal rebuilds through its public function
    Need(target="torch_npu.multiprocessing.reductions:rebuild_npu_tensor", call=Call(len(REDUCTION_ARGS)),
         why="_ipc_rebuild_function (REDUCTION_ARGS, in order)"),
    Need(target="torch_npu.multiprocessing.reductions:_add_reductions_methods", sets="reduce_tensor",
         why="TorchDeviceBackend._reduce_tensor (torch_npu installs its reduce_tensor into torch's reductions)"),
    Need(target="torch_npu.utils.storage:_add_storage_methods", text="_new_shared_npu",
         why="_import_ipc passes torch.storage.TypedStorage as storage_cls; torch_npu gives it the NPU sharing method"),
    # the collective library, by the name hal passes to torch.distributed
    Need(target="torch_npu._init.registry.distributed:register_distributed_backend_for_npu", text=NpuBackend.dist_backend,
         why="dist_backend"),
    # what _new_process_group does, as torch_npu's own registry does it (the class is C++)
    *(Need(target="torch_npu._init.registry.distributed:_new_process_group_hccl_helper", sets=field,
           why="new_process_group (ProcessGroupHCCL.Options)") for field in ("_timeout", "is_high_priority_stream")),
)
