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
every function imports Ray when it is called. What an actor asks for and placement live in
hal.integrations.ray.placement, `ActorScope` in hal.integrations.ray.scope; this module
starts Ray and re-exports both. Only `join_sync_group` and
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
from typing import Any

from hal.integrations._shared import import_ray
from hal.integrations.ray.placement import (
    COLOCATED_STRATEGY,
    RAY_NOSET_PREFIX,
    SEPARATE_STRATEGY,
    actor_env,
    actor_resources,
    assigned_devices,
    bundle_options,
    bundle_resources,
    placement_group_for,
)
from hal.integrations.ray.scope import ActorScope

# the sync group (hal.sync.wire.group, no Ray needed), re-exported here for the Ray-minded reader
from hal.sync.wire import LOOPBACK, SyncGroupSpec, destroy_sync_group, join_sync_group

__all__ = [
    "COLOCATED_STRATEGY",
    "LOOPBACK",
    "RAY_NOSET_PREFIX",
    "SEPARATE_STRATEGY",
    "ActorScope",
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
    ray = import_ray()
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
