"""Who sends and who receives: the one place a sync's sender and receiver are chosen.

A sync has one of three sending sides, by which trainer ranks send (`SENDING`):

- `"one"`: this process alone holds the model and sends it (`Sender`);
- `"gather"`: a sharded trainer's ranks gather in lockstep and one of them sends
  (`TrainerSync`: the sending rank passes its transport, the others None);
- `"all"`: every trainer rank sends its own rows over a group of its own (`ShardedSender`).

The receiving side follows from it: one sender, one `Receiver`; every trainer rank, a
`ShardedReceiver` of one transport per trainer rank. Either is a `SyncReceiver`, the
contract the engines (hal.integrations.vllm, verl's checkpoint engine) use and nothing
more. `WeightSync`, the vLLM engine and verl's checkpoint engine all choose here
(`make_sender`, `make_receiver`), and name transports from one registry (`TRANSPORTS`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import torch

from hal.backends.interface import Backend
from hal.sync.config import SyncConfig
from hal.sync.transport.hierarchical import HierarchicalTransport
from hal.sync.transport.ipc import IpcTransport
from hal.sync.metrics import SyncMetrics
from hal.sync.spec import TensorSpec
from hal.sync.receive.receiver import Receiver
from hal.sync.send.sender import Sender
from hal.sync.send.sharded import ShardedSender
from hal.sync.receive.sharded import ShardedReceiver
from hal.sync.send.gather import TrainerSync
from hal.sync.transport.broadcast import BroadcastTransport
from hal.sync.transport.base import Transport

ONE, GATHER, ALL = "one", "gather", "all"
SENDING = (ONE, GATHER, ALL)
"""Which trainer ranks send a sync (see the module doc)."""

TRANSPORTS: Mapping[str, type[Transport]] = MappingProxyType(
    {"broadcast": BroadcastTransport, "ipc": IpcTransport, "hierarchical": HierarchicalTransport}
)
"""Every transport by the name a setting gives it (an engine may offer a subset)."""


@runtime_checkable
class SyncReceiver(Protocol):
    """What an engine holds to take syncs, whichever side sends (`Receiver`, `ShardedReceiver`)."""

    @property
    def version(self) -> int | None:
        """The weight version held: set after a sync that every rank completed, never after a failed one."""

    @property
    def consistent(self) -> bool:
        """False while the weights mix two versions (a failed sync applied part of itself)."""

    @property
    def torn(self) -> tuple[str, ...]:
        """Tensors whose bytes may be neither old nor new (a group broke mid in-place transfer)."""

    def receive(self, sink: Any) -> SyncMetrics:
        """Take one sync into `sink` (a `Sink`, or a callable `apply(pairs)`)."""

    def close(self) -> None:
        """Free the transports' buffers (the groups are their owner's)."""


def _check_sending(sending: str) -> None:
    if sending not in SENDING:
        raise ValueError(f"sending must be one of {', '.join(SENDING)}, got {sending!r}")


def open_transport(name: str, group: Any, *, control_device: str | torch.device, src: int = 0) -> Transport:
    """The transport `name` (`TRANSPORTS`) over `group`; ValueError naming the valid ones."""
    cls = TRANSPORTS.get(name)
    if cls is None:
        raise ValueError(f"unknown transport {name!r}; valid: {', '.join(TRANSPORTS)}")
    return cls(group, src=src, control_device=control_device)


def make_sender(
    sending: str,
    transport: Transport | None,
    *,
    config: SyncConfig | None = None,
    trainer_group: Any = None,
    backend: Backend | None = None,
    token: str | None = None,
) -> Sender | TrainerSync | ShardedSender:
    """The sending side of `sending` (`SENDING`) on this trainer rank: a `Sender` of
    `transport` ("one"), this rank of a `TrainerSync` ("gather": `transport` on the rank
    that sends, None on the others), or this rank's `ShardedSender` ("all"). `trainer_group`
    (default: torch.distributed's default group) is the trainer's own, for "gather" and "all"."""
    _check_sending(sending)
    if sending == GATHER:
        return TrainerSync(transport=transport, config=config, trainer_group=trainer_group, backend=backend, token=token)
    if transport is None:
        raise ValueError(f"sending {sending!r}: this rank sends, so it needs its transport")
    if sending == ALL:
        return ShardedSender(transport, config=config, trainer_group=trainer_group, backend=backend, token=token)
    return Sender(transport, config, backend=backend, token=token)


def make_receiver(
    sending: str,
    transports: Sequence[Transport],
    specs: Iterable[TensorSpec] | None,
    *,
    timeout_s: float,
    token: str | None = None,
    validate: Callable[[list[TensorSpec]], None] | None = None,
    backend: Backend | None = None,
    version: int | None = None,
) -> SyncReceiver:
    """The receiving side for `sending` (`SENDING`): with one sender ("one", "gather") a
    `Receiver` of the one transport; with every trainer rank sending ("all") a
    `ShardedReceiver` of one transport per trainer rank, in trainer-rank order. `specs`
    (None: whatever the headers declare), `timeout_s`, `token`, `validate` and `version`
    (the version already held: an older one is refused) as for `Receiver`."""
    _check_sending(sending)
    transports = list(transports)
    if sending == ALL:
        return ShardedReceiver(transports, specs, timeout_s=timeout_s, token=token, validate=validate, backend=backend, version=version)
    if len(transports) != 1:
        raise ValueError(f"sending {sending!r} has one sender: one transport, got {len(transports)}")
    return Receiver(transports[0], specs, timeout_s=timeout_s, token=token, validate=validate, backend=backend, version=version)
