"""The receiver's assembly of whole tensors from several senders' shares (hal.sync.receive.assembly),
driven by threads in this process as a ShardedReceiver drives it."""

from __future__ import annotations

import threading

import pytest
import torch

import hal
from hal.sync import errors
from hal.sync.receive.assembly import Assembler, BufferPool, ShareInfo
from hal.sync.spec import TensorSpec
from hal.sync.receive.sharded import sending_order


def assembler_of(budget, timeout_s, sink=None):
    cpu = hal.get_backend("cpu")
    return Assembler(BufferPool(cpu, 1 << 20), [cpu.new_stream() for _ in range(3)], budget, timeout_s, sink or Recorder())


class Recorder:
    """A sink that records what it was handed, and whether every tensor was whole."""

    def __init__(self, fail_at: int | None = None):
        self.handed: dict[str, torch.Tensor] = {}
        self.fail_at = fail_at

    def destination(self, name):
        return None

    def apply(self, pairs):
        for name, tensor in pairs:
            if self.fail_at is not None and len(self.handed) == self.fail_at:
                raise RuntimeError("the engine refused")
            self.handed[name] = tensor.clone()

    def abort(self):
        pass


def layout(tensors: int, rows: int = 4, cols: int = 8):
    """`tensors` tensors of `rows` x `cols`, rows split between two senders."""
    specs = [TensorSpec(f"t{i}", (rows, cols), torch.float32) for i in range(tensors)]
    half = rows // 2
    shares = {}
    for i, spec in enumerate(specs):
        shares[f"t{i}@0"] = ShareInfo(spec, i, 0, half, 2)
        shares[f"t{i}@{half}"] = ShareInfo(spec, i, half, rows, 2)
    return specs, shares


def run(assembler, sink, deliveries):
    """One thread per sender delivering its list of (wire name, rows), the caller draining
    into `sink` (the assembler's)."""
    assert sink is assembler.sink
    failures = []

    def deliver(sender, items):
        try:
            for wire_name, rows in items:
                assembler.part_sink(sender).apply([(wire_name, rows)])
        except BaseException as exc:  # noqa: BLE001
            failures.append(exc)
        finally:
            assembler.sender_done(sender)

    assembler.expect(set(range(len(deliveries))))
    threads = [threading.Thread(target=deliver, args=(s, items)) for s, items in enumerate(deliveries)]
    for t in threads:
        t.start()
    assembler.drain()
    for t in threads:
        t.join(30)
    return failures


def full(i, rows=4, cols=8):
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + 1000 * i


@pytest.mark.parametrize("budget", [1, 64, 1 << 20])
def test_tensors_are_handed_whole_under_any_budget_however_far_one_sender_is_ahead(budget):
    specs, shares = layout(200)
    sink = Recorder()
    assembler = assembler_of(budget, timeout_s=20, sink=sink)
    assembler.shares = shares
    first = [(f"t{i}@0", full(i)[:2]) for i in range(200)]
    second = [(f"t{i}@2", full(i)[2:]) for i in range(200)]
    assert run(assembler, sink, [first, second]) == []
    assert sorted(sink.handed) == sorted(s.name for s in specs)
    assert all(torch.equal(sink.handed[f"t{i}"], full(i)) for i in range(200))
    assert assembler.leftover() == [] and assembler.error is None


def test_a_sender_that_stops_leaves_its_tensors_unhanded():
    _, shares = layout(10)
    sink = Recorder()
    assembler = assembler_of(1 << 20, timeout_s=20, sink=sink)
    assembler.shares = shares
    run(assembler, sink, [[(f"t{i}@0", full(i)[:2]) for i in range(10)], [(f"t{i}@2", full(i)[2:]) for i in range(4)]])
    assert sorted(sink.handed) == ["t0", "t1", "t2", "t3"]  # only the tensors with both shares
    assert assembler.leftover() == [f"t{i}" for i in range(4, 10)]


def test_a_sink_that_fails_stops_the_handing_over_and_the_senders_still_finish():
    _, shares = layout(20)
    sink = Recorder(fail_at=3)
    assembler = assembler_of(1, timeout_s=20, sink=sink)
    assembler.shares = shares
    failures = run(assembler, sink, [[(f"t{i}@0", full(i)[:2]) for i in range(20)], [(f"t{i}@2", full(i)[2:]) for i in range(20)]])
    assert failures == [] and len(sink.handed) == 3
    assert isinstance(assembler.error, RuntimeError) and assembler.discard


def test_a_thread_ahead_waits_at_most_the_timeout_for_one_that_never_comes():
    _, shares = layout(3)
    assembler = assembler_of(1, timeout_s=0.5)
    assembler.shares = shares
    assembler.expect({0, 1})
    assembler.part_sink(0).apply([("t0@0", full(0)[:2])])  # t0 open; sender 1 never delivers
    with pytest.raises(errors.PeerError, match=r"assembling 't1': waited 0.5 s for sender\(s\) \[1\]"):
        assembler.part_sink(0).apply([("t1@0", full(1)[:2])])


def test_the_sending_order_keeps_every_senders_order():
    # sender 0 skips "s" (a 0-d tensor another rank sends), sender 1 skips "a"
    assert sending_order([["a", "w", "x"], ["w", "s", "x"]]) == ["a", "w", "s", "x"]
    assert sending_order([["p0", "p1"], ["q0", "q1"]]) == ["p0", "q0", "p1", "q1"]
    order = sending_order([["a", "b"], ["b", "a"]])  # senders that disagree: still every name once
    assert sorted(order) == ["a", "b"]


def test_assembly_buffers_come_back_from_the_pool_within_its_limit():
    pool = BufferPool(hal.get_backend("cpu"), limit_bytes=256)
    first = pool.take(128)
    pool.give(first)
    assert pool.take(128).data_ptr() == first.data_ptr()  # the same memory again
    pool.give(first)
    pool.give(hal.get_backend("cpu").empty(128))
    pool.give(hal.get_backend("cpu").empty(128))  # over the limit: dropped
    assert pool.held_bytes == 256


@pytest.mark.parametrize("budget", [-1, 1.5, True, "256M"])
def test_a_bad_budget_is_refused_by_name(budget):
    from hal.sync.receive import ShardedReceiver

    with pytest.raises(ValueError, match="budget_bytes must be a non-negative int"):
        ShardedReceiver([object()], None, budget_bytes=budget)


def test_the_engines_sink_hears_of_a_failed_sync_once_whichever_part_concludes_first():
    """Each sender's receive concludes itself (`IncomingSync.settle`) and tells its part sink;
    the engine's sink is aborted once, not once per sender."""
    aborted = []
    sink = Recorder()
    sink.abort = lambda: aborted.append(True)
    assembler = assembler_of(1 << 20, timeout_s=20, sink=sink)
    for sender in (0, 1):
        assembler.part_sink(sender).abort()
    assert aborted == [True]
