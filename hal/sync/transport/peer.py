"""`PeerTransport`: one link of a sync group, point to point from its sender to one receiver.

A sync group is the sender and every engine worker it serves (`{r} ∪ workers`). When each
worker takes only its own pieces (hal.sync.send.links), the sender runs one link per worker
inside that group: a sync of the core per link, whose segments, each after its own status
(`SegmentStatus`, one ahead of the bytes as on `BroadcastTransport`), go to that worker
alone, and whose header too (`PeerChannel.send_headers`). The challenge and the agreements
stay the whole group's: every rank draws the challenge each header proves the token over,
and every rank learns every verdict, so a failure on one link fails every rank alike.

    links = peer_links(group)                        # the sender: one per receiver, rank order
    transport = PeerTransport(group, src=0)          # receiver w: its own link

Memory: each link keeps its own two bucket buffers, of its own bucket size (a sender of N
links sizes them 1/N of its buckets: hal.sync.send.links), so a sender's buffers add up
to what one link of today's size holds. A receiver holds its link's two.

Over gloo the sender's sends are asynchronous: the links' segments are in flight together
whatever order one thread posts them in. The statuses and bytes of one link travel on one
tag, in order, so a receiver posts its receives as a broadcast's would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Mapping

import torch

from hal.sync.errors import PeerError
from hal.sync.transport.broadcast import BroadcastTransport
from hal.sync.wire.channel import SyncChannel
from hal.sync.wire.header_json import MAX_HEADER_BYTES

if TYPE_CHECKING:  # annotations only: the plan sits above this layer
    from hal.backends.interface import Backend
    from hal.sync.plan.buckets import BucketPlan


class PeerChannel(SyncChannel):
    """The control plane of one sync group's links: the challenge and the agreements are
    the group's collectives, as on any sync channel; a header goes from the sender to each
    receiver alone, each its own (`send_headers`), so a receiver reads only its link's."""

    name: ClassVar[str] = "peer channel"
    HEADER_TAG: ClassVar[int] = 0x4A3  # a link's headers; its segments travel on PeerTransport.P2P_TAG

    @property
    def receivers(self) -> list[int]:
        """Every rank of the group but the sender, in rank order."""
        return [rank for rank in range(self.world_size) if rank != self.src]

    def exchange_header(self, payload: bytes | None) -> bytes:
        """The core's exchange (`SyncChannel.exchange_header`) over links: the sender sends
        every receiver the same header, each receiver receives its own."""
        if self.is_sender:
            data = bytes(payload or b"")
            self.send_headers({rank: data for rank in self.receivers})
            return data
        return self.receive_header()

    def send_headers(self, payloads: Mapping[int, bytes]) -> None:
        """Send each receiver its header (`payloads`: one per receiver rank, each at most
        MAX_HEADER_BYTES; an empty one is refused by its receiver, which says so at the
        agreement): all in flight at once, then waited for."""
        if not self.is_sender:
            raise RuntimeError(f"{self.name}: rank {self.rank} is a receiver; only rank {self.src} sends headers")
        if sorted(payloads) != self.receivers:
            raise ValueError(f"{self.name}: a header for each of the receivers {self.receivers}, got ranks {sorted(payloads)}")
        works: list[tuple[Any, torch.Tensor, str]] = []
        for rank in self.receivers:
            data = payloads[rank]
            if len(data) > MAX_HEADER_BYTES:
                raise ValueError(f"{self.name}: the header for rank {rank} has {len(data)} bytes, more than MAX_HEADER_BYTES ({MAX_HEADER_BYTES})")
            size = torch.tensor([len(data)], dtype=torch.int64, device=self.control_device)
            works.append((self._send(size, rank, "header size"), size, f"header size to rank {rank}"))
            if data:
                body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.control_device)
                works.append((self._send(body, rank, "header"), body, f"header to rank {rank}"))
        for work, _memory, what in works:  # the memory each send reads lives until it is waited for
            self.wait(work, what)

    def receive_header(self) -> bytes:
        """This receiver's header from the sender. A length beyond MAX_HEADER_BYTES leaves the
        link out of step (its bytes are never read): `PeerError`, as a broken link."""
        size = torch.zeros(1, dtype=torch.int64, device=self.control_device)
        self.wait(self._recv(size, "header size"), "header size")
        n = int(size.item())
        if not 0 <= n <= MAX_HEADER_BYTES:
            raise PeerError(f"{self.name}: rank {self.src} announced a header of {n} bytes to rank {self.rank}; the limit is {MAX_HEADER_BYTES}")
        data = torch.empty(n, dtype=torch.uint8, device=self.control_device)
        if n:
            self.wait(self._recv(data, "header"), "header")
        return data.cpu().numpy().tobytes()

    def _send(self, tensor: torch.Tensor, rank: int, what: str) -> Any:
        try:
            return self.keep(self.group.send([tensor], rank, self.HEADER_TAG), tensor)
        except RuntimeError as exc:
            raise PeerError(f"{self.name}: {what} to rank {rank} failed on rank {self.rank}: {exc}") from exc

    def _recv(self, tensor: torch.Tensor, what: str) -> Any:
        try:
            return self.keep(self.group.recv([tensor], self.src, self.HEADER_TAG), tensor)
        except RuntimeError as exc:
            raise PeerError(f"{self.name}: {what} from rank {self.src} failed on rank {self.rank}: {exc}") from exc


class PeerTransport(BroadcastTransport):
    """One link of a sync group: the bytes of one core sync from the sender (`src`) to one
    receiver (`peer`) alone, point to point (see the module doc).

    On a receiver, `peer` is its own rank (the default). On the sender, `peer` names the
    link's receiver and `channel` may be shared by all its links (`peer_links`): one
    challenge and one agreement per sync for the group, whatever the links."""

    name = "peer"
    P2P_TAG = 0x4A2  # a link's statuses and bytes: never matched by a broadcast transport's pairs

    def __init__(
        self,
        group: Any = None,
        *,
        src: int = 0,
        peer: int | None = None,
        channel: PeerChannel | None = None,
        control_device: str | torch.device = "cpu",
        dist_backend: str | None = None,
    ) -> None:
        super().__init__(group, src=src, control_device=control_device, dist_backend=dist_backend)
        if channel is None:
            channel = PeerChannel(self.channel.group, src=src, control_device=control_device)
            channel.name = f"{self.name} channel"
        elif not isinstance(channel, PeerChannel) or channel.src != src or channel.group is not self.channel.group:
            raise ValueError(f"{self.name}: channel must be a PeerChannel of the same group with src={src}")
        self.channel = channel
        rank = channel.rank
        if peer is None:
            if rank == src:
                raise ValueError(f"{self.name}: the sender's link needs peer= (its receiver's rank in the group)")
            peer = rank
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < channel.world_size or peer == src:
            raise ValueError(f"{self.name}: peer={peer!r} is not a receiver of a group of {channel.world_size} with sender {src}")
        if rank != src and peer != rank:
            raise ValueError(f"{self.name}: rank {rank} receives its own link only, not rank {peer}'s")
        self._receiver = peer

    @property
    def peer(self) -> int:
        """This link's receiver."""
        return self._receiver

    def prepare(self, backend: Backend, plan: BucketPlan) -> None:
        super().prepare(backend, plan)
        self.point_to_point = True  # a link is one receiver's, whatever the group's size or library


def peer_links(
    group: Any = None, *, src: int = 0, control_device: str | torch.device = "cpu", dist_backend: str | None = None
) -> list[PeerTransport]:
    """The sender's links of a sync group: one `PeerTransport` per receiver, in rank order,
    sharing one `PeerChannel` (the group's challenge and agreements, each receiver's header)."""
    channel = PeerChannel(group, src=src, control_device=control_device)
    channel.name = f"{PeerTransport.name} channel"
    if not channel.is_sender:
        raise ValueError(f"peer_links: rank {channel.rank} is not the group's sender (rank {src}); a receiver makes PeerTransport(group, src={src})")
    return [
        PeerTransport(channel.group, src=src, peer=rank, channel=channel, control_device=control_device, dist_backend=dist_backend)
        for rank in channel.receivers
    ]
