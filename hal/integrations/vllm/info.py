"""What a trainer sends a hal vLLM engine: `HalInitInfo` once, `HalUpdateInfo` with each update.

vLLM parses both from the dicts its API carries (`init_weight_transfer_engine({"init_info":
...})`, `update_weights({"update_info": ...})`) with the engine's `init_info_cls` /
`update_info_cls`; the trainer side (hal.integrations.vllm.weight_sync) builds them. Also
which of hal's transports (`hal.sync.TRANSPORTS`) `HalInitInfo.transport` takes, and the
dtype names as they travel (the names a sync's header gives them, hal.sync.wire.header_json).
hal.integrations.vllm re-exports every name here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from hal.sync.plan.exchange import check_receive
from hal.sync.wire import header_json

ENGINE_TRANSPORTS = ("broadcast", "ipc")
"""The transports (by their name in `hal.sync.TRANSPORTS`) a vLLM engine takes."""


def dtype_from_name(name: str | None) -> torch.dtype | None:
    """`"bfloat16"` or `"torch.bfloat16"` -> torch.bfloat16, a dtype a sync may carry
    (`hal.sync.wire.header_json.WIRE_DTYPES`; ValueError naming the valid ones otherwise); None stays None."""
    return None if name is None else header_json.dtype_from_name(str(name).removeprefix("torch."))


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """The name `dtype` travels under (`hal.sync.wire.header_json.dtype_name`); None stays None."""
    return None if dtype is None else header_json.dtype_name(dtype)


@dataclass(kw_only=True)
class HalInitInfo(WeightTransferInitInfo):
    """What every worker needs to join the trainer's group, sent once by the trainer.

    The sync settings travel here so sender and receivers cannot disagree on them.
    """

    master_address: str
    """Host of the trainer's rendezvous store (the trainer is rank 0 of the group)."""
    master_port: int
    rank_offset: int = 1
    """Group rank of this engine's first worker; worker `r` of the engine joins as `rank_offset + r`."""
    world_size: int = 2
    """Trainer (1) plus every worker of every engine in the group."""
    wire_dtype: str | None = None
    """The dtype floating-point tensors travel in, when the trainer casts (the engine's
    expected specs follow it). Bucket and segment sizes and verification are not here:
    every sync's header carries them."""
    timeout_s: float = 60.0
    """Longest wait of a worker for the trainer or the other workers, in any sync."""
    transport: str = "broadcast"
    """"broadcast": each bucket is broadcast over the group (any topology). "ipc": buckets
    live in memory the trainer shares with the workers (same node only, and the backend
    must support IPC); the group only carries control messages."""
    rendezvous: list[dict[str, Any]] | None = None
    """Every trainer rank sends (`WeightSync(..., senders="all")`): each rank's rendezvous,
    `{"address": ..., "port": ...}`, in trainer-rank order, the first being
    `master_address:master_port`. Each worker then joins one group per trainer rank (the
    same rank, `rank_offset + r`, and `world_size` in each) and receives every sync from
    all of them at once (`hal.sync.ShardedReceiver`). None: trainer rank 0 alone sends,
    over the group at `master_address:master_port`. Only with `transport="broadcast"`."""
    receive: str = "whole"
    """How each worker takes a sync (hal.sync.plan.exchange.RECEIVE): "whole", every tensor
    whole (its loaders cut out its shard); "shard", only its own pieces, landed straight in
    its layers (hal.integrations.vllm.shard_receive), refused at init by name where a worker's
    loaders cannot be recorded; "auto", "shard" where every worker recorded its needs, else
    "whole". Not "whole": at init every worker records its needs and every rank of every
    sync group gathers them. Only with `transport="broadcast"`."""
    auth: str | None = None
    """The trainer's proof that it knows the engine's token (`hal.sync.wire.auth.init_proof`
    over every other field, `proven()`, `rendezvous` included); None from a trainer without one."""

    def proven(self) -> dict[str, Any]:
        """The fields `auth` proves (`hal.sync.wire.auth.init_proof`): all but the proof itself."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "auth"}

    def __post_init__(self) -> None:
        if self.transport not in ENGINE_TRANSPORTS:
            raise ValueError(f"HalInitInfo.transport must be one of {sorted(ENGINE_TRANSPORTS)}, got {self.transport!r}")
        if not 1 <= self.rank_offset < self.world_size:
            raise ValueError(f"HalInitInfo.rank_offset {self.rank_offset} outside 1..{self.world_size - 1} (world_size)")
        dtype_from_name(self.wire_dtype)
        check_receive(self.receive, "HalInitInfo.receive")
        if self.receive != "whole" and self.transport != "broadcast":
            raise ValueError(f"HalInitInfo.receive {self.receive!r}: a shard receive goes over the 'broadcast' transport's groups, got transport {self.transport!r}")
        if self.rendezvous is not None:
            self.rendezvous = check_rendezvous(self.rendezvous, self.master_address, self.master_port, self.transport)

    def endpoints(self) -> list[tuple[str, int]]:
        """(address, port) of every sending trainer rank's group, in trainer-rank order."""
        if self.rendezvous is None:
            return [(self.master_address, self.master_port)]
        return [(s["address"], s["port"]) for s in self.rendezvous]


def check_rendezvous(rendezvous: Any, master_address: str, master_port: int, transport: str) -> list[dict[str, Any]]:
    """`HalInitInfo.rendezvous` as a list of `{"address": str, "port": int}`; ValueError naming
    the field (and the entry) otherwise."""
    if not isinstance(rendezvous, (list, tuple)) or not rendezvous:
        raise ValueError(f"HalInitInfo.rendezvous must be a non-empty list of {{'address', 'port'}}, got {rendezvous!r}"[:300])
    if transport != "broadcast":
        raise ValueError(
            f"HalInitInfo.rendezvous: several sending trainer ranks need transport 'broadcast', got {transport!r}"
        )
    out: list[dict[str, Any]] = []
    seen: set[tuple[str, int]] = set()
    for i, entry in enumerate(rendezvous):
        where = f"HalInitInfo.rendezvous[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"address", "port"}:
            raise ValueError(f"{where} must be {{'address': str, 'port': int}}, got {entry!r}"[:300])
        address, port = entry["address"], entry["port"]
        if not isinstance(address, str) or not address.strip():
            raise ValueError(f"{where}.address must be a non-empty host, got {address!r}"[:300])
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"{where}.port must be a TCP port (1..65535), got {port!r}"[:300])
        if (address, port) in seen:
            raise ValueError(f"{where}: {address}:{port} is listed twice; each trainer rank has a rendezvous of its own")
        seen.add((address, port))
        out.append({"address": address, "port": port})
    if (out[0]["address"], out[0]["port"]) != (master_address, master_port):
        raise ValueError(
            f"HalInitInfo.rendezvous[0] is {out[0]['address']}:{out[0]['port']}, but master_address:master_port is "
            f"{master_address}:{master_port}: trainer rank 0's rendezvous is both"
        )
    return out


@dataclass(kw_only=True)
class HalUpdateInfo(WeightTransferUpdateInfo):
    """One update: the weight version the trainer is about to send (its step)."""

    version: int
