"""verl's platform "hal": every device question verl asks, answered by `hal.current()`.

verl 0.9.1 routes its device code through one platform object (`verl.plugin.platform.
get_platform()`, chosen by `VERL_PLATFORM`). With `VERL_PLATFORM=hal` that object is
`HalPlatform`, and `VERL_DEVICE=cpu|sim|cuda|npu` (hal's own variable) picks the device:

    VERL_PLATFORM=hal VERL_DEVICE=cpu python -c \\
        "from verl.utils.device import get_device_name; print(get_device_name())"   # cpu

Every answer is a question to the resolved backend (its declared attributes and its
hooks: `device_manual_seed`, `set_allocator_settings`, `device_capability`,
`supports_device_memory_ipc`, `profiler_range`, `profiler_control`, `vendor_name`); this
module only translates them into verl's names and shapes and holds no device branch.

Where the backend `VERL_DEVICE` names is known but not usable in this process (a CPU-only
Ray driver planning GPU workers), the declared answers (device name, collective library,
visible-devices variable, Ray resource) still come from the backend's class, so that the
driver plans for the device its workers will have; anything that touches a device raises
hal's error saying why. An unknown `VERL_DEVICE` raises hal's one-line error listing the
valid names on the first question.

hal is never auto-detected: `is_platform_available` answers False, so installing verl-hal
changes nothing until `VERL_PLATFORM=hal` is set. The plugin (hal.integrations.verl.plugin)
registers this class; importing this module registers nothing.
"""

from __future__ import annotations

import contextlib
import logging
from types import ModuleType
from typing import Any, Iterator

import torch
from verl.plugin.platform import PlatformBase

import hal
from hal.backends.interface import Backend
from hal.backends.types import BackendUnavailableError
from hal.device import backend_class

logger = logging.getLogger(__name__)

# The setting verl passes to `set_allocator_settings` ("expandable_segments:True"); the
# one allocator setting the backend contract has.
EXPANDABLE_SEGMENTS = "expandable_segments"
# verl's default visible-devices variable where a backend hides none (the CPU): harmless.
_DEFAULT_VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
# Ray's built-in resource for workers without an accelerator.
_CPU_RAY_RESOURCE = "CPU"


def _declared() -> type[Backend]:
    """The class of the backend VERL_DEVICE selects, also where it is not usable here."""
    try:
        return type(hal.current())
    except BackendUnavailableError:
        from hal import env

        return backend_class(env.device_name())


def _parse_bool(key: str, text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1"):
        return True
    if value in ("false", "0"):
        return False
    raise ValueError(f"hal platform: allocator setting {key}:{text!r}: expected True or False")


class HalPlatform(PlatformBase):
    """verl's `PlatformBase`, answered by the hal backend `VERL_DEVICE` resolves (see the module doc)."""

    # ---- core device management -------------------------------------------------------------
    @property
    def device_name(self) -> str:
        return _declared().device_type

    @property
    def vendor_name(self) -> str:
        try:
            return hal.current().vendor_name()
        except BackendUnavailableError:
            return _declared().vendor

    @property
    def device_module(self) -> ModuleType:
        return torch.get_device_module(_declared().device_type)

    def is_available(self) -> bool:
        """True when the backend is usable in this process. An unknown VERL_DEVICE raises."""
        try:
            hal.current()
        except BackendUnavailableError as exc:
            logger.warning("hal platform: %s", exc)
            return False
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        """False: hal is chosen with VERL_PLATFORM=hal only, never by verl's auto-detection."""
        return False

    def current_device(self) -> int:
        return hal.current().current_device()

    def device_count(self) -> int:
        return hal.current().device_count()

    def set_device(self, device_index: int) -> None:
        hal.current().set_device(int(device_index))

    def synchronize(self, device_index: int | None = None) -> None:
        backend = hal.current()
        current = backend.current_device()
        if device_index is None or int(device_index) == current:
            backend.synchronize()
            return
        backend.set_device(int(device_index))
        try:
            backend.synchronize()
        finally:
            backend.set_device(current)

    # ---- random numbers -------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        hal.current().device_manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        hal.current().device_manual_seed(int(seed), all_devices=True)

    # ---- memory ---------------------------------------------------------------------------
    def set_allocator_settings(self, settings: str) -> None:
        """verl's allocator string ("expandable_segments:True"); only expandable_segments is
        a setting of the backend contract: any other key raises ValueError naming it."""
        backend = hal.current()
        for item in filter(None, (part.strip() for part in str(settings).split(","))):
            key, sep, value = item.partition(":")
            if not sep or key.strip() != EXPANDABLE_SEGMENTS:
                raise ValueError(
                    f"hal platform: allocator setting {item!r} is not supported; the backend contract has "
                    f"{EXPANDABLE_SEGMENTS}:True|False only"
                )
            reason = backend.set_allocator_settings(expandable_segments=_parse_bool(key, value))
            if reason is not None:
                logger.debug("set_allocator_settings(%r) changed nothing: %s", item, reason)

    def empty_cache(self) -> None:
        hal.current().empty_cache()

    # ---- device properties ----------------------------------------------------------------
    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        capability = hal.current().device_capability(int(device_index))
        return (None, None) if capability is None else capability

    # ---- distributed communication --------------------------------------------------------
    def communication_backend_name(self) -> str:
        return _declared().dist_backend

    def visible_devices_envvar(self) -> str:
        return _declared().visible_devices_env or _DEFAULT_VISIBLE_DEVICES_ENV

    # ---- profiling ------------------------------------------------------------------------
    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        with hal.current().profiler_range(str(msg)):
            yield

    def profiler_start(self) -> None:
        reason = hal.current().profiler_control(start=True)
        if reason is not None:
            logger.debug("profiler_start: %s", reason)

    def profiler_stop(self) -> None:
        reason = hal.current().profiler_control(start=False)
        if reason is not None:
            logger.debug("profiler_stop: %s", reason)

    # ---- Ray --------------------------------------------------------------------------------
    def ray_resource_name(self) -> str:
        return _declared().ray_resource or _CPU_RAY_RESOURCE

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        """The device part of an actor's Ray options: `num_gpus` for "GPU", `resources=` for
        any other device, nothing for a backend Ray schedules as CPU only (cpu, sim)."""
        from hal.integrations.ray import actor_resources

        options = actor_resources(_declared(), devices=num_gpus, cpus=0)
        options.pop("num_cpus", None)
        return options

    def ray_noset_envvars(self) -> list[str]:
        from hal.integrations.ray import RAY_NOSET_PREFIX

        variable = _declared().visible_devices_env
        return [] if variable is None else [RAY_NOSET_PREFIX + variable]

    # ---- IPC --------------------------------------------------------------------------------
    def is_ipc_supported(self) -> bool:
        """Device memory IPC (`supports_device_memory_ipc`): False on cpu and sim, whose
        shared-memory files are not what verl means."""
        return hal.current().supports_device_memory_ipc()

    # ---- low-level runtime ------------------------------------------------------------------
    def cudart(self) -> Any:
        """None: hal hands out no raw runtime API (no verl 0.9.1 code asks the platform for it)."""
        return None
