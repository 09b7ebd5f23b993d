"""The public names of verl's `verl/utils/device.py`, answered by `hal.current()`.

A trainer written against verl changes its device layer by changing one import:

    from verl.utils.device import get_device_name, get_nccl_backend   # before
    from hal.compat.verl import get_device_name, get_nccl_backend     # after

Matched against verl 0.9.1's `verl/utils/device.py` (docs/verl-compat.md has the table;
tests/compat/test_verl.py compares the names with the installed verl where there is one).
verl 0.9.1 itself answers through its platform registry, where verl-hal is the platform
"hal" (`VERL_PLATFORM=hal`, hal.integrations.verl.platform); this module gives the same
answers without verl installed. verl decides with module-level probes of
the device modules at import time; here every answer comes from the backend
VERL_DEVICE resolved, so `VERL_DEVICE=cpu` on a GPU host makes every answer "cpu".
Where verl's answer for the CPU is a GPU/NPU name that would fail later (NCCL's),
the CPU's real answer (`"gloo"`) is given instead; the doc lists each such case.

Every device action is a question to the backend (`set_allocator_settings`,
`device_capability`, `runtime_versions`, `supports_device_memory_ipc`); this module only
translates the answers into verl's names and shapes. Where verl's API is about one device
by nature (`is_cuda_available`, `is_npu_available`), it compares `backend.device_type`
with that device's name, and nothing else device-specific happens here.

`is_cuda_available` and `is_npu_available` are module attributes in verl; here they are
computed on first access (PEP 562), so importing this module resolves nothing.
"""

from __future__ import annotations

import enum
import logging
import types
from typing import Any

import torch

import hal

logger = logging.getLogger(__name__)

__all__ = [
    "AscendHardwareVersion",
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
    "get_vendor",
    "get_visible_devices_keyword",
    "is_ascend_npu_available",
    "is_cuda_available",
    "is_device_available",
    "is_npu_available",
    "is_rocm_visible_devices",
    "is_support_ipc",
    "is_torch_npu_available",
    "manual_seed",
    "manual_seed_all",
    "set_expandable_segments",
]

# verl's answer when the backend hides no devices (the CPU): setting it is harmless there.
_DEFAULT_VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
# Ray's built-in resource for a worker that needs no accelerator.
_CPU_RAY_RESOURCE = "CPU"
# The `runtime_versions()` key a ROCm build of the CUDA backend reports.
_ROCM_RUNTIME = "hip"


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


def is_device_available() -> bool:
    """True when the backend VERL_DEVICE selects is usable in this process (also on the
    CPU, whose device is always there); False, not an error, when it is known but not
    usable. An unknown VERL_DEVICE raises ValueError naming the valid backends."""
    from hal.backends.types import BackendUnavailableError

    try:
        hal.current()
    except BackendUnavailableError:
        return False
    return True


def get_vendor() -> str:
    """Who makes the device: "nvidia", "amd" (a ROCm build), "huawei"; "cpu" on cpu and sim."""
    return hal.current().vendor_name()


def manual_seed(seed: int) -> None:
    """Seed the current device's generator (torch's CPU generator on cpu and sim)."""
    hal.current().device_manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    """Seed every device's generator (torch's CPU generator on cpu and sim)."""
    hal.current().device_manual_seed(int(seed), all_devices=True)


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
    """True when the CUDA backend runs on a ROCm (HIP) build of torch (its runtime is "hip")."""
    backend = hal.current()
    return backend.device_type == "cuda" and _ROCM_RUNTIME in backend.runtime_versions()


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
    """Switch the caching allocator's expandable segments where the backend has the setting.

    CUDA always, NPU where torch_npu offers it; elsewhere (cpu, sim) a no-op, as in verl,
    with the backend's reason logged at debug level.
    """
    reason = hal.current().set_allocator_settings(expandable_segments=bool(enable))
    if reason is not None:
        logger.debug("set_expandable_segments(%r) changed nothing: %s", enable, reason)


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
    """(major, minor) compute capability of device `device_id`; (None, None) where the device has none."""
    capability = hal.current().device_capability(device_id)
    return (None, None) if capability is None else capability


class AscendHardwareVersion(enum.IntEnum):
    """Ascend chip generations, with verl's names and values."""

    NONE = 0
    A2 = 2
    A3 = 3
    A5 = 5
    MAX_VERSION = 999


def get_npu_versions() -> tuple[AscendHardwareVersion, str, str]:
    """(chip generation, driver software version, CANN toolkit version) of this Ascend
    host, the versions lower-cased.

    The versions are the npu backend's `runtime_versions()`: `info -t board -i 1` through
    npu-smi and the CANN toolkit's install-info file under ASCEND_HOME_PATH. The
    generation comes from the device's product name (`device_model()`, e.g. Ascend910B2
    is A2), `NONE` when it cannot be read, as in verl. Raises RuntimeError naming what is
    missing (npu-smi, its version line, the file), or that the resolved backend is not an
    NPU backend.
    """
    from hal.backends.npu import ascend_generation

    backend = hal.current()
    try:
        versions = backend.runtime_versions()
    except RuntimeError as exc:
        raise RuntimeError(f"get_npu_versions: {exc}") from exc
    if "driver" not in versions or "cann" not in versions:
        raise RuntimeError(
            f"get_npu_versions: backend {backend.name!r} reports no NPU driver and CANN versions "
            f"(runtime versions: {versions or 'none'}); select the npu backend with VERL_DEVICE"
        )
    try:
        model = backend.device_model()
    except Exception as exc:  # noqa: BLE001 - verl answers NONE whatever stops the query
        logger.debug("get_npu_versions: no device product name: %s", exc)
        model = None
    return AscendHardwareVersion(ascend_generation(model)), versions["driver"], versions["cann"]


def check_ipc_version_support(software_version: str, cann_version: str) -> bool:
    """True when driver >= 25.3.rc1 and CANN >= 8.3.rc1, the releases with NPU memory IPC.

    The comparison is the npu backend's (`hal.backends.npu.ipc_versions_supported`); an
    unrecognised version raises RuntimeError.
    """
    from hal.backends.npu import ipc_versions_supported

    return ipc_versions_supported(software_version, cann_version)


def is_support_ipc() -> bool:
    """True when device memory can be shared with another process through an IPC handle.

    The backend's `supports_device_memory_ipc()`: verl means device memory (CUDA/NPU IPC
    handles), so the CPU and sim backends answer False although `Backend.supports_ipc` is
    True for their shared-memory files. ROCm answers False; an NPU needs the driver and
    CANN releases that `check_ipc_version_support` names.
    """
    return hal.current().supports_device_memory_ipc()
