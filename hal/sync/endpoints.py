"""Who sends and who receives: the one place a sync's sender and receiver are chosen.

A sync has one of three sending sides, by which trainer ranks send (`SENDING`):

- `"one"`: this process alone holds the model and sends it (`Sender`);
- `"gather"`: a sharded trainer's ranks gather in lockstep and one of them sends
  (`TrainerSync`: the sending rank passes its transport, the others None);
- `"all"`: every trainer rank sends its own rows over a group of its own (`ShardedSender`).

Each is a `SyncSender` (`sync(source, version=)`, `version`, `close`): what an integration
holds and calls, whichever it is. The receiving side follows from it: one sender, one
`Receiver`; every trainer rank, a `ShardedReceiver` of one transport per trainer rank.
Either is a `SyncReceiver`, the contract the engines (hal.integrations.vllm, verl's
checkpoint engine) use and nothing more. `WeightSync`, the vLLM engine and verl's
checkpoint engine all choose here (`make_sender`, `make_receiver`), and name transports from
one registry (`TRANSPORTS`). `TrainerSide` opens a trainer rank's side of a sync group the
one way every integration does: serve the rendezvous, join in a thread while the receivers
are asked to join, open the transport, make the sender.
"""

from __future__ import annotations

import concurrent.futures
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import torch

from hal.backends.interface import Backend
from hal.sync.config import ALL, GATHER, ONE, SENDING, SyncConfig  # the words of who sends, also named from here
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
from hal.sync.wire.group import RendezvousServer, SyncGroupSpec, join_sync_group
from hal.threads import in_daemon_thread, result_within

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


@runtime_checkable
class SyncSender(Protocol):
    """What a trainer rank holds to send syncs, whichever ranks send (`Sender`, `TrainerSync`,
    `ShardedSender`): the mirror of `SyncReceiver`."""

    @property
    def version(self) -> int | None:
        """The weight version of the last sync this rank completed; None before the first."""

    def sync(self, source: Any, *, version: int) -> SyncMetrics:
        """Send `source` (a module, a hal source, a dict or list of pairs) as `version`: this
        rank's part of it, the same call on every trainer rank of a sharded trainer. Returns
        this rank's metrics (`SyncMetrics.sending` says which ranks sent); raises the
        `SyncError` every rank raises when the sync failed anywhere."""

    def close(self) -> None:
        """Free this rank's transport's buffers (the groups are their owners')."""


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
) -> SyncSender:
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


class TrainerSide:
    """A trainer rank's side of one sync group (its rank 0, the sender), opened in the steps
    every integration takes (hal.integrations.vllm's drivers):

        side = TrainerSide(spec, backend=backend, timeout_s=t)   # serves the rendezvous now
        side.join()                  # joins as rank 0 in a thread of its own: a future of the group
        ...                          # meanwhile the receivers are asked to join spec.address:spec.port
        sender = side.open(sending, "broadcast", config=..., trainer_group=..., token=...)

    The rendezvous listens on `spec.address` only, from construction on (a port taken since
    the spec was made fails there: `PeerError`). `open` needs the join to have completed;
    `close` before then stops serving: a join still waiting fails at once and the port is
    free, instead of both lasting until the timeout (an engine refused the trainer's init).
    """

    def __init__(self, spec: SyncGroupSpec, *, backend: Backend, timeout_s: float) -> None:
        self.spec = spec
        self.backend = backend
        self.timeout_s = timeout_s
        self.server = RendezvousServer(spec, timeout_s=timeout_s)
        self.joining: concurrent.futures.Future[Any] | None = None
        """The join's future (after `join`)."""

    def join(self, name: str = "hal-trainer: join the weight-sync group") -> "concurrent.futures.Future[Any]":
        """Join the group as its rank 0 in a daemon thread called `name` (once); the future of the group."""
        if self.joining is None:
            spec, server, library, timeout_s = self.spec, self.server, self.backend.dist_backend, self.timeout_s
            self.joining = in_daemon_thread(name, lambda: join_sync_group(spec, 0, backend=library, timeout_s=timeout_s, server=server))
        return self.joining

    def group_within(self, what: str, timeout_s: float) -> Any:
        """The group once joined, within `timeout_s`; `PeerError` naming `what` otherwise."""
        return result_within(self.join(), what, timeout_s)

    @property
    def group(self) -> Any:
        """The group if the join completed, else None (still joining, failed or never started)."""
        joining = self.joining
        return joining.result() if joining is not None and joining.done() and joining.exception() is None else None

    def open(
        self, sending: str, transport: str, *, config: SyncConfig | None = None, trainer_group: Any = None, token: str | None = None
    ) -> SyncSender:
        """This rank's transport `transport` (a `TRANSPORTS` name) over the joined group, and
        the sending side of `sending` over it (`make_sender`)."""
        group = self.group
        if group is None:
            raise RuntimeError(f"TrainerSide.open: the sync group {self.spec.init_method} is not joined")
        link = open_transport(transport, group, control_device=self.backend.control_device())
        return make_sender(sending, link, config=config, trainer_group=trainer_group, backend=self.backend, token=token)

    def close(self) -> None:
        """Stop serving the rendezvous: a join still waiting fails at once and the port is free.
        A group already joined is its owner's to release (`group`, `destroy_sync_group`)."""
        self.server.close()
