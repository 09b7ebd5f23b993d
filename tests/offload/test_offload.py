"""hal.offload on the cpu and sim backends: bit-exact round trips, reused host buffers,
durations only for work done, and errors that name the tensor."""

from __future__ import annotations

import copy

import pytest
import torch

import hal
import hal.offload as off
from hal.backends.cpu import CpuBackend
from hal.backends.sim import SimBackend, SimEvent

pytestmark = pytest.mark.cpu


def _make_backend(name: str):
    # A little latency on sim makes a copy that is read before its event completes visibly wrong.
    return CpuBackend() if name == "cpu" else SimBackend(latency=0.0005)


@pytest.fixture(params=["cpu", "sim"])
def backend(request):
    b = _make_backend(request.param)
    with hal.use(b):
        yield b
    b.synchronize()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8).clone()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    m.register_parameter("extra_bf16", torch.nn.Parameter(torch.randn(5, 7).to(torch.bfloat16)))
    return m


def _train_step(m: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 16, generator=g)
    opt.zero_grad(set_to_none=False)
    loss = m(x).square().mean() + m.extra_bf16.float().square().sum()
    loss.backward()
    opt.step()


def _snapshot(m: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    snap = {}
    for name, p in m.named_parameters():
        snap[name] = _bits(p.data)
        if p.grad is not None:
            snap[name + ".grad"] = _bits(p.grad)
    if opt is not None:
        names = {id(p): n for n, p in m.named_parameters()}
        for p, st in opt.state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    snap[f"{names[id(p)]}.{k}"] = _bits(v)
    return snap


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} changed"


def _count_pinned(monkeypatch, backend) -> list[int]:
    calls: list[int] = []
    original = backend.empty_pinned

    def counting(shape, dtype=torch.uint8):
        calls.append(1)
        return original(shape, dtype)

    monkeypatch.setattr(backend, "empty_pinned", counting)
    return calls


def test_round_trip_is_bit_exact_and_reuses_host_buffers(backend, monkeypatch):
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    _train_step(m, opt, 1)
    before = _snapshot(m, opt)
    calls = _count_pinned(monkeypatch, backend)

    first = off.offload(m, opt)
    assert off.is_offloaded(m) and off.is_offloaded(opt)
    n_tensors = len(before)
    # Adam's `step` is a host tensor on every backend here (device is host memory), so it moves too.
    assert first.tensors == n_tensors
    assert first.bytes == sum(t.numel() for t in before.values())
    assert first.host_bytes_allocated == first.bytes
    assert first.seconds is not None and first.seconds >= 0
    assert len(calls) == n_tensors
    # Offloaded values are the originals, bit for bit, in the host buffers.
    _assert_same(_snapshot(m, opt), before)
    host_ptrs = {n: p.data.data_ptr() for n, p in m.named_parameters()}

    back = off.onload(m, opt)
    assert back.direction == "onload" and back.tensors == n_tensors and back.host_bytes_allocated == 0
    assert not off.is_offloaded(m)
    _assert_same(_snapshot(m, opt), before)
    # Onloaded tensors are fresh device tensors, not the host buffers.
    assert all(p.data.data_ptr() != host_ptrs[n] for n, p in m.named_parameters())

    calls.clear()
    second = off.offload(m, opt)
    assert calls == [], "second offload allocated host memory"
    assert second.host_bytes_allocated == 0 and second.tensors == n_tensors
    assert {n: p.data.data_ptr() for n, p in m.named_parameters()} == host_ptrs
    _assert_same(_snapshot(m, opt), before)
    off.onload(m, opt)
    _assert_same(_snapshot(m, opt), before)


def test_training_continues_identically_after_round_trips(backend):
    ref = _model()
    m = copy.deepcopy(ref)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for step in range(3):
        _train_step(ref, ref_opt, step)
        _train_step(m, opt, step)
        off.offload(m, opt)
        off.onload(m, opt)
    _assert_same(_snapshot(m, opt), _snapshot(ref, ref_opt))


def test_explicit_backend_argument_without_hal_use():
    b = SimBackend(latency=0.0005)
    m = _model()
    before = _snapshot(m)
    report = off.offload(m, backend=b)
    assert report.tensors == len(before)
    _assert_same(_snapshot(m), before)
    off.onload(m, backend=b)
    _assert_same(_snapshot(m), before)


def test_sim_offload_is_wrong_without_the_event_wait(monkeypatch):
    """The sim test bed catches a missing wait: with event waits disabled the host buffers are read too early.

    Deterministic: the copy stream waits on the current stream, which a gate holds until the
    test has read the host buffers, so the copies cannot have run yet (no race with a sleep).
    Host buffers start as a sentinel, so the stale read cannot equal the parameters by chance.
    """
    import threading

    b = SimBackend(latency=0.0)
    m = torch.nn.Linear(64, 64)
    for p in m.parameters():
        p.data.fill_(3.0)
    before = _snapshot(m)
    gate = threading.Event()

    def hold() -> None:
        # Device work that blocks the stream until the test opens the gate.
        if not gate.wait(timeout=30):
            raise TimeoutError("test gate never opened")

    try:
        b.launch(b.current_stream(), hold)  # offload's copy stream waits for this stream first
        monkeypatch.setattr(b, "empty_pinned", lambda shape, dtype=torch.uint8: torch.full(shape, -7, dtype=dtype))
        monkeypatch.setattr(SimEvent, "synchronize", lambda self: None)
        off.offload(m, backend=b)
        seen = _snapshot(m)
        monkeypatch.undo()
    finally:
        gate.set()
    sentinel = {name: _bits(torch.full(p.shape, -7, dtype=p.dtype)) for name, p in m.named_parameters()}
    _assert_same(seen, sentinel)  # every host buffer was read before its copy ran
    b.synchronize()
    _assert_same(_snapshot(m), before)  # once the gate opens and the stream drains, the copies are there
    off.onload(m, backend=b)
    _assert_same(_snapshot(m), before)


def test_onloaded_does_nothing_and_times_nothing_when_not_offloaded(backend, monkeypatch):
    m = _model()
    ptrs = {n: p.data.data_ptr() for n, p in m.named_parameters()}
    calls = _count_pinned(monkeypatch, backend)
    with off.onloaded(m) as report:
        assert report.onload.tensors == 0 and report.onload.bytes == 0
        assert report.onload.seconds is None
        assert report.offload is None
    assert report.offload is not None
    assert report.offload.tensors == 0 and report.offload.seconds is None
    assert calls == []
    assert not off.is_offloaded(m)
    assert {n: p.data.data_ptr() for n, p in m.named_parameters()} == ptrs
    assert report.as_dict()["onload_s"] is None and report.as_dict()["offload_s"] is None


def test_onloaded_onloads_for_the_block_and_offloads_after(backend, monkeypatch):
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    _train_step(m, opt, 7)
    before = _snapshot(m, opt)
    off.offload(m, opt)
    calls = _count_pinned(monkeypatch, backend)
    with off.onloaded(m, opt) as report:
        assert not off.is_offloaded(m) and not off.is_offloaded(opt)
        assert report.onload.tensors == len(before) and report.onload.seconds is not None
        _assert_same(_snapshot(m, opt), before)
    assert off.is_offloaded(m) and off.is_offloaded(opt)
    assert report.offload.tensors == len(before) and report.offload.seconds is not None
    assert report.offload.host_bytes_allocated == 0 and calls == []
    _assert_same(_snapshot(m, opt), before)


def test_onloaded_offloads_again_when_the_block_raises(backend):
    m = _model()
    off.offload(m)
    with pytest.raises(KeyError):
        with off.onloaded(m):
            raise KeyError("boom")
    assert off.is_offloaded(m)
    off.onload(m)


def test_onloaded_with_only_the_module_offloaded_leaves_the_optimizer(backend):
    m = _model()
    opt = torch.optim.Adam(m.parameters())
    _train_step(m, opt, 3)
    state_ptrs = {k: v.data_ptr() for st in opt.state.values() for k, v in st.items()}
    off.offload(m)
    with off.onloaded(m, opt) as report:
        assert report.onload.tensors == len(list(m.parameters())) * 2  # data + grad
    assert off.is_offloaded(m) and not off.is_offloaded(opt)
    assert {k: v.data_ptr() for st in opt.state.values() for k, v in st.items()} == state_ptrs
    off.onload(m)


def test_onload_of_a_module_never_offloaded_names_a_parameter(backend):
    m = _model()
    with pytest.raises(off.OffloadError, match=r"never offloaded.*parameter 'extra_bf16'"):
        off.onload(m)


def test_onload_of_an_optimizer_never_offloaded(backend):
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    off.offload(m)
    with pytest.raises(off.OffloadError, match="optimizer SGD was never offloaded"):
        off.onload(m, opt)
    assert off.is_offloaded(m), "a failed onload must not move anything"
    off.onload(m)


def test_offload_twice_is_an_error(backend):
    m = _model()
    off.offload(m)
    with pytest.raises(off.OffloadError, match=r"already offloaded.*parameter 'extra_bf16'"):
        off.offload(m)
    off.onload(m)


def test_parameter_on_the_wrong_device_is_named_and_nothing_moves(backend):
    m = _model()
    m.register_parameter("ghost", torch.nn.Parameter(torch.empty(3, device="meta")))
    ptrs = {n: p.data.data_ptr() for n, p in m.named_parameters() if n != "ghost"}
    with pytest.raises(off.OffloadError, match=r"parameter 'ghost' is on meta, expected cpu"):
        off.offload(m)
    assert not off.is_offloaded(m)
    assert {n: p.data.data_ptr() for n, p in m.named_parameters() if n != "ghost"} == ptrs


def test_parameter_replaced_while_offloaded_is_named(backend):
    m = _model()
    off.offload(m)
    m[0].bias.data = torch.zeros(32)
    with pytest.raises(off.OffloadError, match=r"parameter '0.bias' was replaced while offloaded"):
        off.onload(m)


def test_parameter_added_while_offloaded_is_named(backend):
    m = _model()
    off.offload(m)
    m.register_parameter("late", torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(off.OffloadError, match=r"parameter 'late' was added"):
        off.onload(m)


def test_bad_arguments():
    with pytest.raises(ValueError, match="pass a module, an optimizer, or both"):
        off.offload(None)
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        off.offload(torch.zeros(3))  # type: ignore[arg-type]


def test_release_host_buffers(backend, monkeypatch):
    m = _model()
    first = off.offload(m)
    with pytest.raises(off.OffloadError, match="hold the only copy"):
        off.release_host_buffers(m)
    off.onload(m)
    assert off.release_host_buffers(m) == first.host_bytes_allocated
    calls = _count_pinned(monkeypatch, backend)
    again = off.offload(m)
    assert again.host_bytes_allocated == first.host_bytes_allocated and len(calls) == again.tensors
    off.onload(m)


def test_offload_only_the_optimizer(backend):
    m = _model()
    opt = torch.optim.Adam(m.parameters())
    _train_step(m, opt, 5)
    before = _snapshot(m, opt)
    report = off.offload(None, opt)
    assert report.tensors == 3 * len(list(m.parameters()))  # step, exp_avg, exp_avg_sq
    assert not off.is_offloaded(m) and off.is_offloaded(opt)
    off.onload(None, opt)
    _assert_same(_snapshot(m, opt), before)


# ---- an offloaded trainer syncing into another process -----------------------------------------


def offloaded_sync_worker(rank: int, world_size: int):
    import io

    from hal.sync import BroadcastTransport, ModuleSource, Receiver, Sender, SyncConfig
    from hal.sync.receive import allocate
    from hal.sync.sink import copy_into

    config = SyncConfig(bucket_bytes=8192, timeout_s=30.0)
    transport = BroadcastTransport(src=0)
    model = _model()  # same seed on both ranks: only the trainer's copy is used for values
    specs = ModuleSource(model).metadata()
    if rank == 0:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        sender = Sender(transport, config)
        out = []
        for step in range(2):
            _train_step(model, opt, step)
            off.offload(model, opt)
            with off.onloaded(model) as report:  # only the module: the optimizer stays in host memory
                metrics = sender.send(ModuleSource(model), version=step)
            assert off.is_offloaded(model) and off.is_offloaded(opt)
            buf = io.BytesIO()
            torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, buf)
            out.append(dict(report=report.as_dict(), bytes=metrics.bytes, expected=buf.getvalue()))
            off.onload(model, opt)
        return out
    weights = allocate(specs, fill=float("nan"))
    receiver = Receiver(transport, specs, timeout_s=30.0)
    out = []
    for _ in range(2):
        receiver.receive(copy_into(weights))
        buf = io.BytesIO()
        torch.save({n: t.clone() for n, t in weights.items()}, buf)
        out.append(buf.getvalue())
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend_name", ["cpu", "sim"])
def test_offloaded_trainer_syncs_through_onloaded(backend_name):
    import io

    from tests.multiproc import run_group

    env = {"VERL_DEVICE": backend_name, "VERL_HAL_SIM_LATENCY": "0.0002"}
    trainer, engine = run_group(offloaded_sync_worker, 2, timeout=120, collective_timeout=60, env=env)
    n_params = len(list(_model().parameters()))
    for step, (sent, got) in enumerate(zip(trainer, engine)):
        report = sent["report"]
        # parameters and their gradients came back for the sync and went away after it
        assert report["onload_tensors"] == report["offload_tensors"] == 2 * n_params
        assert report["onload_s"] is not None and report["offload_s"] is not None
        assert report["offload_host_bytes_allocated"] == 0
        expected = torch.load(io.BytesIO(sent["expected"]), weights_only=True)
        state = torch.load(io.BytesIO(got), weights_only=True)
        assert sent["bytes"] == sum(t.numel() * t.element_size() for t in expected.values())
        for name, t in expected.items():
            assert torch.equal(_bits(state[name]), _bits(t)), f"step {step}: {name}"
