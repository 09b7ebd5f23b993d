"""How a sync's bytes travel: the `Transport` contract and `BroadcastTransport` (over a
process group); `IpcTransport` (same-node shared memory, hal.sync.transport.ipc) and
`HierarchicalTransport` (the network once per node, hal.sync.transport.hierarchical) are the others.

A transport owns its data path. The sender hands it segments (`send_segment`), each
either a range of the bucket buffer the transport gave it to pack into (`buffer(k)`) or
a tensor's own bytes. A receiver hands it two callbacks (`receive_segments(land,
complete)`): where it would like a segment's bytes once their status is known, and what
to do once they are here; the transport runs the loop in the order its wire needs and
says whether the bytes landed where asked or in its own buffer. What differs between
transports (bytes on the wire or in shared memory, whether a receive can be posted into
a caller's tensor, how sends are ordered after the packs, how far statuses run ahead)
lives in their methods, not in flags the sender and receiver branch on.

**Every segment is preceded by a status** (`hal.sync.wire.channel.SegmentStatus`, four int64
words): OK, OK and "the rest of this tensor comes straight from its memory" (DIRECT), a
delta encoding, or FAILED. A sender whose source or pack fails sends FAILED in place of
the segment and nothing after it, so no byte it did not pack ever leaves it, and a
receiver knows before it lands or applies a segment that the sender packed it. The
header's exchange and the agreements are the protocol's: a transport has a `SyncChannel`
over the same group (`Transport.channel`) and is not one.

The transports speak to a `torch.distributed` ProcessGroup object directly (its
`broadcast` / `send` / `recv` / `allreduce` methods), so they work with the default group
and equally with a group created outside c10d's registry, such as vLLM's
`stateless_init_torch_distributed_process_group` joining a trainer and engine workers.
The group is created once by the caller and reused by every sync.

How a collective is ordered after device work (NCCL/HCCL follow the issuing stream;
gloo runs on the host, which must wait) and whether one receiver is better served by
send/recv pairs are traits of the collective library, looked up by its name
(`hal.backends.collectives.collective_traits`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar, Iterator

import torch
import torch.distributed as dist

from hal.backends.interface import Backend
from hal.backends.types import Event
from hal.sync.errors import PeerError
from hal.sync.wire.channel import Complete, Land, SegmentStatus, SyncChannel

if TYPE_CHECKING:  # annotations only: the plan (hal.sync.plan) sits above this layer
    from hal.sync.plan.buckets import BucketPlan


class Transport:
    """Bucket buffers and the bytes' path over one process group, with a control channel
    over the same group (`channel`; see the module doc)."""

    name: ClassVar[str] = "transport"

    def __init__(
        self,
        group: Any = None,
        *,
        src: int = 0,
        control_device: str | torch.device = "cpu",
        dist_backend: str | None = None,
    ) -> None:
        self.channel = SyncChannel(group, src=src, control_device=control_device)
        """The header's exchange, the agreements and the challenge (hal.sync.wire.channel)."""
        self.channel.name = self.name  # a wait of either kind names this transport
        self._backend: Backend | None = None
        self._host_only = False  # the group's library takes no tensor of the device: all goes through host memory
        self.dist_backend = dist_backend
        """The group's collective library ("gloo", ...); None: the device backend's `dist_backend`."""
        self._traits: Any = None
        self._library: tuple[str, str | None] | None = None  # (device type, the library the group runs it on)
        self._slots: list[torch.Tensor] = []
        self._capacity = 0
        self._order: list[tuple[int, int, int, int]] = []  # (bucket, segment, start, nbytes) of this sync, in order
        self._status_ahead: tuple[Any, torch.Tensor] | None = None  # the next status's receive: (work, words)
        self._cursor = 0  # the next status to receive, as an index into _order

    # ---- the group, as its channel knows it --------------------------------------------
    @property
    def group(self) -> Any:
        return self.channel.group

    @property
    def rank(self) -> int:
        return self.channel.rank

    @property
    def world_size(self) -> int:
        return self.channel.world_size

    @property
    def src(self) -> int:
        return self.channel.src

    @property
    def is_sender(self) -> bool:
        return self.channel.is_sender

    @property
    def control_device(self) -> torch.device:
        return self.channel.control_device

    @contextlib.contextmanager
    def bounded(self, timeout_s: float) -> Iterator[None]:
        """Bound every wait inside, of the bytes and of the control messages alike (`GroupChannel.bounded`)."""
        with self.channel.bounded(timeout_s):
            yield

    # ---- the bytes' collectives, with deadlines ---------------------------------------------
    def _broadcast(self, tensor: torch.Tensor, what: str) -> Any:
        """Post the broadcast of `tensor` from the sender. A device the group's library has
        no backend for (an NPU tensor in a gloo group) goes through host memory: the
        sender's copy, the receivers' landing copied after."""
        staged = self._host_only and tensor.device.type != "cpu"
        target = None if self.is_sender or not staged else tensor
        if staged:
            tensor = tensor.to("cpu") if self.is_sender else torch.empty(tensor.shape, dtype=tensor.dtype)
        work = self.channel.broadcast(tensor, what)
        return StagedWork(work, tensor, target, self._backend) if staged else work

    def _stages(self, tensor: torch.Tensor) -> bool:
        """Whether this group's send/recv must see host memory in place of `tensor`."""
        from hal.backends.collectives import CONSERVATIVE_TRAITS

        return tensor.device.type != "cpu" and (self._host_only or not (self._traits or CONSERVATIVE_TRAITS).point_to_point_device_memory)

    def _send_p2p(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Any:
        staged = self._stages(tensor)
        if staged:  # a copy on the current stream, which follows the work that wrote the tensor
            tensor = tensor.to("cpu")
        try:
            work = self.channel.keep(self.group.send([tensor], peer, tag), tensor)
        except RuntimeError as exc:
            raise PeerError(f"{self.name}: {what} to rank {peer} failed on rank {self.rank}: {exc}") from exc
        return StagedWork(work, tensor, None, None) if staged else work

    def _recv_p2p(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Any:
        target = tensor if self._stages(tensor) else None
        if target is not None:
            tensor = torch.empty(target.shape, dtype=target.dtype)
        try:
            work = self.channel.keep(self.group.recv([tensor], peer, tag), tensor)
        except RuntimeError as exc:
            raise PeerError(f"{self.name}: {what} from rank {peer} failed on rank {self.rank}: {exc}") from exc
        return StagedWork(work, tensor, target, self._backend) if target is not None else work

    # ---- buffers --------------------------------------------------------------------
    def segment_bytes(self, requested: int | None) -> int | None:
        """The segment size buckets travel in on this transport (the plan is cut accordingly)."""
        return requested

    def prepare(self, backend: Backend, plan: BucketPlan) -> None:
        """Get ready for one sync laid out by `plan` (every rank calls this with the same
        plan): both bucket buffers hold at least its largest bucket, and the transport
        knows the order its segments travel in."""
        from hal.backends.collectives import collective_traits, takes_device

        self._backend = backend
        if self._library is None or self._library[0] != backend.device_type:  # the group's: asked once
            self._library = (backend.device_type, _group_library(self.group, backend.device_type))
        library = self.dist_backend or self._library[1] or backend.dist_backend
        self._traits = collective_traits(library)
        self._host_only = not takes_device(library, backend.device_type)
        self._order = [(b.index, j, seg.start, seg.stop - seg.start) for b in plan.buckets for j, seg in enumerate(b.segments)]
        self._status_ahead, self._cursor = None, 0
        nbytes = plan.max_bucket_nbytes
        if nbytes > self._capacity:
            self._slots = self._allocate(backend, nbytes)
            self._capacity = nbytes

    def buffer(self, k: int) -> torch.Tensor:
        """The bytes of bucket k at plan offsets: where the sender packs it and where a
        receiver finds what did not land in a place of its own."""
        return self._slots[k % 2]

    def _allocate(self, backend: Backend, nbytes: int) -> list[torch.Tensor]:
        """The two bucket buffers of `nbytes` each that replace the current ones (`_slots`,
        which a transport that shares them releases here, once every rank has the new ones)."""
        self._slots = []  # free the old pair before allocating the larger one
        return [backend.empty(nbytes) for _ in range(2)]

    def _status(self, code: int, k: int, j: int, nbytes: int) -> torch.Tensor:
        return SegmentStatus(code, k, j, nbytes).tensor(self.control_device)

    # Receivers of transports whose sender sends statuses one segment ahead of the bytes
    # (S0 S1 D0 S2 D1 ...): the receive of the next status is posted as soon as one arrives.
    def _post_status_receive(self, words: torch.Tensor, what: str) -> Any:
        """Post the receive of a status into `words` (per transport)."""
        raise NotImplementedError

    def _status_one_ahead(self, k: int, j: int, nbytes: int) -> SegmentStatus:
        """The sender's status of segment j of bucket k, the next one in `_order`."""
        if self._status_ahead is None:
            self._post_status(self._cursor)
        work, words = self._status_ahead
        self._status_ahead = None
        self.channel.wait(work, f"bucket {k} segment {j} status")
        status = SegmentStatus.parse(words, k, j, nbytes, f"{self.name} on rank {self.rank}")
        self._cursor += 1
        if not status.failed and self._cursor < len(self._order):
            self._post_status(self._cursor)  # ahead of this segment's bytes, as the sender sends it
        return status

    def _post_status(self, index: int) -> None:
        k, j, _, _ = self._order[index]
        words = torch.zeros(4, dtype=torch.int64, device=self.control_device)
        self._status_ahead = (self._post_status_receive(words, f"bucket {k} segment {j} status"), words)

    # ---- data plane: per transport ---------------------------------------------------
    def send_segment(
        self, k: int, j: int, start: int, data: torch.Tensor, *, ready: Event, direct: bool, encoding: int = 0
    ) -> None:
        """Send `data` as segment j of bucket k, which starts at byte `start` of the bucket:
        a range of `buffer(k)` or a tensor's own bytes. `ready` completes when its pack
        did; if that wait fails, this raises before anything is sent. `direct` says that
        every later range of this segment's tensor is sent from the tensor's memory too.
        `encoding` (hal.kernels.Encoding): `data` is the segment's bytes, or
        a delta payload no longer than them."""
        raise NotImplementedError

    def send_failure(self, k: int, j: int) -> None:
        """Tell every receiver that segment j of bucket k, and everything after it, will not
        come; what was announced before it still arrives."""
        raise NotImplementedError

    def wait_sent(self, k: int) -> None:
        """Block until the transport is done with the memory of bucket k's segments."""
        raise NotImplementedError

    def receive_segments(self, land: Land, complete: Complete) -> bool:
        """Run this sync's receiving side; returns True when the sender announced a failure.

        For each segment, in the plan's order: once its status is here, a transport that can
        receive into a caller's tensor asks `land(k, j, status)` where the bytes should go
        (a tensor, or None for its buffer); once they are here, `complete(k, j, landed)` is
        called (`landed`: they are in that tensor, else in `buffer(k)` from the segment's
        start; `status.nbytes` of them, a delta payload when `status.encoding` says so), and
        after the last segment of a bucket the buffer is the transport's again. Each transport orders these steps so its wire
        stays busy; nothing of a segment whose status is FAILED, or of anything after it,
        is landed or completed.
        """
        raise NotImplementedError

    def finish(self) -> None:
        """End of a sync's data phase on this rank: drain what is outstanding."""

    def close(self) -> None:
        self._slots = []
        self._capacity = 0


class StagedWork:
    """A transfer through host memory (`host`), for a library that cannot touch the device's
    memory (gloo's send/recv on CUDA; anything of gloo on a PrivateUse1 device such as the
    NPU): keeps the host copy alive, and for a receive copies it into the device tensor
    `target` once it has arrived, before `wait` returns."""

    def __init__(self, work: Any, host: torch.Tensor, target: torch.Tensor | None, backend: Backend | None) -> None:
        self.work, self.host, self.target, self.backend = work, host, target, backend

    def wait(self, timeout: Any = None) -> Any:
        ok = self.work.wait(timeout) if timeout is not None else self.work.wait()
        if ok is not False and self.target is not None:
            target, self.target = self.target, None
            self.backend.copy_(target, self.host)
            self.backend.current_stream().synchronize()  # landed before anyone is told it has
        return ok


def _group_library(group: Any, device_type: str) -> str | None:
    """The collective library `group` runs tensors of `device_type` on ("gloo" for a CUDA
    tensor in a gloo group: gloo's traits then hold, not NCCL's); None when the group does
    not say."""
    try:
        config = dist.get_backend_config(group)  # "cpu:gloo,cuda:gloo", "cuda:nccl,cpu:gloo", ...
    except Exception:  # noqa: BLE001 - a group c10d's registry does not hold (hal's own, vLLM's): ask it
        try:
            config = group.name()  # "gloo", "nccl", ...
        except Exception:  # noqa: BLE001 - a group object that cannot say
            return None
    if not isinstance(config, str):
        return None
    pairs = dict(item.split(":", 1) for item in config.split(",") if ":" in item)
    if device_type in pairs:
        return pairs[device_type]
    libraries = set(pairs.values())
    # a group of one library that has no backend for this device type ("cpu:gloo,cuda:gloo"
    # and an NPU tensor): still that library's traits, and it takes no such tensor
    return libraries.pop() if len(libraries) == 1 else (None if pairs else config or None)
