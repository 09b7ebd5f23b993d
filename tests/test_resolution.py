"""VERL_DEVICE resolution: names, auto, registered backends, laziness, overrides, messages."""

from __future__ import annotations

import textwrap
from importlib.metadata import EntryPoint

import pytest

import hal
import hal.device
from hal import BackendUnavailableError
from hal.backends.cpu import CpuBackend
from hal.backends.cuda import CudaBackend
from hal.backends.npu import NpuBackend
from hal.backends.sim import SimBackend
from tests.conftest import run_python

NO_ACCELERATOR = CudaBackend.unavailable_reason() is not None and NpuBackend.unavailable_reason() is not None
needs_no_accelerator = pytest.mark.skipif(not NO_ACCELERATOR, reason="an accelerator is usable here; auto would pick it")


def _unusable(reason):
    return classmethod(lambda cls: reason)


@pytest.fixture
def no_accelerators(monkeypatch):
    """Make cuda and npu unusable whatever the machine has."""
    monkeypatch.setattr(CudaBackend, "unavailable_reason", _unusable("no GPU (test)"))
    monkeypatch.setattr(NpuBackend, "unavailable_reason", _unusable("no NPU (test)"))


# ---- names ------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [("cpu", CpuBackend), ("sim", SimBackend), (" SIM ", SimBackend), ("Cpu", CpuBackend)])
def test_explicit_names(hal_reset, monkeypatch, value, expected):
    monkeypatch.setenv("VERL_DEVICE", value)
    backend = hal.current()
    assert type(backend) is expected
    assert hal.resolution().reason == f"VERL_DEVICE={value.strip().lower()}"
    assert hal.resolution().requested == value.strip().lower()


@pytest.mark.parametrize("value", [None, "", "auto", "AUTO"])
def test_auto_without_accelerator_is_cpu(hal_reset, monkeypatch, no_accelerators, value):
    if value is not None:
        monkeypatch.setenv("VERL_DEVICE", value)
    res = hal.resolution()
    assert res.backend.name == "cpu"
    assert res.requested == "auto"
    assert res.reason == "auto: no accelerator usable (cuda: no GPU (test); npu: no NPU (test))"


@needs_no_accelerator
def test_auto_on_this_machine_says_why_each_accelerator_is_out(hal_reset):
    res = hal.resolution()
    assert res.backend.name == "cpu"
    assert "cuda: torch" in res.reason
    assert "npu: cannot import torch_npu" in res.reason


def test_auto_takes_the_one_usable_accelerator(hal_reset, monkeypatch, no_accelerators):
    monkeypatch.setattr(NpuBackend, "unavailable_reason", _unusable(None))
    res = hal.resolve("auto")
    assert type(res.backend) is NpuBackend
    assert res.reason == "auto: npu is the only usable accelerator"


def test_auto_never_picks_sim(hal_reset, no_accelerators):
    assert hal.resolve("auto").backend.name == "cpu"


def test_auto_with_two_accelerators_raises(hal_reset, monkeypatch):
    monkeypatch.setattr(CudaBackend, "unavailable_reason", _unusable(None))
    monkeypatch.setattr(NpuBackend, "unavailable_reason", _unusable(None))
    with pytest.raises(BackendUnavailableError) as info:
        hal.current()
    assert str(info.value) == (
        "VERL_DEVICE=auto found several usable accelerators (cuda, npu); set VERL_DEVICE to one of them"
    )
    monkeypatch.setenv("VERL_DEVICE", "cuda")
    assert type(hal.current()) is CudaBackend  # the explicit choice resolves it


@pytest.mark.parametrize("value", ["bogus", "gpu", "cuda:0"])
def test_unknown_name_lists_valid_ones(hal_reset, monkeypatch, value):
    monkeypatch.setenv("VERL_DEVICE", value)
    with pytest.raises(ValueError) as info:
        hal.current()
    assert str(info.value) == f"unknown backend {value!r} (VERL_DEVICE); valid names: auto, cpu, cuda, npu, sim"


@pytest.mark.skipif(CudaBackend.unavailable_reason() is None, reason="CUDA is usable here")
def test_unusable_cuda_says_why(hal_reset, monkeypatch):
    monkeypatch.setenv("VERL_DEVICE", "cuda")
    with pytest.raises(BackendUnavailableError, match=r"^backend 'cuda' is not usable: ") as info:
        hal.current()
    assert str(info.value).endswith(CudaBackend.unavailable_reason())


@pytest.mark.skipif(NpuBackend.unavailable_reason() is None, reason="an NPU is usable here")
def test_unusable_npu_carries_the_import_error(hal_reset, monkeypatch):
    monkeypatch.setenv("VERL_DEVICE", "npu")
    with pytest.raises(BackendUnavailableError) as info:
        hal.current()
    assert str(info.value) == "backend 'npu' is not usable: cannot import torch_npu: No module named 'torch_npu'"


def test_unusable_error_is_a_runtime_error():
    # Callers that catch RuntimeError (and `hal info`) see it.
    assert issubclass(BackendUnavailableError, RuntimeError)


# ---- entry points -----------------------------------------------------------------

FANCY_MODULE = '''
from hal.backends.cpu import CpuBackend


class FancyBackend(CpuBackend):
    name = "fancy"


class BrokenBackend(CpuBackend):
    name = "broken"

    @classmethod
    def unavailable_reason(cls):
        return "the fancy card is not plugged in"


class NotABackend:
    pass
'''


@pytest.fixture
def entry_points(monkeypatch, tmp_path, hal_reset):
    """Install `eps(...)`: the entry points hal sees in group hal.backends."""
    (tmp_path / "fancy_hal_backend.py").write_text(textwrap.dedent(FANCY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(*pairs: tuple[str, str]) -> None:
        eps = [EntryPoint(name=name, value=value, group=hal.device.ENTRY_POINT_GROUP) for name, value in pairs]

        def fake_entry_points(*, group):
            assert group == "hal.backends"
            return eps

        monkeypatch.setattr(hal.device, "entry_points", fake_entry_points)

    return install


def test_registered_backend_resolves(entry_points, monkeypatch):
    entry_points(("fancy", "fancy_hal_backend:FancyBackend"))
    assert hal.backend_names() == ["cpu", "cuda", "fancy", "npu", "sim"]
    monkeypatch.setenv("VERL_DEVICE", "fancy")
    backend = hal.current()
    assert type(backend).__name__ == "FancyBackend"
    assert hal.resolution().reason == "VERL_DEVICE=fancy"


def test_unknown_name_lists_registered_ones(entry_points, monkeypatch):
    entry_points(("fancy", "fancy_hal_backend:FancyBackend"))
    monkeypatch.setenv("VERL_DEVICE", "fancyy")
    with pytest.raises(ValueError, match=r"valid names: auto, cpu, cuda, fancy, npu, sim$"):
        hal.current()


def test_registered_backend_unusable_says_why(entry_points):
    entry_points(("broken", "fancy_hal_backend:BrokenBackend"))
    with pytest.raises(BackendUnavailableError) as info:
        hal.get_backend("broken")
    assert str(info.value) == "backend 'broken' is not usable: the fancy card is not plugged in"


def test_registered_backend_that_does_not_import(entry_points):
    entry_points(("ghost", "no_such_module_anywhere:Ghost"), ("typo", "fancy_hal_backend:FancyBakend"))
    with pytest.raises(BackendUnavailableError, match=r"backend 'ghost' \(no_such_module_anywhere:Ghost\) cannot be loaded: ModuleNotFoundError"):
        hal.get_backend("ghost")
    with pytest.raises(BackendUnavailableError, match=r"backend 'typo' .* cannot be loaded: AttributeError"):
        hal.get_backend("typo")


def test_registered_non_backend_is_rejected(entry_points):
    entry_points(("odd", "fancy_hal_backend:NotABackend"))
    with pytest.raises(TypeError, match=r"backend 'odd' \(fancy_hal_backend:NotABackend\) is not a hal.Backend subclass"):
        hal.get_backend("odd")


def test_conflicting_entry_points_raise(entry_points):
    entry_points(("fancy", "fancy_hal_backend:FancyBackend"), ("fancy", "other_pkg:FancyBackend"))
    with pytest.raises(ValueError) as info:
        hal.backend_names()
    assert str(info.value) == (
        "two packages register backend 'fancy' in group 'hal.backends': "
        "'fancy_hal_backend:FancyBackend' and 'other_pkg:FancyBackend'"
    )


def test_same_entry_point_twice_is_not_a_conflict(entry_points):
    # One package seen twice on sys.path (editable install plus a build dir) is harmless.
    entry_points(("fancy", "fancy_hal_backend:FancyBackend"), ("fancy", "fancy_hal_backend:FancyBackend"))
    assert "fancy" in hal.backend_names()


def test_entry_point_may_not_replace_a_builtin(entry_points):
    entry_points(("cpu", "fancy_hal_backend:FancyBackend"))
    with pytest.raises(ValueError, match=r"tries to replace the built-in backend 'cpu'; register it under another name"):
        hal.get_backend("sim")


def test_real_entry_point_lookup_uses_the_group(hal_reset, monkeypatch):
    seen = []

    def spy(*, group):
        seen.append(group)
        return []

    monkeypatch.setattr(hal.device, "entry_points", spy)
    assert hal.backend_names() == ["cpu", "cuda", "npu", "sim"]
    assert seen and set(seen) == {"hal.backends"}


# ---- laziness, once per process, overrides -----------------------------------------


def test_resolved_once(hal_reset, monkeypatch):
    calls = []
    real = hal.device.resolve
    monkeypatch.setattr(hal.device, "resolve", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setenv("VERL_DEVICE", "sim")
    first = hal.current()
    monkeypatch.setenv("VERL_DEVICE", "cpu")  # too late: already resolved
    assert hal.current() is first
    assert hal.resolution().backend is first
    assert len(calls) == 1
    hal.reset()
    assert hal.current().name == "cpu"
    assert len(calls) == 2


def test_import_is_lazy_and_errors_wait_for_first_use():
    result = run_python(
        """
        import sys
        import hal
        assert hal.device._resolved is None
        assert "hal.backends.cpu" not in sys.modules, "a backend module was imported by `import hal`"
        try:
            hal.current()
        except ValueError as exc:
            print("raised:", exc)
        """,
        env={"VERL_DEVICE": "bogus"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("raised: unknown backend 'bogus'")


def test_use_overrides_and_restores(hal_reset, monkeypatch):
    monkeypatch.setenv("VERL_DEVICE", "cpu")
    outer = hal.current()
    with hal.use("sim") as sim:
        assert hal.current() is sim
        assert hal.resolution().reason == "set by hal.use()"
        mine = CpuBackend()
        with hal.use(mine) as inner:
            assert inner is mine and hal.current() is mine
        assert hal.current() is sim
    assert hal.current() is outer


def test_use_restores_after_an_error(hal_reset):
    before = hal.current()
    with pytest.raises(KeyError):
        with hal.use("sim"):
            raise KeyError("boom")
    assert hal.current() is before


def test_use_before_first_resolution_leaves_it_lazy(hal_reset):
    with hal.use("sim"):
        pass
    assert hal.device._resolved is None


def test_use_with_bad_names(hal_reset):
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        with hal.use("nope"):
            pass
    if NpuBackend.unavailable_reason() is not None:
        with pytest.raises(BackendUnavailableError, match="backend 'npu' is not usable"):
            with hal.use("npu"):
                pass


def test_reset_rereads_environment(hal_reset, monkeypatch):
    monkeypatch.setenv("VERL_DEVICE", "sim")
    assert hal.current().name == "sim"
    hal.reset()
    monkeypatch.setenv("VERL_DEVICE", "cpu")
    assert hal.current().name == "cpu"


def test_failed_resolution_is_not_cached(hal_reset, monkeypatch):
    monkeypatch.setenv("VERL_DEVICE", "bogus")
    with pytest.raises(ValueError):
        hal.current()
    monkeypatch.setenv("VERL_DEVICE", "cpu")
    assert hal.current().name == "cpu"
