"""Who meets whom in verl's checkpoint engine "hal": `build_topology` from every worker's `prepare()`.

verl's `CheckpointEngineManager` calls `prepare()` on every trainer and rollout worker, hands
the list (trainer ranks first, in rank order, then rollout workers) to the engine class's
`build_topology`, and dispatches what it returns to each worker's `init_process_group`.
Two shapes, by `engine_kwargs["hal"]["senders"]`:

- `"gather"`: one sync group, trainer rank 0 (sync rank 0, the sender) and rollout worker i
  (sync rank 1 + i); the other trainer ranks are outside it (`NOT_IN_GROUP`).
  `init_process_group(role=, rank=, spec=, transport=, reuse=)`.
- `"all"`: one sync group per trainer rank r, trainer rank r (sync rank 0, the sender of
  its own shard) and every rollout worker (sync rank 1 + i), meeting at trainer rank r.
  A trainer rank joins its own; a rollout worker joins all of them, in trainer-rank order.
  `init_process_group(role=, rank=, specs=[...], transports=[...], reuse=)`.

A group meets on 127.0.0.1 when all its members are on its sender's node, else on the
sender's node address. The groups of the previous update are kept when every member still
reports them under the same rank (`reuse`); any change builds all of them again.
Imports no verl.
"""

from __future__ import annotations

from typing import Any

from hal.integrations.verl.settings import FORMER_SENDERS, SENDERS_CHOICES
from hal.sync.config import ALL, GATHER
from hal.sync.wire import LOOPBACK, SyncGroupSpec

# The sync rank of trainer ranks outside the sync group ("gather": they gather, they do not send).
NOT_IN_GROUP = -1

GroupKey = tuple[str, int, int]  # (address, port, world size) of a sync group


def group_key(spec: SyncGroupSpec | None) -> GroupKey | None:
    return None if spec is None else (spec.address, spec.port, spec.world_size)


def _worker(index: int, trainers: int) -> str:
    return f"trainer rank {index}" if index < trainers else f"rollout worker {index - trainers}"


def _transport(sender: dict[str, Any], members: list[dict[str, Any]]) -> str:
    """The transport of one group: the sender's setting, or for "auto" shared memory on
    one node with host IPC, hierarchical across nodes with several receivers on a node,
    broadcast otherwise (and always for device memory)."""
    transport = sender["transport"]
    if transport != "auto":
        return transport
    nodes = [m["node"] for m in members]
    if not sender["host_ipc"]:
        return "broadcast"
    if all(n == sender["node"] for n in nodes):
        return "ipc"
    return "hierarchical" if len(set(nodes)) < len(nodes) else "broadcast"


def _meeting(sender: dict[str, Any], members: list[dict[str, Any]], kept: GroupKey | None) -> SyncGroupSpec:
    if kept is not None:
        address, port, _ = kept
    elif all(m["node"] == sender["node"] for m in members):
        address, port = LOOPBACK, sender["local_port"]
    else:
        address, port = sender["address"], sender["port"]
    return SyncGroupSpec(address=address, port=port, world_size=len(members))


def senders_of(metadata: list[dict[str, Any]], trainers: int) -> str:
    """The `senders` setting every worker reports (a worker of before the setting says
    "gather"; a former name is its word's); ValueError naming two that disagree."""
    said = [m.get("senders", GATHER) for m in metadata]
    said = [FORMER_SENDERS.get(value, value) if isinstance(value, str) else value for value in said]
    for index, value in enumerate(said):
        if value not in SENDERS_CHOICES:
            raise ValueError(f"build_topology: {_worker(index, trainers)} reports senders {value!r}; valid: {', '.join(SENDERS_CHOICES)}")
        if value != said[0]:
            raise ValueError(
                f"build_topology: engine_kwargs['hal'].senders differs between workers: {_worker(0, trainers)} "
                f"says {said[0]!r}, {_worker(index, trainers)} says {value!r}; every trainer and rollout worker needs the same"
            )
    return said[0]


def build(trainers: int, rollouts: int, metadata: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """`HalCheckpointEngine.build_topology` (see the module doc)."""
    if len(metadata) != trainers + rollouts:
        raise ValueError(f"build_topology: {len(metadata)} metadata for {trainers} + {rollouts} workers")
    if not metadata[0].get("master") or any(m.get("master") for m in metadata[1:]):
        raise ValueError("build_topology: trainer rank 0, and only it, must be the checkpoint engine's master (is_master=True)")
    if senders_of(metadata, trainers) == ALL:
        return _every_trainer_rank(trainers, rollouts, metadata)
    return _gathered(trainers, rollouts, metadata)


def _gathered(trainers: int, rollouts: int, metadata: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    master = metadata[0]
    members = [master, *metadata[trainers:]]
    world_size = len(members)
    reuse = master["group"] is not None and master["group"][2] == world_size and all(
        m["group"] == master["group"] and m["rank"] == rank for rank, m in enumerate(members)
    )
    common = {
        "spec": _meeting(master, members, master["group"] if reuse else None),
        "transport": _transport(master, members),
        "reuse": reuse,
    }
    actor = {
        "role": ["trainer"] * trainers,
        "rank": [0] + [NOT_IN_GROUP] * (trainers - 1),
        **{k: [v] * trainers for k, v in common.items()},
    }
    rollout = {
        "role": ["rollout"] * rollouts,
        "rank": list(range(1, world_size)),
        **{k: [v] * rollouts for k, v in common.items()},
    }
    return actor, rollout


def _every_trainer_rank(trainers: int, rollouts: int, metadata: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    senders, receivers = metadata[:trainers], metadata[trainers:]
    refused = [(r, m["refused"]) for r, m in enumerate(senders) if m.get("refused")]
    if refused:
        rank, reason = refused[0]
        raise ValueError(f"checkpoint engine 'hal': senders 'all' is refused on trainer rank {rank}: {reason}")
    world_size = 1 + rollouts
    # every sender in its own group (rank 0 there), every rollout worker in all of them under one rank
    kept = [m["group"][0] if m["group"] and len(m["group"]) == 1 and m["rank"] == 0 else None for m in senders]
    reuse = all(k is not None and k[2] == world_size for k in kept) and all(
        m["group"] == tuple(kept) and m["rank"] == 1 + i for i, m in enumerate(receivers)
    )
    specs = [_meeting(s, [s, *receivers], kept[r] if reuse else None) for r, s in enumerate(senders)]
    transports = [_transport(s, [s, *receivers]) for s in senders]
    actor = {
        "role": ["trainer"] * trainers,
        "rank": [0] * trainers,
        "specs": [[spec] for spec in specs],
        "transports": [[t] for t in transports],
        "reuse": [reuse] * trainers,
    }
    rollout = {
        "role": ["rollout"] * rollouts,
        "rank": list(range(1, world_size)),
        "specs": [list(specs) for _ in range(rollouts)],
        "transports": [list(transports) for _ in range(rollouts)],
        "reuse": [reuse] * rollouts,
    }
    return actor, rollout


def node_address() -> str:
    """This node's address as Ray knows it (127.0.0.1 on a loopback-only Ray), else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except ImportError:
        pass
    return LOOPBACK
