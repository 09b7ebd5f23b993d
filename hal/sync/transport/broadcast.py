"""`BroadcastTransport`: a sync's bytes over a process group, a broadcast to K receivers or
send/recv to one (over gloo). Statuses travel one segment ahead of the bytes (S0 S1 D0 S2
D1 ...), so a receiver knows where segment s+1 lands and posts its receive the moment
segment s arrived.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hal.backends.interface import Backend
from hal.backends.types import Event
from hal.sync.wire.channel import Complete, Land, SegmentStatus
from hal.sync.transport.base import Transport

if TYPE_CHECKING:  # annotations only: the plan (hal.sync.plan) sits above this layer
    from hal.sync.plan.buckets import BucketPlan


class BroadcastTransport(Transport):
    """Each segment goes from the sender into every receiver's own memory.

    On CUDA/NPU with an NCCL/HCCL group this is a device-to-device broadcast; here it is
    gloo over loopback. A receiver may land a segment straight in its own tensor. With a
    single receiver on a library whose traits favour it (gloo), the transfers are
    send/recv pairs instead of broadcasts: gloo pays about 1 ms per broadcast here,
    which a sync of ~100 transfers feels, and a send/recv pair does not
    (docs/benchmarks.md).

    Statuses travel one segment ahead of the data: the order on every rank is S0 S1 D0
    S2 D1 ... (status s+1 before the bytes of segment s). A receiver thus knows where
    segment s+1 lands, and posts its receive, the moment segment s has arrived, and the
    wire does not wait a round trip per segment (docs/benchmarks.md, session 3). The
    sender keeps the bytes of the last segment it was given until it has sent the next
    status (or the FAILED status, or finishes).
    """

    name = "broadcast"
    P2P_TAG = 0x4A1  # point-to-point transfers only; collectives use their own slots

    def __init__(self, group: Any = None, **kwargs: Any) -> None:
        super().__init__(group, **kwargs)
        self._pending: dict[int, list[tuple[Any, torch.Tensor]]] = {}  # sends per bucket, with the memory they read
        self._held: tuple[int, int, torch.Tensor] | None = None  # the sender's next data send, behind the next status
        self.point_to_point = False  # decided in prepare(), the same on every rank

    @property
    def peer(self) -> int:
        """The receiver of the sender's point-to-point transfers: the other rank of a group
        of two (a link inside a larger group names its own: hal.sync.transport.peer)."""
        return 1 - self.src

    def prepare(self, backend: Backend, plan: BucketPlan) -> None:
        super().prepare(backend, plan)
        self.point_to_point = self.world_size == 2 and self._traits.point_to_point_for_one_receiver
        self._held = None

    def _transfer(self, tensor: torch.Tensor, what: str) -> Any:
        if not self.point_to_point:
            return self._broadcast(tensor, what)
        if self.is_sender:
            return self._send_p2p(tensor, self.peer, self.P2P_TAG, what)
        return self._recv_p2p(tensor, self.src, self.P2P_TAG, what)

    def _order_after(self, ready: Event) -> None:
        if self._traits.follows_streams:
            self._backend.current_stream().wait_event(ready)  # the collective follows the stream
        else:
            ready.synchronize()  # the library reads memory from the host: the pack must be done

    # ---- sender ----------------------------------------------------------------------
    def _send(self, k: int, tensor: torch.Tensor, what: str) -> None:
        self._pending.setdefault(k, []).append((self._transfer(tensor, what), tensor))

    def _flush(self) -> None:
        if self._held is not None:
            k, j, data = self._held
            self._held = None
            self._send(k, data, f"bucket {k} segment {j}")

    def send_segment(
        self, k: int, j: int, start: int, data: torch.Tensor, *, ready: Event, direct: bool, encoding: int = 0
    ) -> None:
        self._order_after(ready)
        self._send(k, self._status(SegmentStatus.code_of(encoding, direct), k, j, data.numel()), f"bucket {k} segment {j} status")
        self._flush()  # the previous segment's bytes, now that this status is ahead of them
        self._held = (k, j, data)

    def send_failure(self, k: int, j: int) -> None:
        self._send(k, self._status(SegmentStatus.FAILED, k, j, 0), f"bucket {k} segment {j} failure")
        self._flush()  # the previous segment was announced OK: its bytes are owed
        for bucket in sorted(self._pending):
            self.wait_sent(bucket)

    def wait_sent(self, k: int) -> None:
        if self._held is not None and self._held[0] == k:
            self._flush()
        for work, _memory in self._pending.pop(k, ()):
            self.channel.wait(work, f"bucket {k}")

    # ---- receiver --------------------------------------------------------------------
    def receive_segments(self, land: Land, complete: Complete) -> bool:
        """Statuses one ahead of the bytes; the bytes of segment s+1 are posted before
        segment s is completed, so the wire is busy while the caller applies it."""
        pending: tuple[int, int, bool, Any, SegmentStatus] | None = None
        for k, j, start, nbytes in self._order:
            status = self._status_one_ahead(k, j, nbytes)
            if status.failed:
                if pending is not None:
                    self._complete(pending, complete)
                return True
            into = land(k, j, status)
            target = self.buffer(k)[start : start + status.nbytes] if into is None else into
            work = self._transfer(target, f"bucket {k} segment {j}")
            if pending is not None:
                self._complete(pending, complete)
            pending = (k, j, into is not None, work, status)
        if pending is not None:
            self._complete(pending, complete)
        return False

    def _complete(self, pending: tuple[int, int, bool, Any, SegmentStatus], complete: Complete) -> None:
        k, j, landed, work, status = pending
        self.channel.wait(work, f"bucket {k} segment {j}")
        complete(k, j, landed, status)

    def _post_status_receive(self, words: torch.Tensor, what: str) -> Any:
        return self._transfer(words, what)

    def finish(self) -> None:
        self._flush()
        for k in sorted(self._pending):
            self.wait_sent(k)
