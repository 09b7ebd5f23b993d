"""`hal bench`: presets, the byte check, and a smoke run of the CLI on the tiny preset.

Behaviour only: no assertion here depends on how fast anything ran.
"""

from __future__ import annotations

import json

import pytest
import torch

from hal import cli
from hal.tools.bench import buffers, presets, record, transfer, transfer_config

pytestmark = pytest.mark.cpu


def _check_record(report, benchmark, argv):
    """The report is a record that stands alone (hal.tools.bench.record): docs/results/ takes it as it is."""
    assert record.check_record(report) == [], record.check_record(report)
    assert list(report)[0] == "run"
    run = report["run"]
    assert run["benchmark"] == benchmark and run["source"] == "hal bench --json"
    assert run["command"].endswith("hal " + " ".join(argv)), run["command"]
    assert run["date"] <= run["finished"]
    assert run["machine"]["cpus"] >= 1 and run["machine"]["torch"] and run["machine"]["backend"]


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
    offsets, total = buffers.flat_layout(params)
    flat = torch.empty(total, dtype=torch.uint8)
    buffers.fill_pattern(flat)
    assert buffers.matches_pattern(flat)
    views = buffers.flat_views(flat, params, offsets)
    views[3].zero_()  # a tensor that never arrived
    assert not buffers.matches_pattern(flat)
    assert buffers.first_mismatch(flat, params, offsets) == params[3].name


@pytest.mark.multiprocess
def test_bench_cli_smoke_on_tiny_preset(tmp_path, capsys):
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    # A 64 KiB bucket is smaller than the tiny embedding (128 KiB), so it is chunked.
    argv = ["bench", "--preset", "tiny", "--repeats", "1", "--warmup", "1", "--bucket-mb", "0.0625",
            "--timeout", "240", "--json", str(out_json), "--plot", str(out_png)]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out

    report = json.loads(out_json.read_text())
    _check_record(report, "transfer", argv)
    assert report["preset"] == "tiny"
    assert report["config"]["layout"] == "flat" and report["storages_per_rank"] == [1, 1]  # views of one buffer
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
    for r in hal_rows:  # the host time per tensor, each side's, in the report and the table
        send, recv = r["sender_metrics"]["host_us_per_tensor"], r["receiver_metrics"]["host_us_per_tensor"]
        assert send > 0 and recv > 0
        row = next(line for line in table.splitlines() if line.startswith(r["method"] + " "))
        assert row.endswith(f"{send:.1f} / {recv:.1f}"), row
    assert "host us/tensor (send / recv)" in table
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_scattered_layout_moves_and_checks_each_tensors_own_memory(tmp_path, capsys):
    """--layout scattered: every tensor its own allocation on both sides (the floors still move
    the flat buffer); each receiver's tensors are checked byte for byte after every round."""
    out_json = tmp_path / "out.json"
    argv = ["bench", "--preset", "tiny", "--layout", "scattered", "--repeats", "2", "--warmup", "1", "--bucket-mb", "0.0625",
            "--methods", "floor,floor_pipelined,per_tensor,hal_bucketed,hal_shm,hal_bucketed_copy", "--timeout", "240",
            "--json", str(out_json)]
    assert cli.main(argv) == 0
    assert " 26 scattered tensors; " in capsys.readouterr().out
    report = json.loads(out_json.read_text())
    _check_record(report, "transfer", argv)
    assert report["config"]["layout"] == "scattered"
    assert report["storages_per_rank"] == [26, 26]  # each tensor its own allocation, on both sides
    rows = {r["method"]: r for r in report["results"]}
    assert list(rows) == ["floor", "floor_pipelined", "per_tensor", "hal_bucketed", "hal_shm", "hal_bucketed_copy"]
    assert all(r["verified_ranks"] == [1] for r in rows.values()), {m: r["verified_ranks"] for m, r in rows.items()}


def test_bench_layout_is_refused_where_it_means_nothing(capsys):
    with pytest.raises(SystemExit, match="--layout applies to the transfer benchmark only, not to device-transfer"):
        cli.main(["bench", "--device-transfer", "--layout", "scattered"])
    with pytest.raises(SystemExit):
        cli.main(["bench", "--preset", "tiny", "--layout", "sideways"])
    assert "invalid choice: 'sideways'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="layout: 'sideways'; choose one of flat, scattered"):
        transfer_config.TransferConfig(preset="tiny", layout="sideways")


def test_bench_rejects_an_unknown_method(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--preset", "tiny", "--methods", "floor,teleport"])
    assert "teleport" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_a_run_past_its_deadline_raises_and_leaves_no_process_behind():
    import multiprocessing

    config = transfer_config.TransferConfig(preset="tiny", methods=("floor",), repeats=1, timeout_s=0.05)
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
    assert transfer_config.node_keys(4, 2) == ["trainer", "node0", "node0", "node1", "node1"]
    assert transfer_config.node_leaders(4, 2) == [1, 3]
    assert transfer_config.node_keys(3, 1) == ["trainer", "node0", "node0", "node0"]
    assert transfer_config.node_leaders(3, 1) == [1]
    assert transfer_config.default_methods(1, 1) == transfer_config.ALL_METHODS  # no new flags: as before
    assert set(transfer_config.default_methods(2, 1)) == set(transfer_config.ALL_METHODS) | {"hal_hier", "floor_leaders"}
    assert not set(transfer_config.default_methods(4, 2)) & set(transfer_config.SHM_METHODS)


def test_bench_rejects_impossible_layouts(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--preset", "tiny", "--receivers", "1", "--nodes", "2"])
    with pytest.raises(SystemExit, match="one node"):
        cli.main(["bench", "--preset", "tiny", "--receivers", "2", "--nodes", "2", "--methods", "floor,hal_shm"])
    with pytest.raises(ValueError, match="nodes"):
        transfer_config.TransferConfig(preset="tiny", receivers=2, nodes=3)


@pytest.mark.multiprocess
def test_bench_cli_with_two_receivers(tmp_path):
    out_json = tmp_path / "out.json"
    argv = ["bench", "--preset", "tiny", "--receivers", "2", "--repeats", "1", "--bucket-mb", "0.0625",
            "--timeout", "240", "--json", str(out_json)]
    assert cli.main(argv) == 0
    report = json.loads(out_json.read_text())
    _check_record(report, "transfer", argv)
    _check_processes(report, 2)
    rows = {r["method"]: r for r in report["results"]}
    assert list(rows) == list(transfer_config.default_methods(2, 1))
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
    _check_record(report, "transfer", argv)
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


# ---- hal bench --delta ------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_bench_delta_cli_on_tiny_preset(tmp_path):
    import multiprocessing

    out_json = tmp_path / "delta.json"
    # lr 1e-6 changes a few percent of the bf16 words per step; lr 0.1 changes nearly all
    # of them, so every segment must go whole. A 64 KiB bucket chunks the embedding, and
    # anchor_every 2 makes sync 2 a whole one again.
    argv = ["bench", "--delta", "--preset", "tiny", "--lrs", "1e-6,0.1", "--syncs", "3", "--anchor-every", "2",
            "--bucket-mb", "0.0625", "--timeout", "200", "--json", str(out_json)]
    assert cli.main(argv) == 0
    report = json.loads(out_json.read_text())
    _check_record(report, "delta", argv)
    assert multiprocessing.active_children() == []
    assert all(_gone(pid) for pid in report["pids"]), report["pids"]
    assert report["mode"] == "delta" and report["preset"] == "tiny"
    assert report["config"]["wire_dtype"] == "torch.bfloat16" and report["config"]["lrs"] == [1e-6, 0.1]
    assert report["wire_bytes_total"] == sum(p.nbytes for p in presets.get_preset("tiny").params())  # bf16, as the preset
    small, large = report["results"]
    assert (small["lr"], large["lr"]) == (1e-6, 0.1)
    for r in (small, large):
        assert r["verified_syncs"] == 4  # every sync of both hal methods byte-equal to the floor's
        assert [s["sync"] for s in r["syncs"]] == [0, 1, 2, 3] and all(s["verified"] for s in r["syncs"])
        assert r["anchor_syncs"] == [0, 2] and r["steady_syncs"] == 2
        for method in ("floor", "hal_bucketed", "hal_delta_bytes", "hal_delta_time"):
            assert r["seconds"][method] > 0 and r["anchor"][method]["seconds"] > 0
        assert r["ratio_to_dense"] > 0 and r["ratio_to_floor"] > 0
        assert r["encode_s"] >= 0 and r["apply_s"] > 0 and r["dense_apply_s"] > 0
        assert r["baseline_bytes"]["sender"] >= report["wire_bytes_total"]  # one image of the wire bytes
        assert r["baseline_bytes"]["receiver"] is not None
        segments = r["segments_by_encoding"]
        assert set(segments) == {"dense", "indices", "bitmask"} and sum(segments.values()) >= 2 * 3
        assert r["dense_wire_bytes"] >= report["wire_bytes_total"]
        for method in ("hal_delta_bytes", "hal_delta_time"):
            anchor = r["syncs"][0][method]["sender_metrics"]
            assert anchor["delta"] is False and anchor["wire_bytes"] == anchor["dense_wire_bytes"]
            assert anchor["delta_choice"] == "anchor"
        # by time: one choice per steady sync, each a known one, and its ratios measured
        t = r["by_time"]
        assert len(t["per_sync"]) == 2 and set(t["per_sync"]) <= {"anchor", "delta", "stopped", "paused"}  # (a whole sync restarts anchor_every)
        assert t["ratio_to_dense"] > 0 and t["mean_ratio_to_dense"] > 0 and 0 < t["bytes_ratio"] <= 1
    # issue 11's targets exist for lr 1e-6 (bytes and time) and 1e-5 (time), not for 0.1
    assert [(t["choose"], t["target"]) for t in small["targets"]] == [
        ("bytes", "wire bytes <= 0.12x dense"), ("bytes", "seconds <= 0.6x dense hal_bucketed"),
        ("time", "wire bytes <= 0.12x dense"), ("time", "seconds <= 0.6x dense hal_bucketed"),
        ("time", "mean seconds <= 0.6x dense hal_bucketed"),
    ]
    assert all(isinstance(t["met"], bool) and t["value"] > 0 for t in small["targets"]) and large["targets"] == []
    assert small["wire_bound"]["break_even_gb_per_s"] > 0 and large["wire_bound"] is None  # no fewer bytes: no projection
    # a small step: a few percent of the words change, and the delta is far smaller than dense
    assert 0 < small["changed_fraction"] < 0.2
    assert small["wire_bytes"] < 0.5 * small["dense_wire_bytes"] and small["bytes_ratio"] < 0.5
    assert small["segments_by_encoding"]["indices"] + small["segments_by_encoding"]["bitmask"] > 0
    # a large step changes nearly everything: every segment falls back to its dense bytes
    assert large["changed_fraction"] > 0.9
    assert large["segments_by_encoding"]["indices"] == large["segments_by_encoding"]["bitmask"] == 0
    assert large["wire_bytes"] == large["dense_wire_bytes"] and large["bytes_ratio"] == pytest.approx(1.0)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_bench_delta_on_an_emulated_slow_link_the_time_choice_sends_deltas(tmp_path):
    """On a link of 5 MB/s (emulated) a dense sync of the tiny preset takes about 60 ms of
    wire, far more than comparing it: choosing by time sends deltas, at a few percent of
    the bytes, and faster than dense."""
    out_json = tmp_path / "delta.json"
    argv = ["bench", "--delta", "--preset", "tiny", "--lrs", "1e-6", "--syncs", "4", "--link-gbps", "0.005",
            "--bucket-mb", "0.0625", "--timeout", "200", "--json", str(out_json)]
    assert cli.main(argv) == 0
    report = json.loads(out_json.read_text())
    assert "EMULATED link of 0.005 GB/s" in report["timing"] and report["config"]["link_gb_per_s"] == 0.005
    (r,) = report["results"]
    assert r["verified_syncs"] == 5
    t = r["by_time"]
    assert t["per_sync"][0] == "paused" and set(t["per_sync"][1:]) == {"delta"}  # measured once, then deltas
    assert t["bytes_ratio"] < 0.2 and r["bytes_ratio"] < 0.2
    assert r["seconds"]["hal_bucketed"] > 0.05  # the wire's 60 ms are in the dense sync's time
    assert t["ratio_to_dense"] < 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--link-gbps", "0"], "0"),
        (["--wire-dtype", "fp64"], "fp64"),
        (["--lrs", "1e-6,fast"], "comma-separated numbers"),
        (["--lrs", "1e-6,-1e-5"], "positive"),
        (["--baseline", "disk"], "disk"),
        (["--syncs", "0"], "0"),
        (["--anchor-every", "x"], "x"),
        (["--preset", "qwen-9000"], "qwen2.5-0.5b"),
        (["--methods", "floor"], "--delta does not take --methods"),
        (["--receivers", "2"], "--delta does not take --receivers"),
        (["--engine", "vllm"], "--delta does not take --engine vllm"),
    ],
)
def test_bench_delta_rejects_unknown_values(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--delta", "--preset", "tiny", *argv])
    assert exc.value.code != 0
    captured = capsys.readouterr()
    assert message in f"{exc.value.code} {captured.err}"


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_bench_delta_kernels_times_each_kernel_and_checks_each_apply(device, tmp_path, monkeypatch, hal_reset):
    monkeypatch.setenv("VERL_DEVICE", device)
    out_json = tmp_path / "kernels.json"
    argv = ["bench", "--delta-kernels", "--segment-mb", "0.25", "--repeats", "1", "--json", str(out_json)]
    assert cli.main(argv) == 0
    report = json.loads(out_json.read_text())
    _check_record(report, "delta-kernels", argv)
    assert report["run"]["command"].startswith(f"VERL_DEVICE={device} ")
    assert report["run"]["machine"]["backend"] == device
    assert report["mode"] == "delta-kernels" and report["backend"] == device and report["segment_bytes"] == 256 << 10
    assert report["copy_ms"] > 0
    rows = {r["fraction"]: r for r in report["results"]}
    assert list(rows) == [0.0, 0.01, 0.03, 0.1, 0.2, 0.5, 1.0]
    for fraction, r in rows.items():
        assert abs(r["changed_fraction"] - fraction) < 0.02, r  # the share asked for is the share changed
        assert r["encode_ms"] > 0
    # few changes travel as indices, more as a bitmask, all as the dense bytes (no check, no apply)
    assert rows[0.01]["encoding"] == "indices" and rows[0.2]["encoding"] == "bitmask" and rows[1.0]["encoding"] == "dense"
    assert rows[0.01]["payload_ratio"] < rows[0.2]["payload_ratio"] < rows[1.0]["payload_ratio"] == 1.0
    assert rows[1.0]["apply_ms"] is None and all(rows[f]["apply_ms"] > 0 and rows[f]["check_ms"] >= 0 for f in (0.01, 0.2, 0.5))


def test_bench_delta_kernels_refuses_bad_settings():
    from hal.tools.bench import delta_kernels

    with pytest.raises(ValueError, match="word"):
        delta_kernels.KernelBenchConfig(word=3)
    with pytest.raises(ValueError, match="fractions"):
        delta_kernels.KernelBenchConfig(fractions=(0.5, 1.5))
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--delta-kernels", "--delta"])
    assert "two benchmarks" in str(exc.value.code)
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--segment-mb", "4"])
    assert "--segment-mb applies to --delta-kernels only" in str(exc.value.code)


@pytest.mark.multiprocess
@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_bench_device_transfer_checks_every_receivers_bytes_for_every_method(device, tmp_path, monkeypatch, hal_reset):
    monkeypatch.setenv("VERL_DEVICE", device)
    out_json = tmp_path / "device.json"
    argv = ["bench", "--device-transfer", "--preset", "tiny", "--repeats", "2", "--receivers", "2", "--json", str(out_json)]
    assert cli.main(argv) == 0
    report = json.loads(out_json.read_text())
    _check_record(report, "device-transfer", argv)
    assert report["mode"] == "device-transfer" and report["backend"] == device and len(report["devices"]) == 3
    rows = {r["method"]: r for r in report["results"]}
    assert list(rows) == ["floor_ipc", "hal_ipc", "hal_ipc_verified", "hal_ipc_staged", "hal_gloo"]
    for r in rows.values():  # every round of every method left every byte at both receivers
        assert r["verified_receivers"] == [1, 2] and len(r["all_seconds"]) == 2 and r["seconds"] > 0
    assert rows["floor_ipc"]["ratio_to_floor"] == 1.0


def test_bench_device_transfer_profile_says_where_each_ranks_time_went(tmp_path, monkeypatch, hal_reset, capsys):
    monkeypatch.setenv("VERL_DEVICE", "sim")
    out_json = tmp_path / "device.json"
    argv = ["bench", "--device-transfer", "--preset", "tiny", "--repeats", "1", "--device-methods", "hal_ipc,hal_ipc_verified", "--profile",
            "--json", str(out_json)]
    assert cli.main(argv) == 0
    report = json.loads(out_json.read_text())
    assert set(report["profiles"]) == {"0", "1"}
    for methods in report["profiles"].values():  # per method, pstats' table of its measured rounds and callers
        assert set(methods) == {"floor_ipc", "hal_ipc", "hal_ipc_verified"}  # the floor always runs
        for text in (methods["hal_ipc"], methods["hal_ipc_verified"]):
            assert "function calls" in text and "tottime" in text and "hal/sync/" in text and "was called by" in text
        assert "kernels/verify.py" not in methods["hal_ipc"]
    assert any("kernels/verify.py" in methods["hal_ipc_verified"] for methods in report["profiles"].values())  # its own profile
    assert "rank 1 (receiver), hal_ipc_verified, its measured rounds, by own time:" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--profile applies to --device-transfer only"):
        cli.main(["bench", "--preset", "tiny", "--profile"])


def test_device_transfer_pattern_check_catches_one_wrong_byte():
    from hal.tools.bench import device_transfer

    flat = torch.zeros(100_003, dtype=torch.uint8)
    buffers.fill_pattern(flat)
    assert device_transfer._matches(flat)
    flat[77_777] ^= 1
    assert not device_transfer._matches(flat)


def test_bench_device_transfer_refuses_what_it_does_not_take():
    from hal.tools import bench
    from hal.tools.bench import options as bench_options
    from hal.tools.bench import device_transfer

    assert bench_options.DEVICE_METHODS == device_transfer.METHODS  # the CLI's list is the module's
    with pytest.raises(ValueError, match="floor_ipc"):
        device_transfer.DeviceTransferConfig(methods=("hal_ipc",))
    with pytest.raises(ValueError, match="unknown method"):
        device_transfer.DeviceTransferConfig(methods=("floor_ipc", "nccl"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--device-transfer", "--delta"])
    assert "--device-transfer does not take --delta" in str(exc.value.code)
    with pytest.raises(SystemExit):
        cli.main(["bench", "--device-transfer", "--device-methods", "hal_shm"])  # a transfer method, not a device one


def test_delta_bench_config_checks_its_fields():
    from hal.tools.bench import delta_config

    with pytest.raises(ValueError, match="lrs"):
        delta_config.DeltaBenchConfig(preset="tiny", lrs=(0.0,))
    with pytest.raises(ValueError, match="syncs"):
        delta_config.DeltaBenchConfig(preset="tiny", syncs=0)
    with pytest.raises(ValueError, match="wire_dtype"):
        delta_config.DeltaBenchConfig(preset="tiny", wire_dtype=torch.float64)
    with pytest.raises(ValueError, match="qwen2.5-0.5b"):
        delta_config.DeltaBenchConfig(preset="qwen-9000")


def test_delta_targets_and_projection():
    from hal.tools.bench import delta_report

    summary = {"lr": 1e-6, "bytes_ratio": 0.1, "ratio_to_dense": 0.7, "wire_bytes": 100.0, "dense_wire_bytes": 1000.0,
               "encode_s": 0.5, "apply_s": 0.3, "dense_apply_s": 0.2}
    verdicts = {t["target"]: t["met"] for t in delta_report.target_verdicts(summary)}
    assert verdicts == {"wire bytes <= 0.12x dense": True, "seconds <= 0.6x dense hal_bucketed": False}
    assert [t["met"] for t in delta_report.target_verdicts({**summary, "lr": 1e-5, "ratio_to_dense": 1.04})] == [True]
    by_time = {"bytes_ratio": 1.0, "ratio_to_dense": 1.01, "mean_ratio_to_dense": 1.08}
    verdicts = delta_report.target_verdicts({**summary, "lr": 1e-5, "ratio_to_dense": 1.04, "by_time": by_time})
    assert [(t["choose"], t["met"]) for t in verdicts] == [("bytes", True), ("time", True), ("time", False)]
    assert delta_report.target_verdicts({**summary, "lr": 3e-6}) == []  # no target at this lr
    wb = delta_report.wire_bound_projection(summary)
    assert wb["extra_s"] == pytest.approx(0.6)  # encode plus the apply time dense sync does not spend
    assert wb["break_even_gb_per_s"] == pytest.approx(900 / 0.6 / 1e9)  # (dense - delta bytes) / extra
    assert wb["ratio_0_6_gb_per_s"] == pytest.approx(500 / 0.6 / 1e9)
    assert "not a measurement" in wb["note"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_delta_run_past_its_deadline_raises_and_leaves_no_process_behind():
    import multiprocessing

    from hal.tools.bench import delta, delta_config

    with pytest.raises(TimeoutError, match="did not finish"):
        delta.run_delta(delta_config.DeltaBenchConfig(preset="tiny", syncs=1, timeout_s=0.05))
    assert multiprocessing.active_children() == []


def test_moe_preset_has_moe_tensor_counts_in_about_a_gibibyte():
    from hal.tools.bench.presets import get_preset

    preset = get_preset("moe-16k")
    params = preset.params()
    names = [p.name for p in params]
    assert len(params) >= 16_000 and len(set(names)) == len(names)
    assert 0.9 * 2**30 <= preset.total_bytes() <= 1.1 * 2**30
    # Qwen3-MoE's names: a router and experts per layer, q/k norms, no biases, an untied head
    assert "model.layers.23.mlp.experts.223.down_proj.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names and "model.layers.0.self_attn.q_norm.weight" in names
    assert not any(n.endswith(".bias") for n in names) and names[-1] == "lm_head.weight"
    assert sum(".experts." in n for n in names) == 24 * 224 * 3
