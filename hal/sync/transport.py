"""How buckets travel: a broadcast over a process group, or same-node shared memory.

Both transports speak to a `torch.distributed` ProcessGroup object directly (its
`broadcast` / `allgather` / `allreduce` methods), so they work with the default group
and equally with a group created outside c10d's registry, such as vLLM's
`stateless_init_torch_distributed_process_group` joining a trainer and engine workers.
The group is created once by the caller and reused by every sync.

The sender and receivers drive a transport in a fixed order (see `Sender` and
`Receiver`), which each transport maps onto collectives that match across ranks.
"""

from __future__ import annotations

import collections
import datetime
import pickle
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # not re-exported by torch.distributed

from hal.backend import Backend
from hal.sync.errors import PeerError


def _default_group() -> Any:
    if not dist.is_initialized():
        raise PeerError("no process group: pass group= or call torch.distributed.init_process_group first")
    return dist.distributed_c10d._get_default_group()


class Transport:
    """Control messages plus two bucket slots, over one process group."""

    # The receiver may post the receive of bucket k+1 before it finished applying bucket k.
    prefetch: ClassVar[bool] = True
    # Data moves by host-side signalling, so the sender's packs must be complete on the
    # host before `send` even when collectives follow device streams.
    host_ordered: ClassVar[bool] = False
    # Bytes travel, so a bucket is sent in segments (SyncConfig.segment_bytes) to start
    # the wire early; a transport that moves no bytes takes each bucket whole.
    segmented: ClassVar[bool] = False
    name: ClassVar[str] = "transport"

    def __init__(self, group: Any = None, *, src: int = 0, control_device: str | torch.device = "cpu") -> None:
        self.group = group if group is not None else _default_group()
        self.rank = self.group.rank()
        self.world_size = self.group.size()
        if not 0 <= src < self.world_size:
            raise ValueError(f"src={src} is not a rank of a group of size {self.world_size}")
        if self.world_size < 2:
            raise ValueError(f"a sync group needs the sender and at least one receiver; this group has {self.world_size} rank")
        self.src = src
        self.control_device = torch.device(control_device)
        self.timeout_s = 60.0
        self._slots: list[torch.Tensor] = []
        self._capacity = 0
        self._pending: dict[int, Any] = {}

    @property
    def is_sender(self) -> bool:
        return self.rank == self.src

    # ---- collectives with timeouts and clear errors ---------------------------------
    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def _wait(self, work: Any, what: str) -> None:
        try:
            ok = work.wait(self._timeout())
        except RuntimeError as exc:
            raise PeerError(f"{self.name}: {what} failed on rank {self.rank} (a peer died or did not answer within {self.timeout_s} s): {exc}") from exc
        if ok is False:
            raise PeerError(f"{self.name}: {what} timed out on rank {self.rank} after {self.timeout_s} s")

    def _broadcast(self, tensor: torch.Tensor, what: str) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank = self.src
        opts.timeout = self._timeout()
        try:
            return self.group.broadcast([tensor], opts)
        except RuntimeError as exc:
            raise PeerError(f"{self.name}: {what} failed on rank {self.rank}: {exc}") from exc

    def _allreduce(self, tensor: torch.Tensor, what: str) -> None:
        opts = dist.AllreduceOptions()
        opts.timeout = self._timeout()
        try:
            work = self.group.allreduce([tensor], opts)
        except RuntimeError as exc:
            raise PeerError(f"{self.name}: {what} failed on rank {self.rank}: {exc}") from exc
        self._wait(work, what)

    def broadcast_object(self, obj: Any, what: str = "header") -> Any:
        """The sender's `obj`, on every rank (pickled; small control messages only)."""
        if self.is_sender:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        size = size.to(self.control_device)
        self._wait(self._broadcast(size, f"{what} size"), f"{what} size")
        n = int(size.item())
        data = payload.to(self.control_device) if self.is_sender else torch.empty(n, dtype=torch.uint8, device=self.control_device)
        self._wait(self._broadcast(data, what), what)
        return obj if self.is_sender else pickle.loads(data.cpu().numpy().tobytes())

    def agree(self, error: str | None, what: str = "status") -> list[str | None]:
        """Every rank's error (None for success), on every rank, so all stop together."""
        encoded = (error or "").encode()[:4000]
        length = torch.tensor([len(encoded)], dtype=torch.int64, device=self.control_device)
        lengths = [torch.zeros(1, dtype=torch.int64, device=self.control_device) for _ in range(self.world_size)]
        self._allgather(lengths, length, f"{what} lengths")
        width = max(int(t.item()) for t in lengths)
        if width == 0:  # the common case: nobody failed, no second round trip
            return [None] * self.world_size
        mine = torch.zeros(width, dtype=torch.uint8)
        if encoded:
            mine[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        mine = mine.to(self.control_device)
        outs = [torch.zeros(width, dtype=torch.uint8, device=self.control_device) for _ in range(self.world_size)]
        self._allgather(outs, mine, what)
        result: list[str | None] = []
        for n, t in zip(lengths, outs):
            k = int(n.item())
            result.append(t[:k].cpu().numpy().tobytes().decode(errors="replace") if k else None)
        return result

    def _allgather(self, outputs: list[torch.Tensor], tensor: torch.Tensor, what: str) -> None:
        opts = AllgatherOptions()
        opts.timeout = self._timeout()
        try:
            work = self.group.allgather([outputs], [tensor], opts)
        except RuntimeError as exc:
            raise PeerError(f"{self.name}: {what} failed on rank {self.rank}: {exc}") from exc
        self._wait(work, what)

    # ---- slots ----------------------------------------------------------------------
    def setup(self, backend: Backend, nbytes: int) -> None:
        """Make sure both slots hold at least `nbytes` (every rank calls this with the same value)."""
        if nbytes > self._capacity:
            self._allocate(backend, nbytes)
            self._capacity = nbytes

    def slot(self, index: int) -> torch.Tensor:
        return self._slots[index]

    @property
    def capacity(self) -> int:
        return self._capacity

    def _allocate(self, backend: Backend, nbytes: int) -> None:
        self._slots = [backend.empty(nbytes) for _ in range(2)]

    # ---- data plane: overridden per transport ---------------------------------------
    # Bucket k travels in one or more transfers (its `Bucket.segments`), sent and
    # received in order; `data` is a flat uint8 tensor: a range of a slot, or, on the
    # sender, a tensor's own bytes sent without packing.
    def send(self, k: int, data: torch.Tensor) -> None:
        """Start sending `data` as the next transfer of bucket k."""
        raise NotImplementedError

    def wait_sent(self, k: int) -> None:
        """Block until every transfer of bucket k is done with its memory."""
        raise NotImplementedError

    def recv(self, k: int, data: torch.Tensor) -> None:
        """Post the receive of the next transfer of bucket k into `data`."""
        raise NotImplementedError

    def wait_received(self, k: int) -> None:
        """Block until the oldest posted transfer (one of bucket k) has arrived."""
        raise NotImplementedError

    def release(self, k: int) -> None:
        """The receiver is done with bucket k's slot."""

    def finish(self, nbuckets: int) -> None:
        """End of a sync's data phase on this rank: drain what is outstanding."""

    def close(self) -> None:
        self._slots = []
        self._capacity = 0


class BroadcastTransport(Transport):
    """Each bucket is broadcast from the sender into every receiver's own slot.

    On CUDA/NPU with an NCCL/HCCL group this is a device-to-device broadcast; here it
    is gloo over loopback. The receives of the next buckets are posted before the
    current one is applied, so transfer and apply overlap. With a single receiver on a
    backend that declares `point_to_point_transfers` (gloo) the transfers are send/recv
    pairs instead: gloo pays about 1 ms per broadcast here, which a sync of ~100
    transfers feels, and a send/recv pair does not (docs/benchmarks.md).
    """

    name = "broadcast"
    prefetch = True
    segmented = True
    P2P_TAG = 0x4A1  # point-to-point transfers only; collectives use their own slots

    def __init__(self, group: Any = None, *, src: int = 0, control_device: str | torch.device = "cpu") -> None:
        super().__init__(group, src=src, control_device=control_device)
        self._posted: collections.deque[tuple[int, Any]] = collections.deque()  # receives, oldest first
        self.point_to_point = False  # decided by the backend in setup(), the same on every rank
        self._peer = 1 - src  # the other rank, when there are two

    def setup(self, backend: Backend, nbytes: int) -> None:
        self.point_to_point = self.world_size == 2 and backend.point_to_point_transfers
        super().setup(backend, nbytes)

    def _transfer(self, data: torch.Tensor, what: str) -> Any:
        if not self.point_to_point:
            return self._broadcast(data, what)
        try:
            if self.is_sender:
                return self.group.send([data], self._peer, self.P2P_TAG)
            return self.group.recv([data], self.src, self.P2P_TAG)
        except RuntimeError as exc:
            raise PeerError(f"{self.name}: {what} failed on rank {self.rank}: {exc}") from exc

    def send(self, k: int, data: torch.Tensor) -> None:
        self._pending.setdefault(k, []).append(self._transfer(data, f"bucket {k}"))

    def wait_sent(self, k: int) -> None:
        for work in self._pending.pop(k, ()):
            self._wait(work, f"bucket {k}")

    def recv(self, k: int, data: torch.Tensor) -> None:
        self._posted.append((k, self._transfer(data, f"bucket {k}")))

    def wait_received(self, k: int) -> None:
        posted, work = self._posted.popleft()
        if posted != k:
            raise PeerError(f"{self.name}: waited for bucket {k}, but the oldest receive posted is for bucket {posted}")
        self._wait(work, f"bucket {k}")

    def finish(self, nbuckets: int) -> None:
        for k in sorted(self._pending):
            self.wait_sent(k)


class IpcTransport(Transport):
    """Same-node transfer without a copy on the wire: both slots live in memory every
    rank maps (shared-memory files on the CPU, device IPC handles on CUDA/NPU).

    The sender packs into a shared slot and announces it; receivers read the bucket in
    place and confirm when done, and only then is the slot packed again. Control
    messages are tiny host collectives on the same group.
    """

    name = "ipc"
    prefetch = False
    host_ordered = True

    def __init__(self, group: Any = None, *, src: int = 0, control_device: str | torch.device = "cpu") -> None:
        super().__init__(group, src=src, control_device=control_device)
        self._backend: Backend | None = None
        self._released: int | None = None  # the bucket whose release is still to be announced

    def _allocate(self, backend: Backend, nbytes: int) -> None:
        if not backend.supports_ipc:
            raise PeerError(f"ipc transport: backend {backend.name!r} has no IPC (supports_ipc is False); use BroadcastTransport")
        old = self._slots if self.is_sender else []
        if self.is_sender:
            self._slots = [backend.empty_shared(nbytes) for _ in range(2)]
            handles = [backend.export_ipc(s) for s in self._slots]
        else:
            handles = None
        handles = self.broadcast_object(handles, "ipc handles")
        if not self.is_sender:
            self._slots = [backend.import_ipc(h) for h in handles]
        # every rank has mapped the new slots before the old files go away
        self._allreduce(torch.zeros(1, device=self.control_device), "ipc handle exchange")
        for s in old:
            backend.release_shared(s)
        self._backend = backend

    def _signal(self, value: int, what: str) -> int:
        t = torch.tensor([value if self.is_sender else 0], dtype=torch.int64, device=self.control_device)
        self._wait(self._broadcast(t, what), what)
        return int(t.item())

    def send(self, k: int, data: torch.Tensor) -> None:
        self._signal(k, f"bucket {k} ready")  # `data` is in the shared slot
        self._pending[k] = True

    def wait_sent(self, k: int) -> None:
        if self._pending.pop(k, None):
            self._allreduce(torch.zeros(1, device=self.control_device), f"bucket {k} released")

    def recv(self, k: int, data: torch.Tensor) -> None:
        got = self._signal(0, f"bucket {k} ready")
        if got != k:
            raise PeerError(f"ipc transport: expected bucket {k}, sender announced {got}")
        self._announce_release()

    def wait_received(self, k: int) -> None:
        pass  # `recv` returned once the sender announced the bucket: it is in shared memory

    def release(self, k: int) -> None:
        self._released = k

    def _announce_release(self) -> None:
        if self._released is not None:
            k, self._released = self._released, None
            self._allreduce(torch.zeros(1, device=self.control_device), f"bucket {k} released")

    def finish(self, nbuckets: int) -> None:
        if self.is_sender:
            for k in sorted(self._pending):
                self.wait_sent(k)
        else:
            self._announce_release()

    def close(self) -> None:
        if self.is_sender and self._backend is not None:
            for s in self._slots:
                self._backend.release_shared(s)
        super().close()
