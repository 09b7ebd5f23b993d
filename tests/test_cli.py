"""`hal info` through the installed console script and `python -m hal`, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hal.backends.npu import NpuBackend

HAL = Path(sys.executable).with_name("hal")
REPO_ROOT = Path(__file__).resolve().parent.parent


def run(args: list[str], verl_device: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VERL_DEVICE"}
    if verl_device is not None:
        env["VERL_DEVICE"] = verl_device
    return subprocess.run(args, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def hal_script() -> str:
    if not HAL.exists():
        pytest.skip(f"console script not installed at {HAL} (pip install -e . creates it)")
    return str(HAL)


def test_info_human_readable(hal_script):
    result = run([hal_script, "info"], verl_device="cpu")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "backend        cpu  (VERL_DEVICE=cpu)"
    assert any(line.startswith("collectives    gloo") for line in lines)
    assert any(line.startswith("versions       verl-hal ") for line in lines)
    assert result.stderr == ""


def test_info_json(hal_script):
    result = run([hal_script, "info", "--json"])
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["backend"] == "cpu"
    assert info["requested"] == "auto"
    assert info["reason"].startswith("auto: no accelerator usable")
    assert info["dist_backend"] == "gloo"
    assert info["device_count"] == 1
    assert 0 < info["memory_free_bytes"] <= info["memory_total_bytes"]
    assert info["versions"]["torch"]
    assert set(info) >= {"supports_pinned_memory", "supports_ipc", "supports_async_streams", "visible_devices_env"}
    # gloo's traits, from hal.backends.collectives (not declared by the backend)
    assert info["collective_traits"] == {"follows_streams": False, "point_to_point_for_one_receiver": True, "point_to_point_device_memory": False}


def test_info_json_for_sim(hal_script):
    result = run([hal_script, "info", "--json"], verl_device="sim")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["backend"] == "sim"
    assert info["supports_async_streams"] is True


def _assert_one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{result.stderr}"
    assert "Traceback" not in result.stderr
    return lines[0]


def test_bogus_backend_is_one_line_naming_valid_ones(hal_script):
    line = _assert_one_line_error(run([hal_script, "info"], verl_device="bogus"))
    assert line == "hal info: error: unknown backend 'bogus' (VERL_DEVICE); valid names: auto, cpu, cuda, npu, sim"


@pytest.mark.skipif(NpuBackend.unavailable_reason() is None, reason="an NPU is usable here")
def test_npu_here_says_why(hal_script):
    line = _assert_one_line_error(run([hal_script, "info", "--json"], verl_device="npu"))
    assert line.startswith("hal info: error: backend 'npu' is not usable: ")
    assert "torch_npu" in line  # the import error that makes it unusable


def test_python_dash_m():
    result = run([sys.executable, "-m", "hal", "info", "--json"], verl_device="cpu")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["backend"] == "cpu"
    line = _assert_one_line_error(run([sys.executable, "-m", "hal", "info"], verl_device="bogus"))
    assert "valid names: auto, cpu, cuda, npu, sim" in line


def test_no_command_is_a_usage_error(hal_script):
    result = run([hal_script])
    assert result.returncode == 2
    assert "usage: hal" in result.stderr
