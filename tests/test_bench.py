"""`hal bench`: presets, the byte check, and a smoke run of the CLI on the tiny preset.

Behaviour only: no assertion here depends on how fast anything ran.
"""

from __future__ import annotations

import json

import pytest
import torch

from hal import cli
from hal.bench import presets, transfer

pytestmark = pytest.mark.cpu


def test_qwen_05b_preset_matches_the_model():
    params = presets.get_preset("qwen2.5-0.5b").params()
    assert len(params) == 290  # tied embeddings: no separate lm_head
    total = sum(p.nbytes for p in params)
    assert 0.91 < total / 2**30 < 0.93
    embed = params[0]
    assert embed.name == "model.embed_tokens.weight" and embed.shape == (151936, 896)
    assert embed.nbytes > 256 * 2**20  # larger than a 256 MiB bucket: chunking is exercised
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert len({p.name for p in params}) == len(params)


def test_larger_preset_is_larger():
    assert presets.get_preset("qwen2.5-1.5b").total_bytes() > 2 * presets.get_preset("qwen2.5-0.5b").total_bytes()


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(ValueError, match="qwen2.5-0.5b"):
        presets.get_preset("qwen-9000")


def test_pattern_check_catches_a_misplaced_or_missing_tensor():
    params = presets.get_preset("tiny").params()
    offsets, total = transfer._layout(params)
    flat = torch.empty(total, dtype=torch.uint8)
    transfer._fill_pattern(flat)
    assert transfer._matches_pattern(flat)
    views = transfer._views(flat, params, offsets)
    views[3].zero_()  # a tensor that never arrived
    assert not transfer._matches_pattern(flat)
    assert transfer._first_mismatch(flat, params, offsets) == params[3].name


@pytest.mark.multiprocess
def test_bench_cli_smoke_on_tiny_preset(tmp_path):
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    # A 64 KiB bucket is smaller than the tiny embedding (128 KiB), so it is chunked.
    argv = ["bench", "--preset", "tiny", "--repeats", "1", "--warmup", "1", "--bucket-mb", "0.0625",
            "--timeout", "240", "--json", str(out_json), "--plot", str(out_png)]
    assert cli.main(argv) == 0

    report = json.loads(out_json.read_text())
    assert report["preset"] == "tiny"
    methods = [r["method"] for r in report["results"]]
    for required in ("floor", "per_tensor", "hal_bucketed", "hal_shm"):
        assert required in methods
    for r in report["results"]:
        assert r["seconds"] > 0 and r["gib_per_s"] > 0 and r["ratio_to_floor"] > 0, r
        assert r["peak_extra_bytes"] is None or r["peak_extra_bytes"] >= 0, r
    floor = next(r for r in report["results"] if r["method"] == "floor")
    assert floor["ratio_to_floor"] == pytest.approx(1.0)
    hal_rows = [r for r in report["results"] if r["method"].startswith("hal_")]
    assert all(r["sender_metrics"]["buckets"] >= 2 for r in hal_rows)  # the embedding spans buckets
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_an_unknown_method(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--preset", "tiny", "--methods", "floor,teleport"])
    assert "teleport" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_a_run_past_its_deadline_raises_and_leaves_no_process_behind():
    import multiprocessing

    config = transfer.TransferConfig(preset="tiny", methods=("floor",), repeats=1, timeout_s=0.05)
    with pytest.raises(TimeoutError, match="did not finish"):
        transfer.run_transfer(config)
    assert multiprocessing.active_children() == []
