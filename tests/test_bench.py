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


# ---- several receivers and simulated nodes ------------------------------------------------


def _gone(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _check_processes(report, receivers):
    import multiprocessing

    assert report["receivers"] == receivers and report["processes"] == 1 + receivers
    assert len(set(report["pids"])) == 1 + receivers
    assert multiprocessing.active_children() == []
    assert all(_gone(pid) for pid in report["pids"]), report["pids"]  # every rank joined, none left behind


def test_node_layout_and_default_methods():
    assert transfer.node_keys(4, 2) == ["trainer", "node0", "node0", "node1", "node1"]
    assert transfer.node_leaders(4, 2) == [1, 3]
    assert transfer.node_keys(3, 1) == ["trainer", "node0", "node0", "node0"]
    assert transfer.node_leaders(3, 1) == [1]
    assert transfer.default_methods(1, 1) == transfer.ALL_METHODS  # no new flags: as before
    assert set(transfer.default_methods(2, 1)) == set(transfer.ALL_METHODS) | {"hal_hier", "floor_leaders"}
    assert not set(transfer.default_methods(4, 2)) & set(transfer.SHM_METHODS)


def test_bench_rejects_impossible_layouts(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--preset", "tiny", "--receivers", "1", "--nodes", "2"])
    with pytest.raises(SystemExit, match="one node"):
        cli.main(["bench", "--preset", "tiny", "--receivers", "2", "--nodes", "2", "--methods", "floor,hal_shm"])
    with pytest.raises(ValueError, match="nodes"):
        transfer.TransferConfig(preset="tiny", receivers=2, nodes=3)


@pytest.mark.multiprocess
def test_bench_cli_with_two_receivers(tmp_path):
    out_json = tmp_path / "out.json"
    argv = ["bench", "--preset", "tiny", "--receivers", "2", "--repeats", "1", "--bucket-mb", "0.0625",
            "--timeout", "240", "--json", str(out_json)]
    assert cli.main(argv) == 0
    report = json.loads(out_json.read_text())
    _check_processes(report, 2)
    rows = {r["method"]: r for r in report["results"]}
    assert list(rows) == list(transfer.default_methods(2, 1))
    model, segments = report["bytes"], report["segment_bytes_per_sync"]
    assert model <= segments < 1.1 * model  # the plan's segments: the model plus padding inside segments
    for name, r in rows.items():
        assert r["seconds"] > 0 and r["ratio_to_floor"] > 0 and r["ratio_to_floor_leaders"] > 0, r
        assert len(r["peak_extra_bytes_per_rank"]) == 3 and len(r["cpu_s_per_rank"]) == 3, r
        want_verified = [1] if name == "floor_leaders" else [] if name.endswith("_read") else [1, 2]
        assert r["verified_ranks"] == want_verified, name
    assert rows["floor"]["network_bytes_per_sync"] == 2 * model
    assert rows["hal_bucketed"]["network_bytes_per_sync"] == 2 * segments
    assert rows["hal_shm"]["network_bytes_per_sync"] == 0
    assert rows["floor_leaders"]["network_bytes_per_sync"] == model
    # every receiver on one node, apart from the sender: one leader gets the bytes over the network
    hier = rows["hal_hier"]
    assert hier["network_bytes_all"] == [segments] * 2 and hier["network_bytes_per_sync"] == segments
    assert all(m["buckets"] >= 2 for m in hier["receiver_metrics_per_rank"])  # the embedding spans buckets


@pytest.mark.multiprocess
def test_bench_cli_hierarchical_on_two_nodes(tmp_path):
    out_json = tmp_path / "out.json"
    argv = ["bench", "--preset", "tiny", "--receivers", "2", "--nodes", "2", "--methods", "floor,hal_hier",
            "--repeats", "2", "--timeout", "240", "--json", str(out_json)]
    assert cli.main(argv) == 0
    report = json.loads(out_json.read_text())
    _check_processes(report, 2)
    assert report["node_keys"] == ["trainer", "node0", "node1"] and report["node_leaders"] == [1, 2]
    rows = {r["method"]: r for r in report["results"]}
    assert list(rows) == ["floor", "hal_hier"]
    model, segments = report["bytes"], report["segment_bytes_per_sync"]
    hier = rows["hal_hier"]
    assert hier["network_bytes_all"] == [2 * segments] * 3  # warm-up + 2 rounds: one model per node, each sync
    assert hier["network_bytes_per_sync"] == 2 * segments and model <= segments < 1.1 * model
    assert hier["verified_ranks"] == [1, 2] and rows["floor"]["verified_ranks"] == [1, 2]
    assert rows["floor"]["network_bytes_per_sync"] == 2 * model
