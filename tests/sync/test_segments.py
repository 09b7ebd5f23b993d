"""A segment is the unit of work: the backend calls a sync makes per segment do not grow
with the number of tensors in it (issue 19), and what arrives is still exact.

The same bytes travel once as 64 tensors and once as 1,024 (and in bf16 from fp32, so the
pack casts too), in one segment of one bucket, on cpu and on sim (asynchronous streams);
every backend call of the sender and of the receiver in the steady state (the third sync of
the same tensors, into the same destinations: hal.sync.plan.steady) is counted, and so are the
garbage collections during that sync: a sync that keeps an object per tensor alive while it runs
(a list of shapes, a tuple per tensor handed over) sets off the collector, whose full
passes over a large model's objects cost more than the sync itself (docs/benchmarks.md).
"""

from __future__ import annotations

import gc

import pytest
import torch

from hal.backends.cpu import CpuBackend
from hal.backends.sim import SimBackend
from hal.sync import BroadcastTransport, IpcTransport, Receiver, Sender, SyncConfig, TensorSource, TensorSpec, copy_into
from tests.multiproc import run_group

pytestmark = pytest.mark.multiprocess

COUNTED = ("copy_", "copy_many_", "prepare_copies", "copy_prepared_", "launch", "new_stream", "new_event", "empty", "empty_pinned", "stream")
TOTAL_ELEMENTS = 64 * 1024


def counting(base: type) -> object:
    class Counting(base):
        def __init__(self) -> None:
            super().__init__()
            self.calls: dict[str, int] = {}

        def reset(self) -> None:
            self.calls = {}

    for name in COUNTED:
        real = getattr(base, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            self.calls[_name] = self.calls.get(_name, 0) + 1
            return _real(self, *args, **kwargs)

        setattr(Counting, name, counted)
    return Counting()


def pairs(n: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"layers.{i}.w", torch.randn(TOTAL_ELEMENTS // n, generator=g)) for i in range(n)]


def segment_worker(rank, world, backend_name, transport_name, wire):
    kind = {"cpu": CpuBackend, "sim": SimBackend}[backend_name]
    transport = {"broadcast": BroadcastTransport, "ipc": IpcTransport}[transport_name](None, src=0)
    config = SyncConfig(bucket_bytes=1 << 20, segment_bytes=1 << 20, wire_dtype=wire, timeout_s=30)
    counts, exact = {}, {}
    collections: list[int] = []
    gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
    for n in (64, 1024):
        backend = counting(kind)
        wire_of = lambda t: t.to(wire) if wire is not None else t  # noqa: E731
        if rank == 0:
            sender = Sender(transport, config, backend=backend)
            weights = pairs(n, 1)
            sender.send(TensorSource(weights), version=1)  # the first sync allocates
            for (_, held), (_, new) in zip(weights, pairs(n, 2)):
                held.copy_(new)  # an optimizer step: the same tensors, new values
            sender.send(TensorSource(weights), version=2)  # the second prepares its copies, once
            for (_, held), (_, new) in zip(weights, pairs(n, 3)):
                held.copy_(new)
            source = TensorSource(list(weights))  # a new list of the same tensors: the steady state
            backend.reset()
            gc.collect()
            collections.clear()
            metrics = sender.send(source, version=3)
            during, calls = len(collections), dict(backend.calls)
            assert metrics.buckets == 1
            sender.send(TensorSource(pairs(n, 4)), version=4)  # other tensors of the same layout
        else:
            specs = [TensorSpec.of(name, wire_of(t)) for name, t in pairs(n, 0)]
            held = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs}
            receiver = Receiver(transport, specs, backend=backend, timeout_s=30)
            receiver.receive(copy_into(held))
            receiver.receive(copy_into(held))
            sink = copy_into(held)  # made anew over the same tensors: they are compared, not the sink
            backend.reset()
            gc.collect()
            collections.clear()
            receiver.receive(sink)
            during, calls = len(collections), dict(backend.calls)
            exact[n] = all(torch.equal(held[name], wire_of(t)) for name, t in pairs(n, 3))
            # other destinations under the same names (an engine that reallocated its
            # weights): what the receiver kept for the old ones must not be used
            moved = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs}
            receiver.receive(copy_into(moved))
            exact[n] = exact[n] and all(torch.equal(moved[name], wire_of(t)) for name, t in pairs(n, 4))
            exact[n] = exact[n] and all(torch.equal(held[name], wire_of(t)) for name, t in pairs(n, 3))
        counts[n] = calls | {"garbage collections": during}
    return counts, exact


@pytest.mark.parametrize(
    "backend,transport,wire",
    [("cpu", "broadcast", None), ("sim", "broadcast", torch.bfloat16), ("cpu", "ipc", torch.bfloat16)],
    ids=["cpu-broadcast", "sim-broadcast-bf16", "cpu-ipc-bf16"],
)
def test_backend_calls_per_segment_do_not_grow_with_its_tensor_count(backend, transport, wire):
    (sent, _), (received, exact) = run_group(segment_worker, 2, args=(backend, transport, wire), timeout=120)
    assert exact == {64: True, 1024: True}
    assert sent[64] == sent[1024], f"sender: {sent}"
    assert received[64] == received[1024], f"receiver: {received}"
    # the steady state: one prepared copy per segment, prepared before (the second sync)
    for calls in (sent[1024], received[1024]):
        assert calls.get("copy_prepared_") == 1 and not calls.get("copy_") and not calls.get("copy_many_"), calls
        assert not calls.get("prepare_copies"), calls
    assert sent[1024]["garbage collections"] == 0 and received[1024]["garbage collections"] == 0, (sent, received)
