"""`hal bench --senders M --receivers K`: every trainer rank sends its own rows (hal.tools.bench.senders).

Behaviour only: no assertion here depends on how fast anything ran.
"""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch

from hal import cli
from hal.sync.plan.shards import chunk_rows as layout_chunk_rows
from hal.tools.bench import buffers, presets, record, senders, senders_rank
from tests.tools.test_bench import _gone

pytestmark = pytest.mark.cpu


@pytest.mark.multiprocess
def test_two_senders_two_receivers_on_the_tiny_preset(tmp_path, capsys):
    out_json = tmp_path / "mn.json"
    argv = ["bench", "--senders", "2", "--receivers", "2", "--preset", "tiny", "--repeats", "1", "--timeout", "240", "--json", str(out_json)]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    assert record.check_record(report) == [] and report["run"]["benchmark"] == "senders"
    assert report["run"]["command"].endswith("hal " + " ".join(argv))
    model = presets.get_preset("tiny").total_bytes()
    assert report["mode"] == "senders" and report["senders"] == 2 and report["receivers"] == 2 and report["bytes"] == model
    rows = {r["method"]: r for r in report["results"]}
    assert list(rows) == list(senders.METHODS)
    sharded = rows["sharded"]
    assert sharded["bytes_per_rank"] == [model // 2, model // 2]  # every row of tiny divides by 2
    check = sharded["share_check"]
    assert check["rows_divide_evenly"] and check["sent_bytes_per_rank"] == [[model // 2], [model // 2]]
    assert check["syncs_checked_per_rank"] == [2, 2]  # one warm-up, one round
    assert all(b >= model // 2 for b in sharded["segment_bytes_per_rank"])
    for method in ("one_sender", "plain_sender"):
        assert rows[method]["bytes_per_rank"] == [model]
    for r in rows.values():
        assert r["seconds"] > 0 and r["verified_syncs_per_receiver"] == [2, 2]
    assert report["ratio_senders_to_one"] == pytest.approx(rows["sharded"]["ratio_to_one_sender"]) and report["ratio_senders_to_one"] > 0
    assert "each = model / 2" in table and "bit-exact after every sync" in table
    assert multiprocessing.active_children() == []
    assert len(set(report["pids"])) == 4 and all(_gone(pid) for pid in report["pids"])


@pytest.mark.multiprocess
def test_uneven_rows_are_reported_with_how_far_the_shares_are_from_model_over_m(capsys):
    config = senders.SendersConfig(preset="tiny", senders=3, receivers=1, methods=("sharded",), repeats=1, warmup=0, timeout_s=240)
    report = senders.run_senders(config)
    check = report["results"][0]["share_check"]
    model = report["bytes"]
    assert not check["rows_divide_evenly"] and check["uneven_params"]
    assert sum(check["plan_bytes_per_rank"]) == model
    assert check["max_deviation_from_model_over_m_bytes"] == max(abs(b - model / 3) for b in check["plan_bytes_per_rank"]) > 0
    assert "do NOT divide evenly by 3" in senders.format_table(report)


def _shares(model: int = 1000, m: int = 2) -> dict:
    return dict(model_bytes=model, expected=[model // m] * m, plan=[model // m] * m, sent=[[model // m] * 3] * m, held=[model // m] * m,
                reported_model=[model] * 3, received=[model] * 3)


def test_the_byte_check_passes_exact_shares_and_fails_any_wrong_count():
    summary = senders.check_byte_shares(**_shares())
    assert summary["rows_divide_evenly"] and summary["plan_bytes_per_rank"] == [500, 500]
    wrong_sent = dict(_shares(), sent=[[500, 500, 500], [500, 501, 500]])  # rank 1 sent a byte too many in sync 1
    with pytest.raises(senders.ShareError, match="trainer rank 1: sent 501 bytes in sync 1, its plan share is 500"):
        senders.check_byte_shares(**wrong_sent)
    with pytest.raises(senders.ShareError, match="sum to 1002"):  # shares that do not add up to the model
        senders.check_byte_shares(**dict(_shares(), plan=[501, 501], sent=[[501], [501]], held=[501, 501], expected=[501, 501]))
    with pytest.raises(senders.ShareError, match="model / 2 = 500"):  # even rows, uneven shares
        senders.check_byte_shares(**dict(_shares(), plan=[400, 600], sent=[[400], [600]], held=[400, 600], expected=[400, 600]))
    with pytest.raises(senders.ShareError, match="its Shard\\(0\\) rows are 500"):  # a plan that is not FSDP2's split
        senders.check_byte_shares(**dict(_shares(), expected=[500, 500], plan=[400, 600], sent=[[400], [600]], held=[400, 600],
                                         uneven=["w"]))
    with pytest.raises(senders.ShareError, match="holds 499 bytes"):
        senders.check_byte_shares(**dict(_shares(), held=[500, 499]))
    with pytest.raises(senders.ShareError, match="a receiver received 999"):
        senders.check_byte_shares(**dict(_shares(), received=[1000, 999]))
    with pytest.raises(senders.ShareError, match="no sync counted"):
        senders.check_byte_shares(**dict(_shares(), sent=[[500], []]))
    uneven = senders.check_byte_shares(**dict(_shares(), expected=[502, 498], plan=[502, 498], sent=[[502], [498]], held=[502, 498], uneven=["w"]))
    assert not uneven["rows_divide_evenly"] and uneven["max_deviation_from_model_over_m_bytes"] == 2


@pytest.mark.parametrize("preset", ["tiny", "qwen2.5-0.5b", "moe-16k"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7])
def test_expected_shares_are_torch_chunk_and_the_layouts_split(preset, m):
    params = presets.get_preset(preset).params()
    shares = senders.expected_shares(params, m)
    assert sum(shares) == sum(p.nbytes for p in params)
    for rows in sorted({p.shape[0] for p in params}):
        assert senders.chunk_rows(rows, m) == [layout_chunk_rows(rows, m, i) for i in range(m)]
    if m in (2, 4):  # every row of these presets divides by 2 and 4
        assert not senders.uneven_params(params, m) and shares == [sum(p.nbytes for p in params) // m] * m


def test_a_ranks_shard_holds_the_bytes_the_whole_models_pattern_has_there():
    params = presets.get_preset("tiny").params()
    offsets, total = buffers.flat_layout(params)
    whole = torch.empty(total, dtype=torch.uint8)
    buffers.fill_pattern(whole)
    views = buffers.flat_views(whole, params, offsets)
    for rank in range(3):
        _, locals_ = senders_rank.local_shards(params, offsets, total, 3, rank)
        for p, view, local in zip(params, views, locals_):
            lo, hi = senders.chunk_rows(p.shape[0], 3)[rank]
            assert torch.equal(local.view(torch.uint8), view[lo:hi].view(torch.uint8)), p.name


def test_fill_pattern_range_matches_fill_pattern_across_periods():
    n = 3 * buffers.PATTERN_PERIOD + 12345
    whole = torch.empty(n, dtype=torch.uint8)
    buffers.fill_pattern(whole)
    block = buffers.pattern_block(buffers.PATTERN_PERIOD, 0)
    for start, length in ((0, 10), (buffers.PATTERN_PERIOD - 3, 7), (12, 2 * buffers.PATTERN_PERIOD + 5), (n - 100, 100)):
        part = torch.empty(length, dtype=torch.uint8)
        senders_rank.fill_pattern_range(part, start, torch.cat([block, block]))
        assert torch.equal(part, whole[start : start + length]), (start, length)


@pytest.mark.multiprocess
def test_a_run_past_its_deadline_raises_and_leaves_no_process_behind():
    config = senders.SendersConfig(preset="tiny", senders=2, receivers=2, repeats=1, timeout_s=0.05)
    with pytest.raises(TimeoutError, match="did not finish"):
        senders.run_senders(config)
    assert multiprocessing.active_children() == []


def test_senders_refuses_the_other_benchmarks_flags(capsys):
    for extra in (["--delta"], ["--nodes", "2"], ["--methods", "floor"], ["--trace"], ["--device-transfer"]):
        with pytest.raises(SystemExit, match="--senders does not take"):
            cli.main(["bench", "--preset", "tiny", "--senders", "2", "--receivers", "2", *extra])
    with pytest.raises(SystemExit):
        cli.main(["bench", "--preset", "tiny", "--senders", "0"])
    with pytest.raises(ValueError, match="receivers"):
        senders.SendersConfig(preset="tiny", receivers=0)


@pytest.mark.multiprocess
def test_a_megatron_shaped_layout_sends_each_ranks_blocks_and_the_receiver_is_bit_exact(capsys):
    """--senders 4 --tp 2: TP=2 x PP=2 ranks holding row and column blocks and replicated
    norms (hal.tools.bench.senders_megatron); every rank's bytes checked against the layout."""
    from hal.tools.bench.senders_megatron import expected_megatron_shares, megatron_held

    config = senders.SendersConfig(preset="tiny", senders=4, receivers=1, methods=("sharded",), repeats=1, warmup=0, timeout_s=240, tp=2)
    report = senders.run_senders(config)
    params = presets.get_preset("tiny").params()
    expected = expected_megatron_shares(params, 2, 2)
    assert report["layout"] == "megatron tp=2 pp=2"
    check = report["results"][0]["share_check"]
    assert check["plan_bytes_per_rank"] == expected and sum(expected) == report["bytes"]
    assert check["sent_bytes_per_rank"] == [[b] for b in expected]
    assert report["results"][0]["verified_syncs_per_receiver"] == [1]
    # column shares among them: rank 1 holds o_proj's and down_proj's second half of columns
    held = {h.param.name: h for h in megatron_held(params, 2, 2, 1)}
    o = held["model.layers.0.self_attn.o_proj.weight"]
    assert o.offsets == (0, o.param.shape[1] // 2) and o.block == (o.param.shape[0], o.param.shape[1] // 2)
    assert "model.embed_tokens.weight" in held and not any(n.startswith("model.layers.1.") for n in held)  # stage 0: layer 0 of 2
    assert "blocks, and its rows of its stage's norms" in senders.format_table(report)


def test_the_megatron_shaped_shares_count_blocks_and_half_of_each_norm():
    from hal.tools.bench.senders_megatron import expected_megatron_shares

    params = presets.get_preset("tiny").params()
    model = sum(p.nbytes for p in params)
    assert sum(expected_megatron_shares(params, 2, 1)) == model
    shares = expected_megatron_shares(params, 2, 1)
    assert shares[0] == shares[1]  # tiny's dimensions all divide by 2
    with pytest.raises(ValueError, match="tp must divide senders"):
        senders.SendersConfig(preset="tiny", senders=3, tp=2)
