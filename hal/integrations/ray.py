"""Ray: trainer and engine actors placed by the backend's resource, joined in one sync group.

    from hal.integrations import ray as hal_ray

    hal_ray.init_loopback(num_cpus=4)                    # tests and demos: nothing leaves 127.0.0.1
    with hal_ray.ActorScope() as scope:                  # kills and waits for all of it on exit
        pg = scope.add_placement_group(hal_ray.placement_group_for(2, colocated=True))
        spec = hal_ray.SyncGroupSpec.create(world_size=2)   # the trainer side owns the rendezvous
        options = {**hal_ray.actor_resources(), "runtime_env": {"env_vars": hal_ray.actor_env()}}
        trainer = scope.add(Trainer.options(**options, **hal_ray.bundle_options(pg, 0)).remote(spec))
        engine = scope.add(Engine.options(**options, **hal_ray.bundle_options(pg, 1)).remote(spec))

    # in each actor: a group outside c10d's registry, beside any default group (FSDP's)
    group = hal_ray.join_sync_group(spec, rank)          # trainer rank 0, engine workers 1..
    sender = Sender(BroadcastTransport(group))           # or Receiver(BroadcastTransport(group), specs)
    ...
    hal_ray.destroy_sync_group(group)

Importing this module imports neither Ray nor any device library and starts nothing:
every function imports Ray when it is called. Only `join_sync_group` and
`destroy_sync_group` work without Ray (they are plain torch.distributed).

The sync group speaks the rendezvous of vLLM's `stateless_init_torch_distributed_process_group`
(a TCPStore served by rank 0 at the spec's address, keys under the prefix
`tcp://<address>:<port>`), so a trainer actor without vLLM joins the group that the hal
engine's vLLM workers join with that helper (hal.integrations.vllm), and the other way round.
Unlike that helper, rank 0's store listens on the spec's address only, and a gloo rank's
own listener on `bind_address` only (docs/ray.md, "What listens where").
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TypeVar

from hal import env
from hal.backend import Backend
from hal.sync.group import LOOPBACK, SyncGroupSpec, destroy_sync_group, join_sync_group

__all__ = [
    "ActorScope",
    "RayEngine",
    "LOOPBACK",
    "SyncGroupSpec",
    "actor_env",
    "actor_resources",
    "assigned_devices",
    "bundle_options",
    "bundle_resources",
    "destroy_sync_group",
    "init_loopback",
    "join_sync_group",
    "placement_group_for",
]


# Ray's own environment variables that this module sets (hal's own are in hal/env.py).
# Ray resolves a loopback node address given to `ray.init(_node_ip_address=...)` to the
# machine's interface address unless this is "0"; read once, when `ray` is first imported.
RAY_ENABLE_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# "0": Ray sends no usage report (its default is to send one to a server on the internet).
RAY_USAGE_STATS_ENV = "RAY_USAGE_STATS_ENABLED"
# Ray rewrites a device's visible-devices variable (CUDA_VISIBLE_DEVICES,
# ASCEND_RT_VISIBLE_DEVICES) in each actor to the devices it was given, unless the variable
# `RAY_EXPERIMENTAL_NOSET_<that variable>` is set in the actor's environment.
RAY_NOSET_PREFIX = "RAY_EXPERIMENTAL_NOSET_"

# Placement strategies by placement (Ray's names).
COLOCATED_STRATEGY = "STRICT_PACK"  # every bundle on one node: actors sharing devices share a node
SEPARATE_STRATEGY = "SPREAD"  # bundles on as many nodes as Ray can find, one node if that is all

_A = TypeVar("_A")


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError(f"hal.integrations.ray needs Ray: pip install 'verl-hal[ray]' ({exc})") from None
    return ray


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


# ---- starting Ray ----------------------------------------------------------------------
def init_loopback(*, num_cpus: int, **ray_init_kwargs: Any) -> None:
    """Start a local Ray instance whose every server listens on 127.0.0.1 only.

    For tests and demos. `ray.init(_node_ip_address="127.0.0.1")` alone is not enough with
    Ray 2.60: Ray replaces a loopback node address with the machine's interface address,
    and its raylet, GCS and agents then listen there (measured: docs/ray.md). This sets
    `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (Ray then keeps 127.0.0.1) and
    `RAY_USAGE_STATS_ENABLED=0` in this process's environment, which Ray's processes
    inherit (and, when something imported Ray already, the private constant Ray read the
    variable into); it starts no dashboard. Raises RuntimeError if Ray is
    already running here, or if it came up on another address (Ray was imported before
    with that variable unset: set it before anything imports Ray), after shutting it down.
    """
    if "ray" in ray_init_kwargs or "address" in ray_init_kwargs:
        raise ValueError("init_loopback starts a new local instance; it takes no address")
    os.environ[RAY_ENABLE_CLUSTER_ENV] = "0"
    os.environ[RAY_USAGE_STATS_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and hasattr(constants, "ENABLE_RAY_CLUSTER"):
        # Ray was imported already (vLLM imports it): it read the variable at import, into
        # this private constant, which ray.init consults; set it to what the variable says.
        constants.ENABLE_RAY_CLUSTER = False
    ray = _import_ray()
    if ray.is_initialized():
        raise RuntimeError("init_loopback: Ray is already initialized in this process")
    ray_init_kwargs.setdefault("include_dashboard", False)
    ray.init(num_cpus=num_cpus, _node_ip_address=LOOPBACK, **ray_init_kwargs)
    address = ray.util.get_node_ip_address()
    if address != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(
            f"init_loopback: Ray came up on {address}, not {LOOPBACK}: Ray was imported before "
            f"{RAY_ENABLE_CLUSTER_ENV}=0 was set; set it in the environment before anything imports ray"
        )


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
    ray = _import_ray()
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
    ray = _import_ray()
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


# ---- the sync group: hal.sync.group (no Ray needed); SyncGroupSpec, join_sync_group and
# destroy_sync_group are re-exported from here for the Ray-minded reader ---------------------

# ---- tear-down ---------------------------------------------------------------------------
def _whereabouts(_actor: Any) -> tuple[str, int]:
    """Run inside an actor through `__ray_call__`: its node and process id."""
    import os as _os

    import ray as _ray

    return _ray.get_runtime_context().get_node_id(), _os.getpid()


class ActorScope:
    """Every actor and placement group added here is gone after `close()` (or the `with`).

    `close()` kills each actor, waits until Ray reports it dead and, for an actor on this
    node, until its process has exited; then removes each placement group and waits until
    Ray reports it removed. Past `timeout_s` it raises TimeoutError naming what is left.
    """

    def __init__(self, *, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._actors: list[tuple[Any, Any]] = []  # (handle, where it runs: an ObjectRef of _whereabouts)
        self._groups: list[Any] = []

    def add(self, actor: _A) -> _A:
        """Track `actor` (returned, so that `scope.add(Cls.remote())` reads naturally)."""
        self._actors.append((actor, actor.__ray_call__.remote(_whereabouts)))
        return actor

    def add_placement_group(self, placement_group: _A) -> _A:
        self._groups.append(placement_group)
        return placement_group

    def __enter__(self) -> ActorScope:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        ray = _import_ray()
        deadline = time.monotonic() + self.timeout_s
        actors, self._actors = self._actors, []
        groups, self._groups = self._groups, []
        if not ray.is_initialized():
            return  # Ray is gone, and everything it ran with it
        here = ray.get_runtime_context().get_node_id()
        processes: list[int] = []
        refs = [where for _, where in actors]
        if refs:  # an actor added a moment ago may not have answered yet: give it a second
            ray.wait(refs, num_returns=len(refs), timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        for actor, where in actors:
            ready, _ = ray.wait([where], timeout=0)
            if ready:
                try:
                    node, pid = ray.get(where)
                    if node == here:
                        processes.append(pid)
                except ray.exceptions.RayError:
                    pass  # it never started or already died
            ray.kill(actor, no_restart=True)
        left = [_wait_dead(ray, actor, deadline) for actor, _ in actors]
        left = [str(a) for a in left if a is not None]
        left += [f"process {pid}" for pid in processes if not _wait_exited(pid, deadline)]
        from ray.util.placement_group import placement_group_table, remove_placement_group

        for pg in groups:
            remove_placement_group(pg)
        for pg in groups:
            while placement_group_table(pg).get("state") != "REMOVED" and time.monotonic() < deadline:
                time.sleep(0.05)
            if placement_group_table(pg).get("state") != "REMOVED":
                left.append(f"placement group {pg.id.hex()}")
        if left:
            raise TimeoutError(f"ActorScope: still there after {self.timeout_s:g} s: {', '.join(left)}")


def _wait_dead(ray: Any, actor: Any, deadline: float) -> Any:
    """None once Ray reports `actor` dead; the actor if it is not by the deadline."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return actor
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=remaining)
        except ray.exceptions.ActorDiedError:
            return None
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.05)


def _wait_exited(pid: int, deadline: float) -> bool:
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return True  # a process of another user has that id now: ours is gone
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


# ---- an engine actor, seen as a WeightSync engine -------------------------------------------
class RayEngine:
    """A Ray actor handle that serves vLLM's weight-update API, as `WeightSync` drives an
    engine (`hal.integrations.vllm_client.Engine`): every call is a remote call, waited for.

    The actor holds the `vllm.LLM` and exposes `init_weight_transfer_engine(init_info)`,
    `start_weight_update()`, `update_weights(update_info)`, `finish_weight_update(version)`,
    `update_weight_version(version)`, `get_weight_version()`, `reset_prefix_cache()` and
    `shutdown_weight_transfer_engine()` (the demo's `EngineActor` does). `same_node` says
    whether its workers share the trainer's node (shared-memory transport possible).
    """

    def __init__(self, actor: Any, *, name: str, num_workers: int, same_node: bool = False, timeout_s: float = 300.0) -> None:
        self.actor = actor
        self.name = name
        self.num_workers = num_workers
        self.same_node = same_node
        self.timeout_s = timeout_s

    def _call(self, method: str, *args: Any) -> Any:
        ray = _import_ray()
        return ray.get(getattr(self.actor, method).remote(*args), timeout=self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)

    def update_weight_version(self, weight_version: str) -> None:
        self._call("update_weight_version", weight_version)

    def get_weight_version(self) -> str:
        return self._call("get_weight_version")

    def reset_prefix_cache(self) -> None:
        self._call("reset_prefix_cache")

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("shutdown_weight_transfer_engine")
