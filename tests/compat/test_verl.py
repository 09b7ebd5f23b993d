"""hal.compat.verl answers verl's device questions from the resolved backend."""

from __future__ import annotations

import ast
import importlib.util
import types
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

import hal
from hal.backends.cuda import CudaBackend
from hal.backends.npu import NpuBackend
from hal.compat import verl
from tests.conftest import run_python

# Every public name of verl 0.9.1's verl/utils/device.py (what `_public_names` reads from
# an installed verl), and the two older names trainers still import.
VERL_NAMES = [
    "AscendHardwareVersion",
    "auto_set_device",
    "check_ipc_version_support",
    "get_device_capability",
    "get_device_id",
    "get_device_name",
    "get_nccl_backend",
    "get_npu_versions",
    "get_resource_name",
    "get_torch_device",
    "get_vendor",
    "get_visible_devices_keyword",
    "is_cuda_available",
    "is_device_available",
    "is_npu_available",
    "is_support_ipc",
    "is_torch_npu_available",
    "manual_seed",
    "manual_seed_all",
    "set_expandable_segments",
]
OLDER_NAMES = ["auto_set_ascend_device_name", "is_ascend_npu_available", "is_rocm_visible_devices"]  # earlier verl releases
# Module-level names of verl's file that are not part of its API.
NOT_API = {"logger"}


def _public_names(source: str) -> list[str]:
    """The names a module's source defines at top level (functions, classes, assignments),
    without the private ones, the imported ones and `NOT_API`."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return sorted(n for n in names if not n.startswith("_") and n not in NOT_API)


def test_every_verl_name_is_exported():
    assert sorted(verl.__all__) == sorted(VERL_NAMES + OLDER_NAMES)
    with hal.use("cpu"):
        for name in VERL_NAMES + OLDER_NAMES:
            assert hasattr(verl, name), name


@pytest.mark.verl
def test_the_names_are_the_installed_verls():
    """Where verl is installed (the verl lane), its own file is the list: read, not imported."""
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        pytest.skip("verl is not installed here (the verl lane, ci/verl.sh, has it)")
    device_py = Path(spec.origin).parent / "utils" / "device.py"
    installed = _public_names(device_py.read_text())
    assert installed == VERL_NAMES, f"verl {version('verl')} ({device_py}) has other public names: update hal/compat/verl.py"


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'get_device_nmae'"):
        verl.get_device_nmae  # noqa: B018


@pytest.mark.parametrize("name", ["cpu", "sim"])
def test_host_backends(name, caplog):
    caplog.set_level("DEBUG", logger="hal.compat.verl")
    with hal.use(name):
        assert verl.get_device_name() == "cpu"
        assert verl.get_nccl_backend() == "gloo"
        assert verl.get_resource_name() == "CPU"
        assert verl.get_visible_devices_keyword() == "CUDA_VISIBLE_DEVICES"
        assert verl.is_cuda_available is False
        assert verl.is_npu_available is False
        assert verl.is_torch_npu_available() is False
        assert verl.is_ascend_npu_available() is False
        assert verl.is_rocm_visible_devices() is False
        assert verl.get_torch_device() is torch.cpu
        assert verl.get_device_id() == 0
        assert verl.get_device_capability() == (None, None)
        assert verl.is_support_ipc() is False  # host shared files are not device IPC
        verl.set_expandable_segments(True)  # no-op off CUDA/NPU, with the backend's reason logged
        assert f"backend {name!r} has no caching allocator" in caplog.text
        assert verl.get_vendor() == "cpu"
        assert verl.is_device_available() is True
        verl.manual_seed(7)
        first = torch.rand(2)
        verl.manual_seed_all(7)
        assert torch.equal(first, torch.rand(2))  # the device generator is torch's CPU one


def test_cuda_backend_answers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0) if index == 1 else (8, 0))
    settings = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    with hal.use(CudaBackend()):
        assert verl.get_device_name() == "cuda"
        assert verl.get_nccl_backend() == "nccl"
        assert verl.get_resource_name() == "GPU"
        assert verl.get_visible_devices_keyword() == "CUDA_VISIBLE_DEVICES"
        assert verl.is_cuda_available is True
        assert verl.is_npu_available is False
        assert verl.get_torch_device() is torch.cuda
        assert verl.get_device_id() == 3
        assert verl.get_device_capability(1) == (9, 0)
        assert verl.get_device_capability() == (8, 0)
        assert verl.is_rocm_visible_devices() is False
        assert verl.is_support_ipc() is True
        assert verl.get_vendor() == "nvidia"
        seeds = []
        monkeypatch.setattr(torch.cuda, "manual_seed", lambda s: seeds.append(("current", s)))
        monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda s: seeds.append(("all", s)))
        verl.manual_seed(1)
        verl.manual_seed_all(2)
        assert seeds == [("current", 1), ("all", 2)]
        verl.set_expandable_segments(False)
        verl.set_expandable_segments(1)  # verl formats whatever it is given; hal wants a bool
        assert settings == ["expandable_segments:False", "expandable_segments:True"]
        with pytest.raises(RuntimeError, match="get_npu_versions: backend 'cuda' reports no NPU driver and CANN versions"):
            verl.get_npu_versions()
        monkeypatch.setattr(torch.version, "hip", "6.2")
        assert verl.is_rocm_visible_devices() is True
        assert verl.is_support_ipc() is False
        assert verl.get_vendor() == "amd"


def test_npu_backend_answers(monkeypatch):
    # Names and host questions only: torch.npu itself needs a PrivateUse1 rename
    # (tests/backends/test_fake_devices.py asks the device-module hooks there).
    with hal.use(NpuBackend()):
        assert verl.get_device_name() == "npu"
        assert verl.get_nccl_backend() == "hccl"
        assert verl.get_resource_name() == "NPU"
        assert verl.get_visible_devices_keyword() == "ASCEND_RT_VISIBLE_DEVICES"
        assert verl.is_npu_available is True
        assert verl.is_cuda_available is False
        assert verl.is_torch_npu_available() is True
        monkeypatch.setattr(NpuBackend, "runtime_versions", lambda self: {"driver": "25.5.0", "cann": "8.3.rc1"})
        monkeypatch.setattr(NpuBackend, "device_model", lambda self, index=None: "Ascend910B2")
        assert verl.get_npu_versions() == (verl.AscendHardwareVersion.A2, "25.5.0", "8.3.rc1")
        assert verl.is_rocm_visible_devices() is False
        assert verl.is_support_ipc() is True
        monkeypatch.setattr(NpuBackend, "runtime_versions", lambda self: {"driver": "25.2.0", "cann": "8.3.rc1"})
        assert verl.is_support_ipc() is False


def test_answers_follow_verl_device(hal_reset, monkeypatch):
    monkeypatch.setenv("VERL_DEVICE", "sim")
    assert verl.get_device_name() == "cpu"
    assert hal.current().name == "sim"


def test_torch_npu_package_check_does_not_import_it(monkeypatch):
    import importlib.util

    seen = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: seen.append(name) or object())
    assert verl.is_torch_npu_available(check_device=False) is True
    assert seen == ["torch_npu"]


@pytest.mark.parametrize(
    ("driver", "cann", "expected"),
    [
        ("25.3.rc1", "8.3.rc1", True),
        ("25.3.rc1.2", "8.3.0", True),
        ("25.5.t3.b001", "8.5.0", True),
        ("25.5.0", "8.3.RC1", True),
        ("25.2.0", "8.3.0", False),
        ("25.3.0", "8.2.rc1", False),
        ("24.1.rc3", "8.0.0", False),
        ("25.3", "8.3", True),  # a final release sorts after its release candidates
    ],
)
def test_check_ipc_version_support(driver, cann, expected):
    assert verl.check_ipc_version_support(driver, cann) is expected


def test_check_ipc_version_support_rejects_garbage():
    with pytest.raises(RuntimeError, match="unrecognised Ascend version 'abc'"):
        verl.check_ipc_version_support("abc", "8.3.0")


def test_get_npu_versions_reads_npu_smi_and_cann(monkeypatch, tmp_path):
    import platform
    import subprocess

    info_dir = tmp_path / f"{platform.machine()}-linux"
    info_dir.mkdir()
    (info_dir / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.3.RC1\n")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    board = "NPU ID : 1\n    Software Version               : 25.3.RC1.2\n"
    ran = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **k: ran.append(cmd) or types.SimpleNamespace(stdout=board))
    with hal.use(NpuBackend()):
        assert verl.get_npu_versions() == (verl.AscendHardwareVersion.NONE, "25.3.rc1.2", "8.3.rc1")  # no torch_npu: no chip name
        assert verl.is_support_ipc() is True
    assert ran[0] == ["npu-smi", "info", "-t", "board", "-i", "1"]


def test_get_npu_versions_says_what_is_missing(monkeypatch, tmp_path):
    import subprocess

    def no_npu_smi(*args, **kwargs):
        raise FileNotFoundError("npu-smi")

    with hal.use(NpuBackend()):
        monkeypatch.setattr(subprocess, "run", no_npu_smi)
        with pytest.raises(RuntimeError, match="get_npu_versions: .*npu-smi is not on PATH"):
            verl.get_npu_versions()
        with pytest.raises(RuntimeError, match="npu-smi is not on PATH"):
            verl.is_support_ipc()
        monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout="NPU ID : 1\n"))
        with pytest.raises(RuntimeError, match="get_npu_versions: .*npu-smi printed no 'Software Version' line"):
            verl.get_npu_versions()
        monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout="Software Version : 25.5.0\n"))
        monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
        with pytest.raises(RuntimeError, match="get_npu_versions: .*CANN toolkit info file .*ascend_toolkit_install.info"):
            verl.get_npu_versions()
    with hal.use("cpu"):
        with pytest.raises(RuntimeError, match="get_npu_versions: backend 'cpu' reports no NPU driver and CANN versions"):
            verl.get_npu_versions()


def _config(device):
    return types.SimpleNamespace(trainer=types.SimpleNamespace(device=device))


def test_auto_set_device():
    with hal.use(NpuBackend()):
        config = _config("cuda")
        verl.auto_set_device(config)
        assert config.trainer.device == "npu"
        config = _config("cpu")  # an explicit cpu is kept, as in verl
        verl.auto_set_ascend_device_name(config)
        assert config.trainer.device == "cpu"
    with hal.use("cpu"):
        config = _config("cuda")
        verl.auto_set_device(config)
        assert config.trainer.device == "cpu"
    verl.auto_set_device(None)  # verl tolerates a missing config
    verl.auto_set_device(types.SimpleNamespace(trainer=None))


def test_import_resolves_nothing():
    result = run_python(
        """
        import hal.device, hal.compat.verl
        assert hal.device._resolved is None, hal.device._resolved
        print("ok")
        """,
        env={"VERL_DEVICE": "bogus"},  # a resolution at import would raise
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_known_but_unusable_device_is_not_available(hal_reset, monkeypatch):
    if CudaBackend.is_available():
        pytest.skip("a usable GPU here")
    monkeypatch.setenv("VERL_DEVICE", "cuda")
    assert verl.is_device_available() is False
    monkeypatch.setenv("VERL_DEVICE", "bogus")
    hal.reset()
    with pytest.raises(ValueError, match="unknown backend 'bogus'"):
        verl.is_device_available()


@pytest.mark.parametrize(
    ("model", "generation"),
    [("Ascend910B2", "A2"), ("Ascend910B4-1", "A2"), ("Ascend910_9382", "A3"), ("Ascend910_9591", "A5"),
     ("Ascend950PR", "A5"), ("Ascend310P3", "MAX_VERSION"), (None, "NONE")],
)
def test_ascend_generation_from_the_product_name(model, generation):
    from hal.backends.npu import ascend_generation

    assert verl.AscendHardwareVersion(ascend_generation(model)) is verl.AscendHardwareVersion[generation]
