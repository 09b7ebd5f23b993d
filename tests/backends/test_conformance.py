"""One contract, every backend: each test runs on cpu and sim here, on cuda / npu where present.

A backend passes when it answers every operation of `hal.Backend` the same way; the
tests use only the contract, never a backend's internals.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

import hal
from hal.backends.collectives import collective_traits
from hal.device import backend_class
from tests.backends._workers import open_shared
from tests.conftest import BACKEND_PARAMS
from tests.multiproc import run_group


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request, monkeypatch):
    # A little latency on sim, so that an ordering the contract promises but a backend
    # failed to keep has a chance to show here too (test_sim_async.py shows it for sure).
    monkeypatch.setenv("VERL_HAL_SIM_LATENCY", "0.005")
    instance = hal.get_backend(request.param)
    yield instance
    instance.synchronize()  # surfaces errors left on a stream by the test


def fill(tensor: torch.Tensor, value: float) -> None:
    tensor.fill_(value)


# ---- declared attributes and availability -------------------------------------------


def test_declared_attributes(backend):
    assert backend.name in hal.backend_names()
    assert torch.device(backend.device_type).type == backend.device_type
    assert backend.dist_backend in {"gloo", "nccl", "hccl"}
    assert backend.visible_devices_env is None or backend.visible_devices_env.endswith("VISIBLE_DEVICES")
    assert backend.ray_resource is None or backend.ray_resource.isupper()
    # Only an accelerator hides devices or asks Ray for one.
    accelerator = backend.device_type != "cpu"
    assert (backend.visible_devices_env is not None) == accelerator
    assert (backend.ray_resource is not None) == accelerator
    capabilities = ("supports_pinned_memory", "supports_ipc", "supports_async_streams")
    for capability in capabilities:
        assert isinstance(getattr(backend, capability), bool), capability
    # Collective traits belong to the library (hal.backends.collectives), not the backend.
    assert not hasattr(backend, "collectives_follow_streams")
    assert not hasattr(backend, "point_to_point_transfers")
    described = backend.describe()
    assert described["name"] == backend.name
    assert described["dist_backend"] == backend.dist_backend
    assert set(described) >= {"device_type", "visible_devices_env", "ray_resource", "supports_ipc", *capabilities}
    assert described["collective_traits"] == dataclasses.asdict(collective_traits(backend.dist_backend))
    assert json.loads(json.dumps(described)) == described
    assert backend.name in repr(backend)


def test_available(backend):
    cls = backend_class(backend.name)
    assert isinstance(backend, cls)
    assert cls.unavailable_reason() is None
    assert cls.is_available()


# ---- devices ----------------------------------------------------------------------


def test_devices(backend):
    count = backend.device_count()
    assert count >= 1
    current = backend.current_device()
    assert 0 <= current < count
    assert backend.device() == backend.device(current)
    for index in range(count):
        assert backend.device(index).type == backend.device_type


def test_set_device(backend):
    start = backend.current_device()
    try:
        for index in range(backend.device_count()):
            backend.set_device(index)
            assert backend.current_device() == index
    finally:
        backend.set_device(start)


@pytest.mark.parametrize("bad", [-1, "count", True, "0", 0.0])
def test_bad_device_index(backend, bad):
    index = backend.device_count() if bad == "count" else bad
    for call in (backend.device, backend.set_device):
        with pytest.raises(ValueError, match=rf"device index .* out of range for backend '{backend.name}'"):
            call(index)


# ---- streams ----------------------------------------------------------------------


def test_streams(backend):
    default = backend.current_stream()
    assert isinstance(default, hal.Stream)
    stream = backend.new_stream()
    assert isinstance(stream, hal.Stream)
    with backend.stream(stream) as inside:
        assert inside is stream
        assert backend.current_stream() == stream
        other = backend.new_stream()
        with backend.stream(other):
            assert backend.current_stream() == other
        assert backend.current_stream() == stream
    assert backend.current_stream() == default
    with backend.stream(None) as inside:
        assert inside is None
        assert backend.current_stream() == default


def test_launch_and_synchronize(backend):
    x = backend.empty(16, torch.float32)
    y = backend.empty(16, torch.float32)
    stream = backend.new_stream()
    backend.launch(stream, fill, x, 3.0)
    with backend.stream(stream):
        backend.launch(None, fill, y, 4.0)  # None: the current stream
    backend.synchronize()
    assert stream.query()
    assert x.cpu().eq(3.0).all()
    assert y.cpu().eq(4.0).all()


def test_stream_synchronize(backend):
    x = backend.empty(8, torch.int64)
    stream = backend.new_stream()
    backend.launch(stream, fill, x, 7)
    stream.synchronize()
    assert stream.query()
    assert x.cpu().eq(7).all()


def test_wait_event_orders_streams(backend):
    producer, consumer = backend.new_stream(), backend.new_stream()
    x = backend.empty(1024, torch.float32)
    y = backend.empty(1024, torch.float32)
    backend.launch(producer, fill, x, 5.0)
    ready = producer.record_event()
    consumer.wait_event(ready)
    backend.copy_(y, x, stream=consumer)
    consumer.synchronize()
    assert y.cpu().eq(5.0).all()


def test_event_from_record_event_waits_on_current_stream(backend):
    producer, consumer = backend.new_stream(), backend.new_stream()
    x = backend.empty(256, torch.float32)
    y = backend.empty(256, torch.float32)
    backend.launch(producer, fill, x, 8.0)
    ready = producer.record_event()
    with backend.stream(consumer):
        ready.wait()  # no stream given: the current one, the consumer
        backend.copy_(y, x)
    consumer.synchronize()
    assert y.cpu().eq(8.0).all()


def test_wait_stream_orders_streams(backend):
    producer, consumer = backend.new_stream(), backend.new_stream()
    x = backend.empty(1024, torch.float32)
    y = backend.empty(1024, torch.float32)
    backend.launch(producer, fill, x, 6.0)
    consumer.wait_stream(producer)
    backend.copy_(y, x, stream=consumer)
    consumer.synchronize()
    assert y.cpu().eq(6.0).all()


# ---- events -----------------------------------------------------------------------


@pytest.mark.parametrize("timing", [False, True])
def test_event_record_wait_query_synchronize(backend, timing):
    event = backend.new_event(timing=timing)
    assert isinstance(event, hal.Event)
    assert event.query()  # never recorded: complete, as on CUDA
    producer, consumer = backend.new_stream(), backend.new_stream()
    x = backend.empty(64, torch.float32)
    y = backend.empty(64, torch.float32)
    backend.launch(producer, fill, x, 2.0)
    event.record(producer)
    event.wait(consumer)
    backend.copy_(y, x, stream=consumer)
    event.synchronize()
    assert event.query()
    consumer.synchronize()
    assert y.cpu().eq(2.0).all()


def test_record_on_current_stream(backend):
    stream = backend.new_stream()
    event = backend.new_event()
    x = backend.empty(4, torch.float32)
    with backend.stream(stream):
        backend.launch(None, fill, x, 1.0)
        event.record()  # no stream: the current one
    event.synchronize()
    assert x.cpu().eq(1.0).all()


def test_elapsed_time(backend):
    start, end = backend.new_event(timing=True), backend.new_event(timing=True)
    stream = backend.new_stream()
    x = backend.empty(1 << 16, torch.float32)
    start.record(stream)
    backend.launch(stream, fill, x, 1.0)
    end.record(stream)
    end.synchronize()
    elapsed = start.elapsed_time(end)
    assert isinstance(elapsed, float)
    assert elapsed >= 0.0


def test_elapsed_time_needs_timing_events(backend):
    start, end = backend.new_event(timing=False), backend.new_event(timing=False)
    stream = backend.new_stream()
    start.record(stream)
    end.record(stream)
    end.synchronize()
    # torch.cuda.Event raises ValueError from torch 2.11 on (measured on an H100, torch
    # 2.11.0+cu130), RuntimeError from the runtime before; torch_npu's events the latter.
    with pytest.raises((ValueError, RuntimeError), match="(?i)timing"):
        start.elapsed_time(end)


# ---- copies -----------------------------------------------------------------------


def test_copy_casts_dtype(backend):
    src = torch.linspace(-3, 3, 32, dtype=torch.float32).to(backend.device())
    dst = backend.empty(32, torch.bfloat16)
    stream = backend.new_stream()
    backend.copy_(dst, src, stream=stream)
    stream.synchronize()
    assert dst.dtype == torch.bfloat16
    assert torch.equal(dst.cpu(), src.cpu().to(torch.bfloat16))


def test_copy_refuses_another_shape_with_the_same_element_count(backend):
    # A transposed weight, (896, 4864) into (4864, 896) in a real model, scaled down.
    src = torch.arange(6, dtype=torch.int32).reshape(2, 3).to(backend.device())
    dst = backend.empty((3, 2), torch.int32)
    dst.fill_(-1)
    with pytest.raises(ValueError, match=r"copy_: destination has shape \(3, 2\), source \(2, 3\) \(same 6 elements"):
        backend.copy_(dst, src)
    flat = backend.empty(6, torch.int32)
    with pytest.raises(ValueError, match=r"destination has shape \(6,\), source \(2, 3\)"):
        backend.copy_(flat, src)
    backend.synchronize()
    assert dst.cpu().eq(-1).all()  # nothing was launched
    backend.copy_(flat, src.reshape(-1))  # an explicit reshape is the way to copy flat
    backend.synchronize()
    assert flat.cpu().tolist() == list(range(6))


def test_copy_many_copies_every_pair_and_refuses_another_shape_before_launching(backend):
    srcs = [torch.arange(n, dtype=torch.float32).to(backend.device()) for n in (1, 5, 64)]
    dsts = [backend.empty(n, torch.bfloat16) for n in (1, 5, 64)]
    stream = backend.new_stream()
    backend.copy_many_(dsts, srcs, stream=stream)  # casting on the way, like copy_
    stream.synchronize()
    assert all(torch.equal(d.cpu(), s.cpu().to(torch.bfloat16)) for d, s in zip(dsts, srcs))
    # a transposed weight in the middle of the list, and a source torch would broadcast
    for bad, message in (
        (torch.zeros((3, 2)), r"copy_many_: pair 1: destination has shape \(2, 3\), source \(3, 2\)"),
        (torch.zeros((1, 3)), r"copy_many_: pair 1: destination has shape \(2, 3\), source \(1, 3\)"),
    ):
        targets = [backend.empty(4, torch.float32), backend.empty((2, 3), torch.float32)]
        for t in targets:
            t.fill_(-1)
        with pytest.raises(ValueError, match=message):
            backend.copy_many_(targets, [torch.ones(4).to(backend.device()), bad.to(backend.device())])
        backend.synchronize()
        assert all(t.cpu().eq(-1).all() for t in targets)  # nothing was launched, not even pair 0
    with pytest.raises(ValueError, match="2 destinations for 1 sources"):
        backend.copy_many_(targets, targets[:1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.complex64])
def test_copy_many_and_prepared_copies_move_bits_not_values(backend, dtype, monkeypatch):
    """Random bytes hold NaNs of every sign and payload, and negative zeros: a same-dtype
    copy must land them bit for bit (torch's multi-tensor copy on a GPU does not: it
    converts through float, seen on an H200). Contiguous, strided and odd sizes. Prepared
    copies run twice, the second time over new bytes in the same memory (a steady sync);
    also recorded as a graph where the backend can (VERL_HAL_COPY_GRAPHS, experimental)."""
    from hal.backends._torch_device import COPY_GRAPHS_ENV

    gen = torch.Generator().manual_seed(7)
    sizes = (1, 7, 4096, 3 * 64)

    def random_bytes() -> list[torch.Tensor]:
        raw = [torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen) for n in sizes]
        out = [r.view(dtype).to(backend.device()) for r in raw]
        out[-1] = out[-1].view(3, 64).t()  # a transposed view
        return out

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().cpu().view(torch.uint8)

    for way in ("many", "prepared", "graph"):
        monkeypatch.setenv(COPY_GRAPHS_ENV, "1" if way == "graph" else "0")
        srcs = random_bytes()
        dsts = [backend.empty(tuple(s.shape), dtype) for s in srcs]
        dsts[-1] = backend.empty((3, 64), dtype).t()
        stream = backend.new_stream()
        if way == "many":
            backend.copy_many_(dsts, srcs, stream=stream)
            rounds = 1
        else:
            prepared = backend.prepare_copies(dsts, srcs)
            backend.copy_prepared_(prepared, stream=stream)
            rounds = 2
        for round_ in range(rounds):
            stream.synchronize()
            for d, s in zip(dsts, srcs):
                assert torch.equal(bits(d), bits(s)), (way, round_, tuple(s.shape))
            if round_ + 1 < rounds:
                for s, new in zip(srcs, random_bytes()):
                    s.copy_(new)  # new bytes, same memory (copy_ moves bits)
                backend.synchronize()
                backend.copy_prepared_(prepared, stream=stream)


def test_copy_element_count_mismatch(backend):
    dst = backend.empty((2, 3), torch.float32)
    src = backend.empty((7,), torch.float32)
    with pytest.raises(ValueError, match=r"destination has 6 elements, source 7 \(shapes \(2, 3\) and \(7,\)\)"):
        backend.copy_(dst, src)


# ---- memory -----------------------------------------------------------------------


@pytest.mark.parametrize("shape", [16, (4, 8)])
def test_empty_pinned(backend, shape):
    tensor = backend.empty_pinned(shape, torch.float16)
    assert tensor.device.type == "cpu"
    assert tensor.dtype == torch.float16
    assert tuple(tensor.shape) == ((shape,) if isinstance(shape, int) else shape)
    assert tensor.is_pinned() == backend.supports_pinned_memory


def test_empty_pinned_negative_dimension(backend):
    with pytest.raises(ValueError, match=r"negative dimension in shape \(4, -1\)"):
        backend.empty_pinned((4, -1))


def test_empty(backend):
    tensor = backend.empty((3, 5), torch.bfloat16)
    assert tensor.device == backend.device()
    assert tuple(tensor.shape) == (3, 5)
    assert tensor.dtype == torch.bfloat16


def test_memory_info_and_empty_cache(backend):
    info = backend.memory_info()
    assert isinstance(info, hal.MemoryInfo)
    assert 0 <= info.free <= info.total
    assert info.total > 0
    backend.empty_cache()  # must not raise, whatever the runtime caches


# ---- same-node sharing ------------------------------------------------------------


@pytest.mark.multiprocess
def test_ipc_across_processes(backend):
    if not backend.supports_ipc:
        with pytest.raises(NotImplementedError, match="supports_ipc"):
            backend.empty_shared(64)
        return
    shared = backend.empty_shared(64)
    assert shared.dtype == torch.uint8 and shared.numel() == 64
    view = shared[16:48].view(torch.float32)  # a view at an offset, not the whole buffer
    view.copy_(torch.arange(8, dtype=torch.float32).to(backend.device()))
    backend.synchronize()
    handle = backend.export_ipc(view)
    wire = json.dumps(handle)  # handles travel as JSON text: the receiver never unpickles one
    try:
        [seen] = run_group(open_shared, 1, args=(backend.name, wire, -1.0), init_process_group=False, timeout=120)
        assert seen == [float(i) for i in range(8)]
        assert view.cpu().eq(-1.0).all()  # the child's writes landed in our memory
    finally:
        backend.release_shared(shared)


def test_empty_shared_validates_size(backend):
    if not backend.supports_ipc:
        pytest.skip(f"backend {backend.name!r} has no IPC (supports_ipc is False)")
    with pytest.raises(ValueError, match="nbytes must be positive, got 0"):
        backend.empty_shared(0)


def test_export_ipc_rejects_unshared_tensor(backend):
    if not backend.supports_ipc:
        pytest.skip(f"backend {backend.name!r} has no IPC (supports_ipc is False)")
    # A plain host tensor is neither in a shared-memory file nor on the device.
    with pytest.raises(ValueError, match="export_ipc"):
        backend.export_ipc(torch.zeros(4))


# ---- runtime questions ------------------------------------------------------------


def test_set_allocator_settings_answers_applied_or_why_not(backend):
    # False is every allocator's default, so asking cannot change later tests on hardware.
    answer = backend.set_allocator_settings(expandable_segments=False)
    assert answer is None or (isinstance(answer, str) and answer)
    if backend.device_type == "cpu":
        assert "no caching allocator" in answer
    with pytest.raises(ValueError, match="expandable_segments must be a bool, got str 'yes'"):
        backend.set_allocator_settings(expandable_segments="yes")


def test_device_capability(backend):
    capability = backend.device_capability()
    assert capability == backend.device_capability(backend.current_device())
    if backend.device_type == "cuda":
        major, minor = capability
        assert isinstance(major, int) and isinstance(minor, int) and major >= 1
    else:
        assert capability is None
    with pytest.raises(ValueError, match="out of range"):
        backend.device_capability(backend.device_count())


def test_runtime_versions(backend):
    versions = backend.runtime_versions()
    assert all(isinstance(k, str) and isinstance(v, str) and v for k, v in versions.items())
    if backend.device_type == "cpu":
        assert versions == {}
    if backend.device_type == "npu":
        assert set(versions) == {"driver", "cann"}


def test_supports_device_memory_ipc(backend):
    answer = backend.supports_device_memory_ipc()
    assert isinstance(answer, bool)
    if backend.device_type == "cpu" or not backend.supports_ipc:
        assert answer is False  # host shared-memory files are not device memory IPC


# ---- misc -------------------------------------------------------------------------


def test_manual_seed_reproducible(backend):
    device = backend.device()
    backend.manual_seed(1234)
    first = torch.rand(16, device=device)
    backend.manual_seed(1234)
    again = torch.rand(16, device=device)
    backend.manual_seed(4321)
    other = torch.rand(16, device=device)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_dist_backend_string(backend):
    plain = backend.dist_backend_string(with_cpu=False)
    mixed = backend.dist_backend_string()
    assert plain == backend.dist_backend
    if backend.device_type == "cpu":
        assert mixed == "gloo"
    else:
        assert mixed == f"{backend.device_type}:{backend.dist_backend},cpu:gloo"
        pairs = dict(item.split(":") for item in mixed.split(","))
        assert pairs == {backend.device_type: backend.dist_backend, "cpu": "gloo"}


def test_dist_backend_string_initialises_a_group(backend):
    assert not dist.is_initialized(), "a default process group is already initialised (an earlier test left it)"
    dist.init_process_group(backend.dist_backend_string(), store=dist.HashStore(), rank=0, world_size=1)
    try:
        tensor = torch.ones(4, device=backend.device())
        dist.all_reduce(tensor)
        host = torch.ones(2)  # the cpu:gloo half of a mixed group
        dist.all_reduce(host)
        assert tensor.cpu().eq(1).all() and host.eq(1).all()
    finally:
        dist.destroy_process_group()
