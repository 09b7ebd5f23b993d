"""The steady state (issue 30, hal.sync.plan.steady): a sync of unchanged tensors into unchanged
destinations reuses what the last sync made of them, and every change is still noticed in
the same sync and handled as on a first sync.

One sender (a `torch.nn.Module`, through `ModuleSource`) and one receiver (`copy_into` over
a dict of destinations, made anew every sync as a caller does) run a script of syncs. Each
step changes something on one side or the other, or nothing; after every sync the receiver
compares every destination with what the sender held. Beside the bytes, each step says
whether the steady state held (the sender's listing epoch, the receiver's kept check), so
that a test of "noticed" cannot pass by never having used what was kept.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from hal.backends.cpu import CpuBackend
from hal.backends.sim import SimBackend
from hal.sync import (
    BroadcastTransport,
    IpcTransport,
    Receiver,
    Sender,
    SinkPolicy,
    SpecMismatchError,
    SyncConfig,
    TensorSource,
    copy_into,
)
from tests.multiproc import run_group

pytestmark = pytest.mark.multiprocess

EXPERTS = 32
BUCKET = 8 * 1024  # `embed` (16 KiB) goes in chunks; the experts share segments


def start_shapes() -> dict[str, tuple[int, ...]]:
    shapes = {"a": (64,), "b": (8, 8), "c": (3, 5), "d": (6, 4), "embed": (64, 64)}
    return shapes | {f"experts.{i}": (16,) for i in range(EXPERTS)}


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shapes = start_shapes()
        for name in ("a", "b", "c", "d", "embed"):
            setattr(self, name, torch.nn.Parameter(torch.zeros(shapes[name])))
        self.experts = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(16)) for _ in range(EXPERTS)])


def values(name: str, shape: tuple[int, ...], dtype: torch.dtype, version: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(version * 100_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g).to(dtype)


# Each step: (sender's change, receiver's change, whether the sync is refused,
# whether the sender reads from what it kept (same epoch), whether the receiver's check was kept)
STEPS = [
    ("first", None, False, None, False),
    (None, None, False, True, True),  # the second sync: what the first made is kept
    (None, None, False, True, True),  # the steady state
    (None, None, False, True, True),
    ("replace b", None, False, False, True),  # another Parameter object under `b`
    (None, None, False, True, True),
    ("move a", None, False, False, True),  # `a.data = ...`: the same object, other memory
    ("replace expert 3", None, False, False, True),  # a ParameterList slot written
    ("resize c", "resize c", False, False, False),  # both sides at the new shape
    (None, None, False, True, True),
    ("retype b", None, False, False, False),  # bf16 now: the destination (fp32) casts
    (None, "move a", False, True, False),  # the destination's memory replaced
    (None, "noncontiguous d", False, True, False),  # a transposed destination under `d`
    (None, "retype embed", False, True, False),  # the destination casts to bf16
    (None, None, False, True, True),
    (None, "shrink c", True, True, False),  # refused: nothing lands anywhere
    (None, "restore c", False, True, False),
    (None, None, False, True, True),
]


def steady_worker(rank, world, backend_name, transport_name):
    backend = {"cpu": CpuBackend, "sim": SimBackend}[backend_name]()
    transport = {"broadcast": BroadcastTransport, "ipc": IpcTransport}[transport_name](None, src=0)
    config = SyncConfig(bucket_bytes=BUCKET)
    shapes, dtypes = start_shapes(), {name: torch.float32 for name in start_shapes()}
    seen = []
    if rank == 0:
        model, sender = Model(), Sender(transport, config, backend=backend)
        for version, (change, _, refused, _, _) in enumerate(STEPS, start=1):
            if change == "replace b":
                model.b = torch.nn.Parameter(torch.zeros(shapes["b"]))
            elif change == "move a":
                model.a.data = torch.zeros(shapes["a"])
            elif change == "replace expert 3":
                model.experts[3] = torch.nn.Parameter(torch.zeros(16))
            elif change == "resize c":
                shapes["c"] = (4, 5)
                model.c.data = torch.zeros(shapes["c"])
            elif change == "retype b":
                dtypes["b"] = torch.bfloat16
                model.b.data = model.b.data.to(torch.bfloat16)
            with torch.no_grad():  # an optimizer step: new values, in place
                for name, param in model.named_parameters():
                    param.copy_(values(name, shapes[name], dtypes[name], version))
            epoch = sender.known.epoch
            try:
                sender.send(model, version=version)
                outcome = "sent"
            except SpecMismatchError as exc:
                outcome = f"refused: {exc}"
            seen.append((outcome, sender.known.epoch == epoch))
        return seen
    dests = {name: torch.zeros(shape) for name, shape in shapes.items()}
    receiver = Receiver(transport, None, backend=backend, timeout_s=60)
    for version, (change, dest_change, refused, _, _) in enumerate(STEPS, start=1):
        if change == "resize c":
            shapes["c"] = (4, 5)
        elif change == "retype b":
            dtypes["b"] = torch.bfloat16
        if dest_change == "resize c":
            dests["c"] = torch.zeros(shapes["c"])
        elif dest_change == "move a":
            dests["a"].data = torch.zeros(shapes["a"])
        elif dest_change == "noncontiguous d":
            dests["d"] = torch.zeros(tuple(reversed(shapes["d"]))).t()
        elif dest_change == "retype embed":
            dests["embed"].data = dests["embed"].data.to(torch.bfloat16)
        elif dest_change == "shrink c":
            dests["c"].data = torch.zeros(2, 5)
        elif dest_change == "restore c":
            dests["c"].data = torch.zeros(shapes["c"])
        before = {name: t.clone() for name, t in dests.items()}
        try:
            receiver.receive(copy_into(dests))
            outcome = "received"
        except SpecMismatchError as exc:
            outcome = f"refused: {exc}"
        if outcome == "received":
            wrong = [
                name for name, t in dests.items() if not torch.equal(t, values(name, shapes[name], dtypes[name], version).to(t.dtype))
            ]
        else:  # nothing of a refused sync lands
            wrong = [name for name, t in dests.items() if not torch.equal(t, before[name])]
        seen.append((outcome, wrong, receiver.kept.steady))
    return seen


@pytest.mark.parametrize(
    "backend,transport", [("cpu", "broadcast"), ("sim", "broadcast"), ("cpu", "ipc")], ids=["cpu-broadcast", "sim-broadcast", "cpu-ipc"]
)
def test_every_change_is_noticed_in_the_same_sync(backend, transport):
    sent, received = run_group(steady_worker, 2, args=(backend, transport), timeout=180)
    for step, ((change, dest_change, refused, same_epoch, kept), (outcome, same), (got, wrong, steady)) in enumerate(
        zip(STEPS, sent, received), start=1
    ):
        where = f"step {step} (sender: {change}, receiver: {dest_change})"
        if refused:
            assert outcome.startswith("refused") and "parameter 'c'" in got and got.startswith("refused"), (where, outcome, got)
            assert "(2, 5)" in got, (where, got)
        else:
            assert (outcome, got) == ("sent", "received"), where
        assert wrong == [], (where, wrong)
        if same_epoch is not None:
            assert same == same_epoch, f"{where}: the sender {'re-listed' if same_epoch else 'kept'} its tensors"
        if not refused:
            assert steady == kept, f"{where}: the receiver {'checked again' if kept else 'kept its check'}"


class GenerationSink:
    """A sink that says when its destinations change (SinkPolicy(destinations="generation"))
    and counts how often it is asked for one."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.policy = SinkPolicy(destinations="generation")
        self.asked = 0

    def destination(self, name: str) -> torch.Tensor | None:
        self.asked += 1
        return self.tensors.get(name)

    def apply(self, pairs) -> None:
        pass

    def abort(self) -> None:
        pass


class AskingSink(GenerationSink):
    """The default policy: asked for every destination of every sync."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.policy = SinkPolicy()


def sink_worker(rank, world):
    transport = BroadcastTransport(None, src=0)
    shapes = start_shapes()
    syncs = 7
    if rank == 0:
        sender = Sender(transport, SyncConfig(bucket_bytes=BUCKET), backend=CpuBackend())
        weights = {name: torch.zeros(shape) for name, shape in shapes.items()}
        for version in range(1, syncs + 1):
            for name, t in weights.items():
                t.copy_(values(name, shapes[name], torch.float32, version))
            sender.send(TensorSource(list(weights.items())), version=version)
        return None
    receiver = Receiver(transport, None, backend=CpuBackend(), timeout_s=60)
    dests = {name: torch.zeros(shape) for name, shape in shapes.items()}
    sink = GenerationSink(dests)
    asking = AskingSink(dests)
    seen = []
    for version in range(1, syncs + 1):
        if version == 4:  # a destination replaced, and said so
            dests["a"] = torch.zeros(shapes["a"])
            sink.policy = sink.policy.bumped()
        if version == 6:  # another sink object at the same generation: asked again
            sink = GenerationSink(dests)
        target = asking if version == 7 else sink
        before = target.asked
        receiver.receive(target)
        exact = all(torch.equal(t, values(name, shapes[name], torch.float32, version)) for name, t in dests.items())
        seen.append((target.asked - before, exact))
    return seen


def test_a_sink_is_asked_again_when_it_says_its_destinations_changed():
    _, seen = run_group(sink_worker, 2, timeout=120)
    n = len(start_shapes())
    # asked on the first sync, not while its generation holds, again when it rises, again
    # for another sink; a sink of the default policy on every sync
    assert seen == [(n, True), (0, True), (0, True), (n, True), (0, True), (n, True), (n, True)], seen


# M-to-N: two FSDP2 trainer ranks, each with a sync group of its own with one engine worker.
# (what changes before the sync, on both trainer ranks; whether the declaration is the last one's)
# (what changes before the sync, on both trainer ranks; whether the declaration is the last
# one's; plans built). FSDP2 sets its own parameter back on the module at its next reshard:
# the step after a replacement lists other tensors again (and, after Replicate(), the old layout).
SHARDED_STEPS = [
    ("first", None, 1),
    ("train", True, 0),  # an optimizer step: the same shards, new values
    ("train", True, 0),
    ("replace 1.weight", False, 0),  # another DTensor parameter, same shape and placement: the same plan
    ("train", False, 0),
    ("train", True, 0),
    ("replicate 3.weight", False, 1),  # the same rows, now Replicate(): another plan
    ("train", False, 1),
    ("train", True, 0),
]


def sharded_steady_worker(rank, world):
    import datetime

    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hal.sync.receive import ShardedReceiver
    from hal.sync.send import ShardedSender
    from tests.sync.send.test_gather import digest, engine_specs, sharded_model, train_step

    timeout = datetime.timedelta(seconds=60)
    trainer_group = dist.new_group([0, 1], timeout=timeout)
    sync_groups = [dist.new_group([0, 2], timeout=timeout), dist.new_group([1, 2], timeout=timeout)]
    config = SyncConfig(bucket_bytes=16 * 1024, segment_bytes=8192, timeout_s=60)
    results = []
    if rank in (0, 1):
        model = sharded_model(trainer_group)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        sender = ShardedSender(BroadcastTransport(sync_groups[rank], src=0), config=config, trainer_group=trainer_group)
        for version, (change, _, _) in enumerate(SHARDED_STEPS, start=1):
            if change == "train":
                train_step(model, optimizer, rank, version)
            elif change in ("replace 1.weight", "replicate 3.weight"):
                layer = model[1] if change == "replace 1.weight" else model[3]
                old = layer.weight
                full = old.full_tensor().detach() + version
                placement = Shard(0) if change == "replace 1.weight" else Replicate()
                layer.weight = torch.nn.Parameter(distribute_tensor(full, old.device_mesh, [placement]))
                optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
            last, builds = sender.known.declared, sender.exchange.builds
            metrics = sender.sync(model, version=version)
            full = {n: p.full_tensor() for n, p in model.named_parameters()}
            results.append((digest(full), sender.known.declared is last, sender.exchange.builds - builds, metrics.bytes))
        return results
    receiver = ShardedReceiver(
        [BroadcastTransport(g, src=0) for g in sync_groups], engine_specs(), timeout_s=60
    )
    weights = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in engine_specs()}
    for _ in SHARDED_STEPS:
        receiver.receive(copy_into(weights))
        results.append(digest(weights))
    return results


def test_m_to_n_declares_again_only_what_changed():
    first, second, received = run_group(sharded_steady_worker, 3, timeout=240)
    for step, ((change, kept, builds), a, b, got) in enumerate(zip(SHARDED_STEPS, first, second, received), start=1):
        where = f"step {step} ({change})"
        assert a[0] == b[0] == got, f"{where}: the engine does not hold the trainer's weights"
        if kept is not None:
            assert a[1] == b[1] == kept, f"{where}: the declaration was {'made again' if kept else 'kept'}"
        assert a[2] == b[2] == builds, f"{where}: {a[2]} plans built"
