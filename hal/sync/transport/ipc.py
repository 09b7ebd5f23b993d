"""Same-node transfer through memory every rank maps: the `ipc` transport.

Both bucket buffers are shared memory (anonymous memory files on the CPU, device IPC
handles on CUDA/NPU), so no byte moves: the sender packs into a shared buffer and announces
it, the receivers read it in place, and it is packed again only once every receiver said
it is done with it. Control messages are tiny host collectives on the same group (the
transport's channel).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from hal.backends.interface import Backend
from hal.backends.types import Event
from hal.sync.errors import PeerError
from hal.sync.wire.channel import Complete, Land, SegmentStatus
from hal.sync.transport.base import Transport

# Largest set of IPC handles the sender announces (two small JSON objects).
MAX_HANDLES_BYTES = 1 << 20


class IpcTransport(Transport):
    """Same-node transfer without a copy on the wire: both bucket buffers live in memory
    every rank maps (shared-memory files on the CPU, device IPC handles on CUDA/NPU).

    The sender packs into a shared buffer and announces it with the segment's status;
    receivers read the bucket in place and confirm when done, and only then is that
    buffer packed again. Buckets travel whole (no bytes move, so nothing to pipeline).
    Control messages are tiny host collectives on the same group; the handles travel as
    JSON and each backend validates what it is handed before mapping anything.
    """

    name = "ipc"

    def __init__(self, group: Any = None, **kwargs: Any) -> None:
        super().__init__(group, **kwargs)
        self._announced: list[int] = []  # buckets announced and not yet released, oldest first

    def segment_bytes(self, requested: int | None) -> int | None:
        return None

    def _allocate(self, backend: Backend, nbytes: int) -> list[torch.Tensor]:
        if not backend.supports_ipc:
            raise PeerError(f"ipc transport: backend {backend.name!r} has no IPC (supports_ipc is False); use BroadcastTransport")
        old = self._slots if self.is_sender else []
        slots: list[torch.Tensor] = []
        payload = None
        if self.is_sender:
            slots = [backend.empty_shared(nbytes) for _ in range(2)]
            payload = json.dumps([backend.export_ipc(s) for s in slots]).encode()
        raw = self.channel.broadcast_bytes(payload, MAX_HANDLES_BYTES, "ipc handles")
        if not self.is_sender:
            try:
                handles = json.loads(raw)
                if not isinstance(handles, list) or len(handles) != 2:
                    raise ValueError("expected a list of two handles")
                slots = [backend.import_ipc(h) for h in handles]
            except (ValueError, TypeError, RecursionError, OSError) as exc:
                raise PeerError(f"ipc transport: rank {self.rank} could not map the sender's buffers: {exc}") from None
        # every rank has mapped the new buffers before the old files go away
        self.channel.allreduce(torch.zeros(1, device=self.control_device), "ipc handle exchange")
        for s in old:
            backend.release_shared(s)
        return slots

    def _signal(self, status: torch.Tensor, what: str) -> None:
        self.channel.wait(self.channel.broadcast(status, what), what)

    def send_segment(
        self, k: int, j: int, start: int, data: torch.Tensor, *, ready: Event, direct: bool, encoding: int = 0
    ) -> None:
        ready.synchronize()  # receivers read the buffer as soon as they hear of it
        dst = self.buffer(k)[start : start + data.numel()]
        if data.numel() and data.data_ptr() != dst.data_ptr():
            # bytes from elsewhere (a tensor's own memory): they must be in the shared buffer
            stream = self._backend.current_stream()
            self._backend.copy_(dst, data, stream=stream)
            stream.synchronize()
        self._signal(self._status(SegmentStatus.code_of(encoding, False), k, j, data.numel()), f"bucket {k} ready")
        self._announced.append(k)

    def send_failure(self, k: int, j: int) -> None:
        self._signal(self._status(SegmentStatus.FAILED, k, j, 0), f"bucket {k} failure")

    def wait_sent(self, k: int) -> None:
        if k in self._announced:
            self._announced.remove(k)
            self._release(k)

    def receive_segments(self, land: Land, complete: Complete) -> bool:
        """Bucket k is applied while the sender packs bucket k+1: the receivers' release of
        bucket k-1 is announced right after the ready signal of bucket k, which is the
        order the sender waits in (ready k, then released k-1 before packing k+1)."""
        released: int | None = None  # applied, its release not yet announced
        for k, j, _, nbytes in self._order:
            words = torch.zeros(4, dtype=torch.int64, device=self.control_device)
            self._signal(words, f"bucket {k} ready")
            status = SegmentStatus.parse(words, k, j, nbytes, f"{self.name} on rank {self.rank}")
            if released is not None:
                self._release(released)
                released = None
            if status.failed:
                return True
            complete(k, j, False, status)  # the bytes are in the shared buffer already: nothing lands elsewhere
            released = k
        if released is not None:
            self._release(released)
        return False

    def _release(self, k: int) -> None:
        self.channel.allreduce(torch.zeros(1, device=self.control_device), f"bucket {k} released")

    def finish(self) -> None:
        if self.is_sender:
            for k in list(self._announced):
                self.wait_sent(k)

    def close(self) -> None:
        if self.is_sender and self._backend is not None:
            for s in self._slots:
                self._backend.release_shared(s)
        super().close()
