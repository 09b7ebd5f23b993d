"""A process whose sync failed exits cleanly: exit status 0, and nothing from C++ at exit.

Issue 18 saw `terminate called without an active exception` at the exit of a process after
a failed sync. The cause (a C++ backtrace under gdb): a gloo worker thread dropped the last
reference to a finished collective's work, whose tensor Python had already let go of, so
the thread took the GIL to release it; while the interpreter shut down that ended the
thread inside a destructor, and the process aborted. It happened after any sync, failed or
not, in about a third of the exits that followed a sync at once. hal's channels now keep
their last collectives' work objects (`GroupChannel.keep`), so the Python side lets go
last.

The ranks here are plain interpreters that exit the ordinary way (not the test runner's
forked ranks, which leave through `os._exit` and would hide it), after a sync that failed
in the trainer's source, in the engine's apply, or because the other rank was killed
mid-sync; each case runs three times, since the race is decided at each exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hal.procs import free_port
from tests.multiproc import run_group

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]

RANK = textwrap.dedent(
    """
    import datetime, os, signal, sys
    import torch.distributed as dist
    from hal.sync import BroadcastTransport, IpcTransport, Receiver, Sender, SinkPolicy, SyncConfig, SyncError, TensorSource, copy_into
    from tests.sync.test_failures import FailingSource, fail_points, specs, weights

    rank, port, kind, how = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    transport = {"broadcast": BroadcastTransport, "ipc": IpcTransport}[kind](None, src=0)
    segment = 4096 if kind == "broadcast" else None
    config = SyncConfig(bucket_bytes=16 * 1024, segment_bytes=segment, verify=True, timeout_s=20)


    class KilledAt(TensorSource):
        def __iter__(self):
            for i, pair in enumerate(self.pairs):
                if i == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                yield pair


    class FailingApply:
        policy = SinkPolicy()

        def destination(self, name):
            return None

        def apply(self, pairs):
            raise RuntimeError("the engine's apply failed")

        def abort(self):
            pass


    try:
        if rank == 0:
            sender = Sender(transport, config)
            sender.send(TensorSource(weights(1)), version=1)
            source = {"source": FailingSource(weights(2), fail_points(segment, True)[2]), "apply": TensorSource(weights(2)),
                      "killed": KilledAt(weights(2))}[how]
            sender.send(source, version=2)
        else:
            held = {n: t.clone() for n, t in weights(0)}
            receiver = Receiver(transport, specs())
            receiver.receive(copy_into(held))
            receiver.receive(FailingApply() if how == "apply" else copy_into(held))
        print("completed")
    except SyncError as exc:
        print("failed:", type(exc).__name__)
    """
)


@pytest.mark.parametrize("kind", ["broadcast", "ipc"])
@pytest.mark.parametrize("how", ["source", "apply", "killed"])
def test_a_failed_sync_ends_in_a_clean_exit(kind, how, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    for _ in range(3):
        _run_pair(script, kind, how)


def _run_pair(script: Path, kind: str, how: str) -> None:
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "VERL_DEVICE": "cpu"}
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(r), port, kind, how], env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outputs = []
    try:
        for proc in ranks:
            out, err = proc.communicate(timeout=120)
            outputs.append((proc.returncode, out, err))
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    survivors = [1] if how == "killed" else [0, 1]
    if how == "killed":
        assert outputs[0][0] == -9, outputs[0]
    for r in survivors:
        code, out, err = outputs[r]
        assert code == 0, f"rank {r} exited with {code}:\n{err[-3000:]}"
        assert "failed:" in out, f"rank {r} did not see the sync fail: {out!r}"
        assert "terminate called" not in err and "Traceback" not in err, f"rank {r} at exit:\n{err[-3000:]}"


def kept_past_exit_worker(rank, world):
    import sys

    import torch

    from hal.sync.wire import channel as protocol
    from hal.sync.wire import kept_works

    channel = protocol.GroupChannel()
    with channel.bounded(30):
        for _ in range(6):
            channel.allreduce(torch.zeros(1), "probe")
    [kept] = [k for k in kept_works._EVERY]
    works = kept.works()
    before = [sys.getrefcount(w) for w in works]
    kept_works.hold_past_exit()  # what the interpreter runs at exit
    after = [sys.getrefcount(w) for w in works]
    return len(works), [a - b for a, b in zip(after, before)]


def test_at_exit_the_last_collectives_work_is_never_freed_by_python():
    """The exit hook takes one more reference to each channel's kept works, which nothing
    gives back: a gloo thread's late release of a work can never be its last (the race
    above, once in 19 fresh-clone runs under load and once in CI; too rare to show here, so
    this checks the hook does what it must: tests/sync/wire/test_kept_works.py checks which
    works are kept)."""
    [(count, added)] = run_group(kept_past_exit_worker, 1, timeout=60)
    assert count == 6 and added == [1] * 6
