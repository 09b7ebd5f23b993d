"""Across nodes, the network crossed once per node: `HierarchicalTransport`.

Ranks are grouped by node (`hal.env.node_key()`: VERL_HAL_NODE, else the host name). On
every node but the sender's, one rank, the leader, receives each segment over the
network; the other ranks of that node read it from the leader's buffer, which they map
through the backend's IPC (shared-memory files on the CPU, device IPC handles on
CUDA/NPU). On the sender's node the sender itself is the leader. So the bytes that cross
the network per sync are one model per remote node, however many workers each node has:

    sender ──net──► leader of node B ──shm──► other ranks of node B
           ──net──► leader of node C ──shm──► other ranks of node C
           ──shm──────────────────────────► other ranks of the sender's node

Everything is point-to-point on the one sync group, with a tag per kind of message:
statuses and bytes from the sender to each leader (statuses one segment ahead, as
`BroadcastTransport` sends them), "segment s is in my buffer" from a leader to its node,
and "done with bucket k" back, which is what lets a leader (or the sender) reuse a buffer.
A FAILED status travels the same way, so nobody lands anything the sender did not pack.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hal import env
from hal.backends.interface import Backend
from hal.backends.types import Event
from hal.sync.errors import HeaderError, PeerError
from hal.sync.wire.channel import Complete, Land, SegmentStatus
from hal.sync.transport.base import Transport

if TYPE_CHECKING:  # annotations only: the plan (hal.sync.plan) sits above this layer
    from hal.sync.plan.buckets import BucketPlan

TAG_NET = 0x4B1  # sender -> remote leaders: statuses and bytes
TAG_NODE = 0x4B2  # a leader -> the other ranks of its node: segment statuses
TAG_RELEASE = 0x4B3  # a node's rank -> its leader: bucket released (or buffers mapped)
TAG_HANDLES = 0x4B4  # a leader -> the other ranks of its node: its buffers' IPC handles
MAX_NODE_KEY_BYTES = 256
MAX_HANDLES_BYTES = 1 << 20
_MAPPED = -1  # what a node's rank answers once it mapped its leader's new buffers


@dataclass(frozen=True, slots=True)
class NodeMap:
    """Who is where: every rank's node, each node's leader, and the sender."""

    nodes: tuple[str, ...]
    """The node key of each rank of the sync group."""
    src: int

    def leader_of(self, rank: int) -> int:
        """The rank that receives for `rank`'s node: the sender on its own node, else the node's lowest rank."""
        node = self.nodes[rank]
        if node == self.nodes[self.src]:
            return self.src
        return min(r for r, n in enumerate(self.nodes) if n == node)

    @property
    def remote_leaders(self) -> list[int]:
        """Leaders of the nodes other than the sender's: the ranks the network carries the bytes to."""
        return sorted({self.leader_of(r) for r in range(len(self.nodes)) if self.nodes[r] != self.nodes[self.src]})

    def served_by(self, leader: int) -> list[int]:
        """The ranks that read `leader`'s buffers (its node, but itself and the sender)."""
        return [r for r in range(len(self.nodes)) if r not in (leader, self.src) and self.leader_of(r) == leader]


class HierarchicalTransport(Transport):
    """The network once per node, shared memory within a node (see the module doc).

    `node` overrides this rank's node key (default `hal.env.node_key()`); the keys are
    exchanged at construction, so every rank of the group must construct it together, and
    `timeout_s` bounds that exchange (each sync's waits are bounded by the sync, as on
    every transport). `network_bytes` counts, on the sender, the segment bytes it sent
    over the network.
    """

    name = "hierarchical"

    def __init__(self, group: Any = None, *, node: str | None = None, timeout_s: float = 60.0, **kwargs: Any) -> None:
        super().__init__(group, **kwargs)
        key = node if node is not None else env.node_key()
        if not isinstance(key, str) or not key or len(key.encode()) > MAX_NODE_KEY_BYTES:
            raise ValueError(f"node key must be a non-empty string of at most {MAX_NODE_KEY_BYTES} bytes, got {key!r}")
        with self.bounded(timeout_s):
            keys = self.channel.all_gather_bytes(key.encode(), "node keys", limit=MAX_NODE_KEY_BYTES)
        if not all(keys):
            raise PeerError(f"{self.name}: node keys: rank(s) {[r for r, k in enumerate(keys) if not k]} announced an empty one")
        self.nodes = NodeMap(tuple(k.decode() for k in keys), self.src)
        self.leader = self.nodes.leader_of(self.rank)
        self.serves = self.nodes.served_by(self.rank) if self.leader == self.rank else []
        self.remote_leaders = self.nodes.remote_leaders if self.is_sender else []
        self.network_bytes = 0
        self._sends: dict[int, list[tuple[Any, torch.Tensor]]] = {}  # by bucket: works and the memory they read
        self._held: tuple[int, int, torch.Tensor] | None = None  # the bytes behind the next status, to remote leaders
        self._forwarded: list[int] = []  # buckets this rank told its node about and whose release it awaits
        self._told: list[tuple[int, Any, torch.Tensor]] = []  # (bucket, work, status) sent to the node, not yet waited

    # ---- buffers: shared with the node when this rank serves it --------------------------
    def prepare(self, backend: Backend, plan: BucketPlan) -> None:
        super().prepare(backend, plan)
        self._held = None

    def _allocate(self, backend: Backend, nbytes: int) -> list[torch.Tensor]:
        if self.serves:
            if not backend.supports_ipc:
                raise PeerError(f"{self.name}: backend {backend.name!r} cannot share buffers within a node (supports_ipc is False)")
            old, slots = self._slots, [backend.empty_shared(nbytes) for _ in range(2)]
            payload = json.dumps([backend.export_ipc(s) for s in slots]).encode()
            size = torch.tensor([len(payload)], dtype=torch.int64, device=self.control_device)
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.control_device)
            works = [w for peer in self.serves for w in (self._send_p2p(size, peer, TAG_HANDLES, "buffer handles"), self._send_p2p(data, peer, TAG_HANDLES, "buffer handles"))]
            for w in works:
                self.channel.wait(w, "buffer handles")
            for peer in self.serves:  # every rank of the node mapped the new buffers before the old go
                self._expect_release(peer, _MAPPED, "buffer mapping")
            for s in old:
                backend.release_shared(s)
            return slots
        if self.leader != self.rank:
            size = torch.zeros(1, dtype=torch.int64, device=self.control_device)
            self.channel.wait(self._recv_p2p(size, self.leader, TAG_HANDLES, "buffer handles"), "buffer handles")
            n = int(size.item())
            if not 0 < n <= MAX_HANDLES_BYTES:
                raise HeaderError(f"{self.name}: rank {self.leader} announced buffer handles of {n} bytes")
            data = torch.empty(n, dtype=torch.uint8, device=self.control_device)
            self.channel.wait(self._recv_p2p(data, self.leader, TAG_HANDLES, "buffer handles"), "buffer handles")
            try:
                handles = json.loads(data.cpu().numpy().tobytes())
                if not isinstance(handles, list) or len(handles) != 2:
                    raise ValueError("expected a list of two handles")
                slots = [backend.import_ipc(h) for h in handles]
            except (ValueError, TypeError, RecursionError, OSError) as exc:
                raise PeerError(f"{self.name}: rank {self.rank} could not map rank {self.leader}'s buffers: {exc}") from None
            self._send_release(_MAPPED)
            return slots
        return super()._allocate(backend, nbytes)

    def _send_release(self, k: int) -> None:
        word = torch.tensor([k], dtype=torch.int64, device=self.control_device)
        self.channel.wait(self._send_p2p(word, self.leader, TAG_RELEASE, f"bucket {k} release"), f"bucket {k} release")

    def _expect_release(self, peer: int, k: int, what: str) -> None:
        word = torch.zeros(1, dtype=torch.int64, device=self.control_device)
        self.channel.wait(self._recv_p2p(word, peer, TAG_RELEASE, what), what)
        if int(word.item()) != k:
            raise PeerError(f"{self.name}: expected rank {peer} to release bucket {k}, it released {int(word.item())}: out of step")

    def _collect_releases(self, upto: int) -> None:
        """Wait until every rank this one serves is done with every forwarded bucket <= `upto`,
        bucket by bucket: a rank takes bucket k's statuses, then releases k, then takes k+1's."""
        while True:
            k = min([b for b in self._forwarded[:1]] + [t[0] for t in self._told[:1]], default=None)
            if k is None or k > upto:
                return
            while self._told and self._told[0][0] == k:
                _, work, _status = self._told.pop(0)
                self.channel.wait(work, f"bucket {k} status to the node")
            if self._forwarded and self._forwarded[0] == k:
                self._forwarded.pop(0)
                for peer in self.serves:
                    self._expect_release(peer, k, f"bucket {k} release")

    def _tell_node(self, code: int, k: int, j: int, nbytes: int) -> None:
        """Tell the ranks this one serves that segment j of bucket k is in its buffer (or FAILED)."""
        if not self.serves:
            return
        status = self._status(code, k, j, nbytes)
        for peer in self.serves:  # not waited here: a rank of the node may still be reading the last segment
            self._told.append((k, self._send_p2p(status, peer, TAG_NODE, f"bucket {k} segment {j} status"), status))
        if code != SegmentStatus.FAILED and (not self._forwarded or self._forwarded[-1] != k):
            self._forwarded.append(k)

    # ---- sender ----------------------------------------------------------------------------
    def _send_net(self, k: int, tensor: torch.Tensor, what: str) -> None:
        for leader in self.remote_leaders:
            self._sends.setdefault(k, []).append((self._send_p2p(tensor, leader, TAG_NET, what), tensor))

    def _flush(self) -> None:
        if self._held is not None:
            k, j, data = self._held
            self._held = None
            self._send_net(k, data, f"bucket {k} segment {j}")
            self.network_bytes += data.numel() * len(self.remote_leaders)

    def send_segment(
        self, k: int, j: int, start: int, data: torch.Tensor, *, ready: Event, direct: bool, encoding: int = 0
    ) -> None:
        if self._traits.follows_streams and not self.serves:
            self._backend.current_stream().wait_event(ready)
        else:
            ready.synchronize()  # host-side signals follow: the bytes must be there
        if self.serves and data.numel():  # (the Sender waited for bucket k-2's release before packing k)
            dst = self.buffer(k)[start : start + data.numel()]
            if data.data_ptr() != dst.data_ptr():  # bytes from a tensor's own memory: the node reads the buffer
                stream = self._backend.current_stream()
                self._backend.copy_(dst, data, stream=stream)
                stream.synchronize()
        self._tell_node(SegmentStatus.code_of(encoding, False), k, j, data.numel())
        status = self._status(SegmentStatus.code_of(encoding, direct), k, j, data.numel())
        self._send_net(k, status, f"bucket {k} segment {j} status")
        self._flush()
        self._held = (k, j, data)

    def send_failure(self, k: int, j: int) -> None:
        self._send_net(k, self._status(SegmentStatus.FAILED, k, j, 0), f"bucket {k} segment {j} failure")
        self._flush()
        self._tell_node(SegmentStatus.FAILED, k, j, 0)
        self.finish()

    def wait_sent(self, k: int) -> None:
        if self._held is not None and self._held[0] == k:
            self._flush()
        for work, _memory in self._sends.pop(k, ()):
            self.channel.wait(work, f"bucket {k}")
        self._collect_releases(k)

    # ---- receivers -------------------------------------------------------------------------
    def receive_segments(self, land: Land, complete: Complete) -> bool:
        if self.leader == self.rank:
            return self._receive_as_leader(land, complete)
        return self._receive_from_leader(complete)

    def _post_status_receive(self, words: torch.Tensor, what: str) -> Any:
        return self._recv_p2p(words, self.src, TAG_NET, what)

    def _receive_as_leader(self, land: Land, complete: Complete) -> bool:
        """A node's leader: from the sender over the network, statuses one ahead; each
        segment is announced to the node once it is in this rank's buffer."""
        pending: tuple[int, int, bool, Any, SegmentStatus] | None = None

        def finish(p: tuple[int, int, bool, Any, SegmentStatus]) -> None:
            k, j, landed, work, status = p
            self.channel.wait(work, f"bucket {k} segment {j}")
            # the node reads while this rank applies (a DIRECT tensor lands in this rank's buffer: plain OK there)
            code = status.code if status.code != SegmentStatus.DIRECT else SegmentStatus.OK
            self._tell_node(code, k, j, status.nbytes)
            complete(k, j, landed, status)

        first_of_bucket = {k: j for k, j, _, _ in reversed(self._order)}
        for k, j, start, nbytes in self._order:
            status = self._status_one_ahead(k, j, nbytes)
            if status.failed:
                if pending is not None:
                    finish(pending)
                self._tell_node(SegmentStatus.FAILED, k, j, 0)
                return True
            if self.serves and j == first_of_bucket[k] and k >= 2:
                self._collect_releases(k - 2)  # the node is done with what this buffer held
            into = None if self.serves else land(k, j, status)
            target = self.buffer(k)[start : start + status.nbytes] if into is None else into
            work = self._recv_p2p(target, self.src, TAG_NET, f"bucket {k} segment {j}")
            if pending is not None:
                finish(pending)
            pending = (k, j, into is not None, work, status)
        if pending is not None:
            finish(pending)
        return False

    def _receive_from_leader(self, complete: Complete) -> bool:
        """Another rank of a node: every segment from the leader's buffer, once it says so."""
        last_of_bucket = {k: j for k, j, _, _ in self._order}
        started: int | None = None  # the bucket read from and not yet released
        for k, j, _, nbytes in self._order:
            words = torch.zeros(4, dtype=torch.int64, device=self.control_device)
            self.channel.wait(self._recv_p2p(words, self.leader, TAG_NODE, f"bucket {k} segment {j} status"), f"bucket {k} segment {j} status")
            status = SegmentStatus.parse(words, k, j, nbytes, f"{self.name} on rank {self.rank}")
            if status.failed:
                if started is not None:
                    self._send_release(started)
                return True
            started = k
            complete(k, j, False, status)
            if j == last_of_bucket[k]:
                self._send_release(k)
                started = None
        return False

    def finish(self) -> None:
        self._flush()
        for k in sorted(self._sends):
            for work, _memory in self._sends.pop(k):
                self.channel.wait(work, f"bucket {k}")
        self._collect_releases(max([-1, *self._forwarded, *(k for k, _, _ in self._told)]))

    def close(self) -> None:
        if self.serves and self._backend is not None:
            for s in self._slots:
                self._backend.release_shared(s)
        super().close()
