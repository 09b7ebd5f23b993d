"""One rank of `hal bench --senders M --receivers K` (hal.tools.bench.senders describes the run).

Ranks 0..M-1 are the trainer ranks, M..M+K-1 the receivers. Every rank creates the same
gloo groups in the same order (torch.distributed requires it): the trainer group
[0..M-1], one sync group [r, M..M+K-1] per trainer rank r, and for `one_sender` a trainer
group [0] and a sync group [0, M..M+K-1] of their own, and for `plain_sender` another
sync group [0, M..M+K-1].
"""

from __future__ import annotations

import datetime
import gc
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hal.procs import run_gloo_rank
from hal.tools.bench.buffers import fill_pattern, first_mismatch, flat_layout, flat_views, matches_pattern, pattern_block, PATTERN_PERIOD
from hal.tools.bench.common import PeakMemory, close
from hal.tools.bench.presets import Param, get_preset
from hal.tools.bench.senders_config import SendersConfig, chunk_rows, row_nbytes


def rank_main(rank: int, out: Any, port: int, config: SendersConfig) -> None:
    torch.set_num_threads(config.threads)
    run_gloo_rank(out, rank, config.world_size, port, config.collective_timeout_s, lambda: _rank_body(rank, config))


@dataclass(slots=True)
class _State:
    run: Callable[[], None]
    teardown: Callable[[], None]
    peak_extra: int | None = None
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    verified: int = 0
    sent: list[int] = field(default_factory=list)  # trainer: SyncMetrics.bytes per sync
    model: list[int] = field(default_factory=list)  # trainer: SyncMetrics.model_bytes per sync
    segments: list[int] = field(default_factory=list)  # trainer: bytes handed to the transport per sync
    received: list[int] = field(default_factory=list)  # receiver: SyncMetrics.bytes per sync
    plan_bytes: int | None = None
    held_bytes: int | None = None


def fill_pattern_range(dst: torch.Tensor, start: int, block2: torch.Tensor) -> None:
    """Write into `dst` (uint8) the bytes `fill_pattern` writes at [start, start + len(dst))
    of a flat buffer whose pattern block is `block2[:period]`; `block2` is that block twice."""
    period = block2.numel() // 2
    n, at = dst.numel(), 0
    while at < n:
        phase = (start + at) % period
        step = min(period, n - at)
        dst[at : at + step].copy_(block2[phase : phase + step])
        at += step


def local_shards(params: list[Param], offsets: list[int], total: int, senders: int, rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This trainer rank's Shard(0) rows of every parameter, as views into one flat buffer
    of its own, filled with the bytes the whole model's flat pattern has there."""
    period = min(PATTERN_PERIOD, total)
    block = pattern_block(period, 0)
    block2 = torch.cat([block, block])
    spans, cursor = [], 0
    for p in params:
        lo, hi = chunk_rows(p.shape[0], senders)[rank]
        align = p.dtype.itemsize
        cursor = (cursor + align - 1) // align * align
        spans.append((cursor, lo, hi))
        cursor += (hi - lo) * row_nbytes(p)
    flat = torch.empty(cursor, dtype=torch.uint8)
    locals_ = []
    for p, offset, (at, lo, hi) in zip(params, offsets, spans):
        per_row = row_nbytes(p)
        raw = flat[at : at + (hi - lo) * per_row]
        fill_pattern_range(raw, offset + lo * per_row, block2)
        locals_.append(raw.view(p.dtype).view(hi - lo, *p.shape[1:]))
    return flat, locals_


def megatron_blocks(params: list[Param], offsets: list[int], total: int, config: SendersConfig, rank: int) -> tuple[torch.Tensor, list[tuple[str, Any]], int]:
    """This trainer rank's part of a Megatron-shaped layout (hal.tools.bench.senders_megatron):
    `Block`s (and whole norms) in one flat buffer of its own, holding the bytes the whole
    model's flat pattern has there; and the bytes it is to send (for the share check).
    Each block is cut from its parameter's pattern, made whole for a moment (set-up, not timed)."""
    from hal.sync.plan import Block
    from hal.tools.bench.senders_megatron import megatron_held

    period = min(PATTERN_PERIOD, total)
    block2 = torch.cat([pattern_block(period, 0)] * 2)
    held = megatron_held(params, config.tp, config.pp, rank)
    where = dict(zip((p.name for p in params), offsets))
    sizes = [h.param.dtype.itemsize * _numel(h.block) for h in held]
    flat = torch.empty(sum(sizes) + 8 * len(held), dtype=torch.uint8)
    out, cursor = [], 0
    for h, size in zip(held, sizes):
        cursor = (cursor + 7) // 8 * 8
        whole = torch.empty(h.param.nbytes, dtype=torch.uint8)
        fill_pattern_range(whole, where[h.param.name], block2)
        values = whole.view(h.param.dtype).view(h.param.shape)[tuple(slice(o, o + n) for o, n in zip(h.offsets, h.block))]
        local = flat[cursor : cursor + size].view(h.param.dtype).view(h.block)
        local.copy_(values)
        out.append((h.param.name, local if h.whole else Block(local, tuple(h.param.shape), h.offsets)))
        cursor += size
    return flat, out, sum(h.sent_bytes for h in held)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _count_segments(transport: Any, counter: list[int]) -> None:
    """Shadow `transport.send_segment` (on this instance only) to add each segment's bytes to counter[0]."""
    real = transport.send_segment

    def send_segment(k: int, j: int, start: int, data: torch.Tensor, **kwargs: Any) -> Any:
        counter[0] += data.numel() * data.element_size()
        return real(k, j, start, data, **kwargs)

    transport.send_segment = send_segment


def _rank_body(rank: int, config: SendersConfig) -> dict[str, Any]:
    import torch.distributed as dist

    from hal.device import get_backend
    from hal.sync import BroadcastTransport, Receiver, Sender, SyncConfig, TensorSource, TensorSpec, copy_into
    from hal.sync.receive import ShardedReceiver
    from hal.sync.send import ShardedSender

    began = time.perf_counter()
    m = config.senders
    receivers = list(range(m, config.world_size))
    timeout = datetime.timedelta(seconds=config.collective_timeout_s)
    trainer_group = dist.new_group(list(range(m)), backend="gloo", timeout=timeout)
    sync_groups = [dist.new_group([r, *receivers], backend="gloo", timeout=timeout) for r in range(m)]
    if "one_sender" in config.methods:
        one_trainer = dist.new_group([0], backend="gloo", timeout=timeout)
        one_sync = dist.new_group([0, *receivers], backend="gloo", timeout=timeout)
    if "plain_sender" in config.methods:
        plain_sync = dist.new_group([0, *receivers], backend="gloo", timeout=timeout)
    one = "one_sender" in config.methods or "plain_sender" in config.methods
    backend = get_backend(config.sync_backend)  # host weights and gloo, whatever VERL_DEVICE says
    sync_config = SyncConfig(bucket_bytes=config.bucket_bytes, timeout_s=config.collective_timeout_s)

    params = get_preset(config.preset).params()
    names = [p.name for p in params]
    offsets, total = flat_layout(params)
    is_trainer = rank < m
    # The weights first (part of every method's memory baseline): a trainer rank's rows as
    # Shard(0) DTensors, rank 0's whole model for one_sender, a receiver's destinations.
    if is_trainer:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        if config.tp is not None:  # a Megatron-shaped layout: blocks and replicated norms
            shard_flat, dtensors, held = megatron_blocks(params, offsets, total, config, rank)
        else:
            shard_flat, locals_ = local_shards(params, offsets, total, m, rank)
            mesh = DeviceMesh.from_group(trainer_group, "cpu")
            dtensors = [
                (p.name, DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=torch.Size(p.shape), stride=_contiguous_stride(p.shape)))
                for p, t in zip(params, locals_)
            ]
            held = sum(t.to_local().nbytes for _, t in dtensors)
        if rank == 0 and one:
            whole = torch.empty(total, dtype=torch.uint8)
            fill_pattern(whole)
            whole_pairs = list(zip(names, flat_views(whole, params, offsets)))
    else:
        flat = torch.zeros(total, dtype=torch.uint8)  # touched now: part of the baseline
        specs = [TensorSpec(p.name, tuple(p.shape), p.dtype) for p in params]
        sink = copy_into(dict(zip(names, flat_views(flat, params, offsets))))

    def sender_method(group: Any, trainer: Any, source: list[tuple[str, Any]], held_bytes: int) -> _State:
        transport = BroadcastTransport(group, src=0)
        counter = [0]
        _count_segments(transport, counter)
        sender = ShardedSender(transport, config=sync_config, trainer_group=trainer, backend=backend)
        state = _State(lambda: None, lambda: (close(sender.sender), close(transport)))
        state.held_bytes = held_bytes
        version = [0]

        def run() -> None:
            version[0] += 1
            counter[0] = 0
            metrics = sender.sync(source, version=version[0])
            state.sent.append(int(metrics.bytes))
            state.model.append(int(metrics.model_bytes))
            state.segments.append(counter[0])
            state.plan_bytes = sender.plan.bytes_of(sender.rank)

        state.run = run
        return state

    def plain_sender_method() -> _State:
        transport = BroadcastTransport(plain_sync, src=0)
        counter = [0]
        _count_segments(transport, counter)
        sender = Sender(transport, sync_config, backend=backend)
        state = _State(lambda: None, lambda: (close(sender), close(transport)))
        state.held_bytes = state.plan_bytes = total
        source = TensorSource(whole_pairs)

        def run() -> None:
            counter[0] = 0
            metrics = sender.send(source, version=len(state.sent) + 1)
            state.sent.append(int(metrics.bytes))
            state.model.append(int(metrics.bytes))
            state.segments.append(counter[0])

        state.run = run
        return state

    def plain_receiver_method() -> _State:
        transport = BroadcastTransport(plain_sync, src=0)
        receiver = Receiver(transport, specs, timeout_s=config.collective_timeout_s, backend=backend)
        state = _State(lambda: None, lambda: close(transport))

        def run() -> None:
            state.received.append(int(receiver.receive(sink).bytes))

        state.run = run
        return state

    def receiver_method(groups: list[Any]) -> _State:
        transports = [BroadcastTransport(g, src=0) for g in groups]
        receiver = ShardedReceiver(transports, specs, timeout_s=config.collective_timeout_s, backend=backend)
        state = _State(lambda: None, lambda: [close(t) for t in transports])

        def run() -> None:
            metrics = receiver.receive(sink)
            state.received.append(int(metrics.bytes))

        state.run = run
        return state

    def setup(method: str) -> _State:
        if method == "sharded":
            if is_trainer:
                return sender_method(sync_groups[rank], trainer_group, dtensors, held)
            return receiver_method(sync_groups)
        if is_trainer and rank != 0:
            return _State(lambda: None, lambda: None)  # waits at the barriers
        if method == "plain_sender":
            return plain_sender_method() if rank == 0 else plain_receiver_method()
        if rank == 0:
            return sender_method(one_sync, one_trainer, whole_pairs, total)
        return receiver_method([one_sync])

    memory = PeakMemory()
    report: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "methods": {}, "setup_wall_s": time.perf_counter() - began}

    def once(method: str, state: _State, label: str) -> None:
        gc.collect()
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        state.run()
        t1, c1 = time.perf_counter(), time.process_time()
        dist.barrier()  # every rank out of the timed region before any checks or clears its bytes
        if not is_trainer:
            if config.verify:
                if not matches_pattern(flat):
                    raise RuntimeError(f"{method}: {label}: parameter {first_mismatch(flat, params, offsets)!r} arrived with wrong bytes at rank {rank}")
                state.verified += 1
            flat.zero_()  # the next sync must write every byte again
        state.starts.append(t0)
        state.ends.append(t1)
        state.cpu.append(c1 - c0)

    states: dict[str, _State] = {}
    try:
        for method in config.methods:
            dist.barrier()
            memory.reset()
            state = states[method] = setup(method)
            for i in range(config.warmup):
                once(method, state, f"warm-up {i}")
                if i == 0:
                    state.peak_extra = memory.extra()
            if config.warmup == 0:
                state.peak_extra = None  # measured on a first sync only
        n = len(config.methods)
        for r in range(config.repeats):
            for method in config.methods[r % n :] + config.methods[: r % n]:
                once(method, states[method], f"round {r}")
    finally:
        for state in states.values():
            state.teardown()
    warm = config.warmup
    for method, state in states.items():
        report["methods"][method] = {
            "starts": state.starts[warm:],
            "ends": state.ends[warm:],
            "cpu_s": state.cpu[warm:],
            "peak_extra_bytes": state.peak_extra,
            "verified": state.verified,
            "sent_bytes": state.sent,
            "model_bytes": state.model,
            "segment_bytes": state.segments,
            "received_bytes": state.received,
            "plan_bytes": state.plan_bytes,
            "held_bytes": state.held_bytes,
        }
    dist.barrier()
    return report


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))
