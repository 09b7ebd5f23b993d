"""The sim backend is really asynchronous: a missing wait reads wrong data, visibly.

Where a test must observe the "before" state, the stream is held by a gate (a
threading.Event the stream waits on) so the outcome does not depend on scheduling;
the latency test relies on a latency far above the few microseconds between
launching a copy and reading its destination.
"""

from __future__ import annotations

import threading

import pytest
import torch

from hal.backends.cpu import CpuBackend
from hal.backends.sim import SimBackend


def hold(gate: threading.Event) -> None:
    # Device work that blocks its stream until the test opens the gate.
    if not gate.wait(timeout=30):
        raise TimeoutError("test gate never opened")


def fill(tensor: torch.Tensor, value: float) -> None:
    tensor.fill_(value)


def test_read_without_wait_sees_old_data_with_wait_sees_new():
    backend = SimBackend(latency=0.5)
    src = torch.full((4096,), 7.0)
    dst = torch.zeros(4096)
    stream = backend.new_stream()
    backend.copy_(dst, src, stream=stream)
    done = stream.record_event()
    # No wait: the copy is still sleeping out its latency on the stream's thread.
    assert dst.eq(0.0).all(), "the read raced ahead of the copy and must see the old bytes"
    assert not done.query()
    done.synchronize()
    assert dst.eq(7.0).all()
    assert done.query()


def test_latency_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("VERL_HAL_SIM_LATENCY", "0.25")
    assert SimBackend().latency == 0.25
    monkeypatch.setenv("VERL_HAL_SIM_LATENCY", "fast")
    with pytest.raises(ValueError, match="VERL_HAL_SIM_LATENCY='fast': expected a number of seconds"):
        SimBackend()
    monkeypatch.setenv("VERL_HAL_SIM_LATENCY", "-1")
    with pytest.raises(ValueError, match="must not be negative"):
        SimBackend()
    with pytest.raises(ValueError, match="latency must not be negative, got -0.5"):
        SimBackend(latency=-0.5)


def test_gated_copy_is_not_visible_until_its_event(sim_backend):
    gate = threading.Event()
    stream = sim_backend.new_stream()
    src, dst = torch.full((256,), 3.0), torch.zeros(256)
    sim_backend.launch(stream, hold, gate)
    sim_backend.copy_(dst, src, stream=stream)
    done = stream.record_event()
    assert not done.query()
    assert not stream.query()
    assert dst.eq(0.0).all()
    gate.set()
    done.synchronize()
    assert dst.eq(3.0).all()


def test_without_wait_event_streams_race():
    backend = SimBackend(latency=0.0)
    gate = threading.Event()
    producer, consumer = backend.new_stream(), backend.new_stream()
    x, y = torch.zeros(256), torch.full((256,), -1.0)
    backend.launch(producer, hold, gate)
    backend.launch(producer, fill, x, 1.0)
    producer.record_event()  # recorded, but nobody waits on it
    backend.copy_(y, x, stream=consumer)
    consumer.synchronize()  # finishes while the producer is still held
    assert y.eq(0.0).all(), "consumer copied before the producer wrote: the bug a missing wait causes"
    gate.set()
    backend.synchronize()


def test_wait_event_orders_two_streams():
    backend = SimBackend(latency=0.0)
    gate = threading.Event()
    producer, consumer = backend.new_stream(), backend.new_stream()
    x, y = torch.zeros(256), torch.full((256,), -1.0)
    backend.launch(producer, hold, gate)
    backend.launch(producer, fill, x, 1.0)
    ready = producer.record_event()
    consumer.wait_event(ready)
    backend.copy_(y, x, stream=consumer)
    assert not consumer.query(), "the consumer must be held by the producer's event"
    assert y.eq(-1.0).all()
    gate.set()
    consumer.synchronize()
    assert y.eq(1.0).all()


def test_wait_event_captures_the_recording_at_call_time():
    # As on CUDA: re-recording the event later does not change what an earlier wait waits for.
    backend = SimBackend(latency=0.0)
    first_gate, second_gate = threading.Event(), threading.Event()
    producer, consumer = backend.new_stream(), backend.new_stream()
    event = backend.new_event()
    backend.launch(producer, hold, first_gate)
    event.record(producer)
    consumer.wait_event(event)
    backend.launch(producer, hold, second_gate)
    event.record(producer)  # a second recording, behind the second gate
    first_gate.set()
    consumer.synchronize()  # waits for the first recording only
    assert not event.query()
    second_gate.set()
    event.synchronize()
    assert event.query()


def test_wait_stream_orders_two_streams():
    backend = SimBackend(latency=0.0)
    gate = threading.Event()
    producer, consumer = backend.new_stream(), backend.new_stream()
    x, y = torch.zeros(64), torch.zeros(64)
    backend.launch(producer, hold, gate)
    backend.launch(producer, fill, x, 9.0)
    consumer.wait_stream(producer)
    backend.copy_(y, x, stream=consumer)
    gate.set()
    consumer.synchronize()
    assert y.eq(9.0).all()


def test_backend_synchronize_waits_for_every_stream():
    backend = SimBackend(latency=0.05)
    tensors = [torch.zeros(16) for _ in range(3)]
    for value, tensor in enumerate(tensors, start=1):
        backend.launch(backend.new_stream(), fill, tensor, float(value))
    backend.synchronize()
    assert [t[0].item() for t in tensors] == [1.0, 2.0, 3.0]


def test_error_in_stream_work_surfaces_at_synchronize():
    backend = SimBackend(latency=0.0)
    stream = backend.new_stream()

    def broken() -> None:
        raise ValueError("bucket 3 checksum mismatch")

    backend.launch(stream, broken)  # returns at once, like a kernel launch
    after = torch.zeros(4)
    backend.launch(stream, fill, after, 1.0)  # the stream goes on after a failure
    with pytest.raises(RuntimeError, match="work on simulated stream failed: .*bucket 3 checksum mismatch") as info:
        backend.synchronize()
    assert isinstance(info.value.__cause__, ValueError)
    assert after.eq(1.0).all()
    backend.synchronize()  # reported once, then cleared


def test_error_surfaces_at_stream_synchronize():
    backend = SimBackend(latency=0.0)
    stream = backend.new_stream()
    backend.launch(stream, fill, torch.zeros(2), "not a number")
    with pytest.raises(RuntimeError, match="work on simulated stream failed"):
        stream.synchronize()


def test_launch_rejects_foreign_stream():
    backend = SimBackend(latency=0.0)
    with pytest.raises(TypeError, match="expected a stream from this backend, got ImmediateStream"):
        backend.launch(CpuBackend().new_stream(), fill, torch.zeros(1), 1.0)


def test_elapsed_time_covers_the_latency():
    backend = SimBackend(latency=0.05)
    stream = backend.new_stream()
    start, end = backend.new_event(timing=True), backend.new_event(timing=True)
    start.record(stream)
    backend.launch(stream, fill, torch.zeros(4), 1.0)
    end.record(stream)
    # A lower bound, not a speed: the launch sleeps its latency between the two recordings.
    assert start.elapsed_time(end) >= 50.0


def test_dropping_a_stream_keeps_its_work_and_its_error():
    # As on CUDA: the last handle to a stream going away cancels nothing and hides nothing.
    import gc

    backend = SimBackend(latency=0.02)
    tensor = torch.zeros(8)
    backend.launch(backend.new_stream(), fill, tensor, 4.0)
    backend.launch(backend.new_stream(), fill, torch.zeros(1), "not a number")
    gc.collect()
    with pytest.raises(RuntimeError, match="work on simulated stream failed"):
        backend.synchronize()
    assert tensor.eq(4.0).all()
