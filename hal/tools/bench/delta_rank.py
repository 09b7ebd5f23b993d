"""One rank of `hal bench --delta` (the process `run_delta` spawns per rank): the sender's
fp32 master weights and their Adam steps, each method's objects, the emulated link, and
per learning rate the syncs, timed, with the receiver's byte check after each.
hal.tools.bench.delta describes what is measured.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hal.procs import run_gloo_rank
from hal.tools.bench.buffers import bytes_equal, flat_layout, flat_views
from hal.tools.bench.common import SENDER, PeakMemory, close, metrics_dict
from hal.tools.bench.delta_config import DELTA_METHODS, METHODS, DeltaBenchConfig
from hal.tools.bench.presets import Param, get_preset


# ---------------------------------------------------------------------------------------
# the trainer side: fp32 master weights and Adam


def master_weights(params: list[Param], config: DeltaBenchConfig) -> list[torch.Tensor]:
    """The fp32 master weights: norm weights 1.0, everything else N(0, init_std); seeded."""
    gen = torch.Generator().manual_seed(config.seed)
    out = []
    for p in params:
        t = torch.empty(p.shape, dtype=torch.float32)
        if len(p.shape) == 1 and "norm" in p.name:
            t.fill_(1.0)
        else:
            t.normal_(0.0, config.init_std, generator=gen)
        out.append(t)
    return out


class RandomGradientAdam:
    """`torch.optim.Adam` over `weights`, stepped on fresh N(0, grad_std) gradients.

    One parameter at a time: each gets its gradient, the optimizer steps (Adam skips
    parameters without one), the gradient is dropped. Adam is elementwise, so this is
    exactly one Adam step over all of them, holding one gradient instead of a model's.
    """

    def __init__(self, weights: list[torch.Tensor], lr: float, grad_std: float, seed: int) -> None:
        self.weights = weights
        self.grad_std = grad_std
        self.gen = torch.Generator().manual_seed(seed)
        try:
            self.optimizer = torch.optim.Adam(weights, lr=lr, fused=True)
            self.fused = True
        except (RuntimeError, ValueError):  # no fused Adam for this device / dtype
            self.optimizer = torch.optim.Adam(weights, lr=lr, foreach=False)
            self.fused = False

    def step(self) -> None:
        for w in self.weights:
            w.grad = torch.empty_like(w).normal_(0.0, self.grad_std, generator=self.gen)
            self.optimizer.step()
            w.grad = None


# ---------------------------------------------------------------------------------------
# one rank


@dataclass(slots=True)
class _Side:
    """One rank's objects for one learning rate."""

    rank: int
    config: DeltaBenchConfig
    names: list[str]
    flat: dict[str, torch.Tensor]  # per method: the wire-dtype bytes (floor, and receiver destinations)
    views: dict[str, list[torch.Tensor]]
    master: list[torch.Tensor] = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)
    runs: dict[str, Callable[[int], dict[str, Any]]] = field(default_factory=dict)

    @property
    def is_sender(self) -> bool:
        return self.rank == SENDER


class _Link:
    """An emulated link of `bytes_per_s` on the sending side: each send's bytes count as
    arrived only when a link of that rate, busy with the sends before it, would have
    carried them; the work around the sends (packing the next segment, the receiver's
    apply) overlaps it. The sync, or the floor's broadcast, ends no earlier than its last
    byte. An emulation, not a measurement of a link."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.busy_until = 0.0

    def carry(self, nbytes: int) -> None:
        self.busy_until = max(time.perf_counter(), self.busy_until) + nbytes / self.bytes_per_s

    def drain(self) -> None:
        delay = self.busy_until - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


def _paced_transport(link: _Link) -> Any:
    from hal.sync import BroadcastTransport

    class PacedBroadcast(BroadcastTransport):
        """BroadcastTransport whose sends go over the emulated `link`."""

        def send_segment(self, k: int, j: int, start: int, data: torch.Tensor, **kw: Any) -> None:
            link.carry(data.numel())
            super().send_segment(k, j, start, data, **kw)

        def finish(self) -> None:
            super().finish()
            link.drain()

    return PacedBroadcast(group=None, src=SENDER)


def _setup(side: _Side, method: str) -> None:
    """Create `method`'s objects on this rank and its run(version) -> metrics."""
    import torch.distributed as dist

    from hal.device import get_backend
    from hal.sync import BroadcastTransport, Receiver, Sender, SyncConfig, TensorSource, TensorSpec
    from hal.sync.config import DeltaConfig
    from hal.sync.sink import copy_into

    config = side.config
    link = _Link(config.link_gb_per_s * 1e9) if config.link_gb_per_s and side.is_sender else None
    if method == "floor":
        flat = side.flat["floor"]

        def run_floor(version: int) -> dict[str, Any]:
            if link is not None:
                link.carry(flat.numel())
            dist.broadcast(flat, src=SENDER)
            if link is not None:
                link.drain()
            return {}

        side.runs[method] = run_floor
        return
    backend = get_backend("cpu")  # host weights and gloo, whatever VERL_DEVICE says
    transport = _paced_transport(link) if link is not None else BroadcastTransport(group=None, src=SENDER)
    delta = None
    if method in DELTA_METHODS:
        delta = DeltaConfig(anchor_every=config.anchor_every, baseline=config.baseline, choose=DELTA_METHODS[method])
    sync_config = SyncConfig(
        bucket_bytes=config.bucket_bytes, wire_dtype=config.wire_dtype, timeout_s=config.collective_timeout_s, delta=delta
    )
    if side.is_sender:
        sender = Sender(transport, sync_config, backend=backend)
        source = TensorSource(list(zip(side.names, side.master)))
        side.objects[method] = (sender, transport)

        def run_send(version: int) -> dict[str, Any]:
            return metrics_dict(sender.send(source, version=version))

        side.runs[method] = run_send
        return
    specs = [TensorSpec(n, tuple(v.shape), v.dtype) for n, v in zip(side.names, side.views[method])]
    receiver = Receiver(transport, specs, timeout_s=config.collective_timeout_s, backend=backend)
    sink = copy_into(dict(zip(side.names, side.views[method])))
    side.objects[method] = (receiver, transport)

    def run_receive(version: int) -> dict[str, Any]:
        metrics = metrics_dict(receiver.receive(sink))
        metrics["baseline_bytes"] = receiver.baseline_bytes
        return metrics

    side.runs[method] = run_receive


def _teardown(side: _Side) -> None:
    for endpoint, transport in side.objects.values():
        close(endpoint)
        close(transport)
    side.objects.clear()
    side.runs.clear()


def _first_mismatch(got: torch.Tensor, want: torch.Tensor, wire: list[Param], offsets: list[int]) -> str:
    """The first parameter whose bytes differ (for the error message)."""
    for p, offset in zip(wire, offsets):
        if not bytes_equal(got[offset : offset + p.nbytes], want[offset : offset + p.nbytes]):
            return p.name
    return "(padding)"


def _run_lr(rank: int, config: DeltaBenchConfig, lr: float, lr_index: int, params: list[Param], memory: PeakMemory) -> dict[str, Any]:
    import torch.distributed as dist

    from hal.sync.config import wire_dtype_for

    wire = [Param(p.name, tuple(p.shape), wire_dtype_for(torch.float32, config.wire_dtype)) for p in params]
    offsets, total = flat_layout(wire)
    names = [p.name for p in params]
    flats = {"floor": torch.zeros(total, dtype=torch.uint8)}  # touched now: part of every baseline
    if rank != SENDER:
        for method in ("hal_bucketed", *DELTA_METHODS):
            flats[method] = torch.zeros(total, dtype=torch.uint8)
    views = {m: flat_views(f, wire, offsets) for m, f in flats.items()}
    side = _Side(rank=rank, config=config, names=names, flat=flats, views=views)
    optimizer: RandomGradientAdam | None = None
    if side.is_sender:
        torch.set_num_threads(config.update_threads)
        side.master = master_weights(params, config)
        optimizer = RandomGradientAdam(side.master, lr, config.grad_std, seed=config.seed + 1000 * (lr_index + 1))
        torch.set_num_threads(config.threads)

    syncs: list[dict[str, Any]] = []
    try:
        for s in range(config.syncs + 1):
            record: dict[str, Any] = {"sync": s, "methods": {}}
            dist.barrier()
            if side.is_sender:
                if s:
                    torch.set_num_threads(config.update_threads)
                    t0 = time.perf_counter()
                    optimizer.step()
                    record["update_s"] = time.perf_counter() - t0
                    torch.set_num_threads(config.threads)
                t0 = time.perf_counter()
                for view, w in zip(views["floor"], side.master):  # the floor's bytes: cast outside its timing
                    view.copy_(w)
                record["cast_s"] = time.perf_counter() - t0
            order = METHODS[s % len(METHODS) :] + METHODS[: s % len(METHODS)]
            gc.collect()  # once per sync (100-200 ms each here), not before every method
            for method in order:
                dist.barrier()
                memory.reset(collect=False)  # not timed
                if s == 0:  # objects created here: the anchor's peak includes them
                    _setup(side, method)
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                metrics = side.runs[method](s)
                t1, c1 = time.perf_counter(), time.process_time()
                peak = memory.extra()
                dist.barrier()
                record["methods"][method] = {"t0": t0, "t1": t1, "cpu_s": c1 - c0, "peak_extra_bytes": peak, "metrics": metrics}
            if rank != SENDER and config.verify:
                want = flats["floor"]
                for method in ("hal_bucketed", *DELTA_METHODS):
                    if not bytes_equal(flats[method], want):
                        bad = _first_mismatch(flats[method], want, wire, offsets)
                        raise RuntimeError(f"lr {lr:g} sync {s}: {method} left parameter {bad!r} with other bytes than the floor delivered")
                record["verified"] = True
                flats["hal_bucketed"].zero_()  # the next dense sync must write every byte again
            syncs.append(record)
    finally:
        _teardown(side)
    return {"lr": lr, "total_bytes": total, "fused_adam": None if optimizer is None else optimizer.fused, "syncs": syncs}


def _rank_body(rank: int, config: DeltaBenchConfig) -> dict[str, Any]:
    params = get_preset(config.preset).params()
    memory = PeakMemory()
    report: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "lrs": []}
    for i, lr in enumerate(config.lrs):
        report["lrs"].append(_run_lr(rank, config, lr, i, params, memory))
        gc.collect()
    return report


def rank_main(rank: int, out: Any, port: int, config: DeltaBenchConfig) -> None:
    torch.set_num_threads(config.threads)
    run_gloo_rank(out, rank, 2, port, config.collective_timeout_s, lambda: _rank_body(rank, config))
