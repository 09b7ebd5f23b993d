"""The transfer benchmark's methods (described in hal.tools.bench.transfer): each is a
setup(ctx) that creates the method's objects on this rank and returns (run_once, teardown).

`SETUPS` maps every method name of hal.tools.bench.transfer_config.METHODS to its setup.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hal.tools.bench.common import MIB, SENDER, close, metrics_dict
from hal.tools.bench.presets import Param
from hal.tools.bench.transfer_config import TransferConfig, node_keys, node_leaders, plan_segment_bytes


@dataclass(slots=True)
class RankContext:
    """What a method's setup gets on one rank, and where its run records what it measured."""

    rank: int
    config: TransferConfig
    params: list[Param]
    flat: torch.Tensor  # the sender's weights or the receiver's destinations, all bytes
    tensors: list[torch.Tensor]  # views into `flat`, one per parameter
    step: int = 0
    metrics: list[dict[str, Any]] = field(default_factory=list)
    trace: list[tuple[str, Any, float, float]] = field(default_factory=list)
    network: list[int] = field(default_factory=list)  # hal_hier, sender: bytes over the network per sync

    @property
    def is_sender(self) -> bool:
        return self.rank == SENDER


def _setup_floor(ctx: RankContext) -> tuple[Callable[[], None], Callable[[], None]]:
    import torch.distributed as dist

    def run() -> None:
        dist.broadcast(ctx.flat, src=SENDER)

    return run, lambda: None


def _setup_per_tensor(ctx: RankContext) -> tuple[Callable[[], None], Callable[[], None]]:
    import torch.distributed as dist

    def run() -> None:
        for t in ctx.tensors:
            dist.broadcast(t, src=SENDER)

    return run, lambda: None


def _setup_floor_leaders(ctx: RankContext) -> tuple[Callable[[], None], Callable[[], None]]:
    import torch.distributed as dist

    # Every rank takes part in creating the subgroup (torch.distributed requires it);
    # only its members broadcast.
    members = [SENDER] + node_leaders(ctx.config.receivers, ctx.config.nodes)
    group = dist.new_group(ranks=members, backend="gloo", timeout=datetime.timedelta(seconds=ctx.config.collective_timeout_s))

    def run() -> None:
        if ctx.rank in members:
            dist.broadcast(ctx.flat, src=SENDER, group=group)

    return run, lambda: None


def _setup_floor_with_copy(ctx: RankContext) -> tuple[Callable[[], None], Callable[[], None]]:
    import torch.distributed as dist

    # While the flat broadcast runs, each process copies as many bytes as the model holds,
    # as a perfectly pipelined pack (sender) or apply (receiver) would. Through a 64 MiB
    # scratch pair (twice the L3 here, so the copies still go to memory), to keep its
    # memory small.
    chunk = min(64 * MIB, ctx.flat.numel())
    scratch_src = torch.ones(chunk, dtype=torch.uint8)
    scratch_dst = torch.zeros(chunk, dtype=torch.uint8)
    total = ctx.flat.numel()

    def run() -> None:
        work = dist.broadcast(ctx.flat, src=SENDER, async_op=True)
        done = 0
        while done < total:
            n = min(chunk, total - done)
            scratch_dst[:n].copy_(scratch_src[:n])
            done += n
        work.wait()

    return run, lambda: None


def _setup_floor_pipelined(ctx: RankContext) -> tuple[Callable[[], None], Callable[[], None]]:
    import torch.distributed as dist

    from hal.sync import SyncConfig

    # The model's bytes in the sync's segments through two slots, with torch.distributed
    # alone: the sender copies each segment into a slot just before sending it, a receiver
    # copies it out just after it arrived, while the next one is on the wire. A bucketed
    # sync's structure with nothing per tensor, no header and no statuses: what its copies
    # cost where they must wait for the wire (floor_with_copy runs them all at once).
    total = ctx.flat.numel()
    segment = min(SyncConfig().segment_bytes, ctx.config.bucket_bytes, total)  # as hal's segments: none spans buckets
    slots = [torch.empty(segment, dtype=torch.uint8) for _ in range(2)]
    starts = list(range(0, total, segment))
    sizes = [min(segment, total - lo) for lo in starts]
    one_receiver = ctx.config.receivers == 1  # send/recv pairs, as BroadcastTransport uses for one receiver on gloo

    def transfer(slot: torch.Tensor) -> Any:
        if not one_receiver:
            return dist.broadcast(slot, src=SENDER, async_op=True)
        return dist.isend(slot, 1) if ctx.is_sender else dist.irecv(slot, SENDER)

    def run() -> None:
        flat, works = ctx.flat, {}
        if ctx.is_sender:
            for s, (lo, n) in enumerate(zip(starts, sizes)):
                if s >= 2:
                    works.pop(s - 2).wait()  # that slot is free again (each work is waited once: gloo counts them)
                slot = slots[s % 2][:n]
                slot.copy_(flat[lo : lo + n])
                works[s] = transfer(slot)
            for work in works.values():
                work.wait()
            return
        posted = transfer(slots[0][: sizes[0]])
        for s, (lo, n) in enumerate(zip(starts, sizes)):
            posted.wait()
            if s + 1 < len(starts):  # the next segment goes to the other slot while this one is copied out
                posted = transfer(slots[(s + 1) % 2][: sizes[s + 1]])
            flat[lo : lo + n].copy_(slots[s % 2][:n])

    return run, lambda: None


def _setup_hal(ctx: RankContext, transport_name: str, target: str) -> tuple[Callable[[], None], Callable[[], None]]:
    from hal.device import get_backend
    from hal.sync import Receiver, Sender, SyncConfig, TensorSource, TensorSpec, as_sink
    from hal.sync.sink import copy_into
    import hal.sync
    from hal.sync.transport import hierarchical as hierarchy

    backend = get_backend(ctx.config.sync_backend)  # host weights and gloo, whatever VERL_DEVICE says

    transport_cls = getattr(hal.sync, transport_name)  # BroadcastTransport, IpcTransport, HierarchicalTransport
    transport = transport_cls(group=None, src=SENDER)  # HierarchicalTransport reads VERL_HAL_NODE here
    hierarchical = isinstance(transport, hierarchy.HierarchicalTransport)
    if hierarchical:
        _check_layout(ctx, transport)
    if ctx.config.trace:
        _trace_calls(transport, ctx.trace, ("prepare", "exchange_header", "agree", "send_segment", "send_failure", "wait_sent", "receive_segments", "finish"))
    sync_config = SyncConfig(bucket_bytes=ctx.config.bucket_bytes, timeout_s=ctx.config.collective_timeout_s)
    names = [p.name for p in ctx.params]

    if ctx.is_sender:
        sender = Sender(transport, sync_config, backend=backend)
        pairs = list(zip(names, ctx.tensors))
        if ctx.config.trace:
            _trace_calls(sender.packer, ctx.trace, ("pack",))  # each segment's pack (hal.sync.send.packing)

        # one model's segments per node: without --nodes every receiver is on one node
        expected_network = ctx.config.nodes * plan_segment_bytes(ctx.params, ctx.config.bucket_bytes) if hierarchical else 0

        def run() -> None:
            ctx.step += 1
            before = transport.network_bytes if hierarchical else 0
            metrics = sender.send(TensorSource(pairs), version=ctx.step)
            ctx.metrics.append(metrics_dict(metrics))
            if hierarchical:
                sent = transport.network_bytes - before
                ctx.network.append(sent)
                if sent != expected_network:  # an int compare: nothing measurable inside the timed run
                    raise RuntimeError(
                        f"hal_hier: {sent} bytes crossed the network in sync {ctx.step}, expected nodes ({ctx.config.nodes}) "
                        f"x the sync's segment bytes = {expected_network}"
                    )

        def teardown() -> None:
            close(sender)
            close(transport)

        return run, teardown

    specs = [TensorSpec(p.name, tuple(p.shape), p.dtype) for p in ctx.params]
    receiver = Receiver(transport, specs, timeout_s=ctx.config.collective_timeout_s, backend=backend)
    destination = dict(zip(names, ctx.tensors))
    apply: Any
    if target == "copy_into":
        apply = copy_into(destination)
    elif target == "copy":

        def apply(pairs: list[tuple[str, torch.Tensor]]) -> None:
            for name, view in pairs:
                destination[name].copy_(view)

    else:

        def apply(pairs: list[tuple[str, torch.Tensor]]) -> None:
            for _name, view in pairs:
                _read_all(view)

    if ctx.config.trace:
        untraced = as_sink(apply)

        class Traced:  # the same sink (destinations included), its apply timed: tracing does not change the path
            policy = untraced.policy
            tensors = getattr(untraced, "tensors", None)  # a mapped sink's (SinkPolicy.destinations)

            def destination(self, name: str) -> torch.Tensor | None:
                return untraced.destination(name)

            def apply(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
                t0 = time.perf_counter()
                try:
                    untraced.apply(pairs)
                finally:
                    ctx.trace.append(("apply", len(pairs), t0, time.perf_counter()))

            def abort(self) -> None:
                untraced.abort()

        apply = Traced()

    def run() -> None:
        metrics = receiver.receive(apply)
        ctx.metrics.append(metrics_dict(metrics))

    def teardown() -> None:
        close(receiver)
        close(transport)

    return run, teardown


def _check_layout(ctx: RankContext, transport: Any) -> None:
    """HierarchicalTransport saw the nodes this benchmark set up: every rank's key, the
    leaders, and (on the sender) one network peer per node."""
    keys = node_keys(ctx.config.receivers, ctx.config.nodes)
    leaders = node_leaders(ctx.config.receivers, ctx.config.nodes)
    problems = []
    if list(transport.nodes.nodes) != keys:
        problems.append(f"node keys {list(transport.nodes.nodes)}, expected {keys}")
    if ctx.is_sender and list(transport.remote_leaders) != leaders:
        problems.append(f"remote leaders {list(transport.remote_leaders)}, expected {leaders}")
    if not ctx.is_sender and transport.leader != min(r for r in range(1, len(keys)) if keys[r] == keys[ctx.rank]):
        problems.append(f"rank {ctx.rank}'s leader is {transport.leader}")
    if problems:
        raise RuntimeError("hal_hier: " + "; ".join(problems))


def _read_all(tensor: torch.Tensor) -> int:
    """Read every byte of `tensor` once (a wrapping sum of its words), allocating nothing large."""
    raw = tensor.reshape(-1).view(torch.uint8)
    words = raw.numel() // 8
    total = int(raw[: words * 8].view(torch.int64).sum()) if words else 0
    return total + int(raw[words * 8 :].sum())


def _trace_calls(obj: Any, log: list[tuple[str, Any, float, float]], names: tuple[str, ...]) -> None:
    """Shadow `obj`'s methods `names` with wrappers that append (name, first arg, start, end) to `log`."""
    for name in names:
        method = getattr(obj, name, None)
        if method is None:
            continue

        def wrapper(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                first = args[0] if args else None
                if not isinstance(first, int):  # a Bucket's index; never a tensor (or its methods)
                    first = getattr(first, "index", None)
                    first = first if isinstance(first, int) else None
                log.append((_name, first, t0, time.perf_counter()))

        setattr(obj, name, wrapper)


SETUPS: dict[str, Callable[[RankContext], tuple[Callable[[], None], Callable[[], None]]]] = {
    "floor_with_copy": _setup_floor_with_copy,
    "floor_pipelined": _setup_floor_pipelined,
    "floor": _setup_floor,
    "per_tensor": _setup_per_tensor,
    "hal_bucketed": lambda ctx: _setup_hal(ctx, "BroadcastTransport", "copy_into"),
    "hal_shm": lambda ctx: _setup_hal(ctx, "IpcTransport", "copy_into"),
    "hal_bucketed_copy": lambda ctx: _setup_hal(ctx, "BroadcastTransport", "copy"),
    "hal_bucketed_read": lambda ctx: _setup_hal(ctx, "BroadcastTransport", "read"),
    "hal_shm_read": lambda ctx: _setup_hal(ctx, "IpcTransport", "read"),
    "hal_hier": lambda ctx: _setup_hal(ctx, "HierarchicalTransport", "copy_into"),
    "floor_leaders": _setup_floor_leaders,
}
