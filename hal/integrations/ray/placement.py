"""What a Ray actor asks for, and where it goes: the backend's Ray resource, the environment an
actor needs to resolve the same backend, the devices Ray gave it, and placement groups.

Plans by the backend's declared attributes only (`ray_resource`, `visible_devices_env`),
so a driver without the device (a CPU-only Ray head) plans actors for it by name. Imports
Ray only inside the functions that need it.
"""

from __future__ import annotations

import os
from typing import Any

from hal import env
from hal.backends.interface import Backend
from hal.integrations._shared import import_ray

# Ray rewrites a device's visible-devices variable (CUDA_VISIBLE_DEVICES,
# ASCEND_RT_VISIBLE_DEVICES) in each actor to the devices it was given, unless the variable
# `RAY_EXPERIMENTAL_NOSET_<that variable>` is set in the actor's environment.
RAY_NOSET_PREFIX = "RAY_EXPERIMENTAL_NOSET_"

# Placement strategies by placement (Ray's names).
COLOCATED_STRATEGY = "STRICT_PACK"  # every bundle on one node: actors sharing devices share a node
SEPARATE_STRATEGY = "SPREAD"  # bundles on as many nodes as Ray can find, one node if that is all


def _backend_class(backend: Backend | type[Backend] | str | None) -> type[Backend]:
    """The backend's class: its declared attributes are all the planning needs, so a driver
    on a node without the device (a CPU-only Ray head) can plan actors for it by name."""
    if backend is None:
        import hal

        return type(hal.current())
    if isinstance(backend, str):
        from hal.device import backend_class

        return backend_class(backend.strip().lower())
    if isinstance(backend, Backend):
        return type(backend)
    if isinstance(backend, type) and issubclass(backend, Backend):
        return backend
    raise TypeError(f"backend must be a hal Backend, its class, a backend name or None, got {type(backend).__name__}")


def _amount(value: float, what: str, *, device: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{what} must be a non-negative number, got {value!r}")
    if device and value > 1 and value != int(value):
        raise ValueError(f"{what} above 1 must be a whole number (devices are shared only as fractions of one), got {value!r}")
    return value


# ---- what an actor asks for ------------------------------------------------------------
def actor_resources(backend: Backend | type[Backend] | str | None = None, *, devices: float = 1, cpus: float = 1) -> dict[str, Any]:
    """Ray actor options asking for `devices` of the backend's device and `cpus` CPUs.

    The device is the backend's `ray_resource`: Ray's `num_gpus` for "GPU", `resources=
    {name: devices}` for any other ("NPU"), nothing for a backend Ray schedules as CPU only
    (cpu, sim). Fractions below 1 share one device (a trainer and an engine colocated on
    it). `backend`: a Backend, its class or its name (`"cuda"`); None: `hal.current()`.

        Actor.options(**actor_resources("cuda", devices=0.5), **bundle_options(pg, 0))
    """
    cls = _backend_class(backend)
    devices = _amount(devices, "devices", device=True)
    options: dict[str, Any] = {"num_cpus": _amount(cpus, "cpus")}
    if cls.ray_resource is None or devices == 0:
        return options
    if cls.ray_resource == "GPU":  # Ray refuses "GPU" under resources=: it has its own field
        options["num_gpus"] = devices
    else:
        options["resources"] = {cls.ray_resource: devices}
    return options


def actor_env(backend: Backend | type[Backend] | str | None = None, *, see_all_devices: bool = False) -> dict[str, str]:
    """Environment variables for a worker actor's `runtime_env={"env_vars": ...}`.

    Always `VERL_DEVICE=<backend>`, so `hal.current()` in the actor is the backend the
    driver planned with. By default Ray sets the backend's visible-devices variable in
    each actor to the devices it was given, and the actor's first device is index 0: what
    an FSDP trainer actor and a one-device engine actor want. With `see_all_devices`,
    `RAY_EXPERIMENTAL_NOSET_<variable>=1` keeps the node's variable, so every actor numbers
    devices alike (needed where one actor opens another's device memory by index, e.g. IPC
    between actors on different devices of a node, as verl does for its rollout workers);
    `assigned_devices()` then says which indices are the actor's. A backend without a
    visible-devices variable (cpu, sim) gets nothing more. The sync token
    (VERL_HAL_SYNC_TOKEN) is never added: runtime_env values are readable through Ray's
    state API; hand it to the actors another way.
    """
    cls = _backend_class(backend)
    out = {env.VERL_DEVICE: cls.name}
    if see_all_devices and cls.visible_devices_env is not None:
        out[RAY_NOSET_PREFIX + cls.visible_devices_env] = "1"
    return out


def assigned_devices(backend: Backend | type[Backend] | str | None = None) -> list[int]:
    """Inside an actor: the indices, as this process numbers devices, of the devices Ray
    gave it (`hal.current().set_device(assigned_devices()[0])`). Empty for a backend Ray
    schedules as CPU only. Right with and without `actor_env(see_all_devices=True)`."""
    cls = _backend_class(backend)
    if cls.ray_resource is None:
        return []
    ray = import_ray()
    ids = [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get(cls.ray_resource, [])]
    visible = os.environ.get(cls.visible_devices_env) if cls.visible_devices_env else None
    return _indices_in_view(ids, visible, cls.visible_devices_env or "")


def _indices_in_view(ids: list[str], visible: str | None, variable: str) -> list[int]:
    """Ray's device ids are entries of the node's visible-devices list; this process numbers
    devices by their position in its own list (all devices, in order, when unset)."""
    if not visible:
        return [int(i) for i in ids]
    order = [v.strip() for v in visible.split(",")]
    missing = [i for i in ids if i not in order]
    if missing:
        raise RuntimeError(f"Ray assigned devices {missing} that are not in this process's {variable}={visible!r}")
    return [order.index(i) for i in ids]


# ---- placement -------------------------------------------------------------------------
def bundle_resources(backend: Backend | type[Backend] | str | None = None, *, devices: float = 1, cpus: float = 1) -> dict[str, float]:
    """One placement-group bundle: `{"CPU": cpus, <the backend's ray_resource>: devices}`,
    without the device for a backend Ray schedules as CPU only (or for `devices=0`)."""
    cls = _backend_class(backend)
    bundle: dict[str, float] = {"CPU": _amount(cpus, "cpus")}
    devices = _amount(devices, "devices", device=True)
    if cls.ray_resource is not None and devices > 0:
        bundle[cls.ray_resource] = devices
    if not any(bundle.values()):
        raise ValueError("a bundle must ask for something: cpus and devices are both 0")
    return bundle


def placement_group_for(
    bundles: int,
    *,
    colocated: bool,
    backend: Backend | type[Backend] | str | None = None,
    devices_per_bundle: float = 1,
    cpus_per_bundle: float = 1,
    strategy: str | None = None,
    name: str = "",
    timeout_s: float = 60.0,
) -> Any:
    """A placement group of `bundles` equal bundles that Ray reports as created.

    Each bundle holds `devices_per_bundle` of the backend's `ray_resource` (none for a CPU
    only backend) and `cpus_per_bundle` CPUs. `colocated`: every bundle on one node
    (STRICT_PACK), for actors that share devices (a trainer rank and an engine worker in one
    bundle, each asking for part of it); otherwise spread over nodes (SPREAD), for trainer
    and engine on devices of their own. `strategy` overrides either (e.g. "PACK" for a
    colocated job larger than a node, or one group per node as verl does). Raises
    TimeoutError, after removing the group, when Ray cannot place it within `timeout_s`.
    """
    if isinstance(bundles, bool) or not isinstance(bundles, int) or bundles < 1:
        raise ValueError(f"bundles must be a positive int, got {bundles!r}")
    bundle = bundle_resources(backend, devices=devices_per_bundle, cpus=cpus_per_bundle)
    strategy = strategy or (COLOCATED_STRATEGY if colocated else SEPARATE_STRATEGY)
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([dict(bundle) for _ in range(bundles)], strategy=strategy, name=name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise TimeoutError(
            f"placement group of {bundles} x {bundle} ({strategy}) not placed within {timeout_s:g} s; "
            f"the cluster has {ray.available_resources()} available"
        )
    return pg


def bundle_options(placement_group: Any, index: int, *, capture_child_tasks: bool = False) -> dict[str, Any]:
    """Ray actor options that schedule an actor into bundle `index` of `placement_group`.

    `capture_child_tasks`: the actor's own tasks and actors go into the same group (an
    engine actor whose workers Ray starts). The actor's resources (`actor_resources`) must
    fit in the bundle.
    """
    count = placement_group.bundle_count
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise ValueError(f"bundle index {index!r} out of range for a placement group of {count} bundles")
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=placement_group,
            placement_group_bundle_index=index,
            placement_group_capture_child_tasks=capture_child_tasks,
        )
    }
