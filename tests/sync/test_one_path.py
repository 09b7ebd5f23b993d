"""One path for one sender and for many (issue 26): the files of hal a sync runs through,
recorded by a profile hook on every thread of every rank while one sync runs, from the
sending call to the engine's sink. The M-to-N sync runs the one-sender sync's files, and
adds only what is M-to-N (docs/design.md, "One path for one sender and for many", has the
counts; a new file on either path is a reason to look at that section again)."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
import torch.distributed as dist

import hal
from tests.multiproc import run_group

pytestmark = [pytest.mark.multiprocess, pytest.mark.cpu]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(hal.__file__)))
# What an M-to-N sync may cross beyond the one-sender sync's files.
M_TO_N_ONLY = {
    "hal/sync/send/sharded.py", "hal/sync/receive/sharded.py", "hal/sync/receive/every_sender.py", "hal/sync/receive/assembly.py",
    "hal/sync/config.py",
    "hal/sync/plan/shards.py", "hal/sync/plan/declare.py",
}
ONE_SENDER_FILES, M_TO_N_FILES = 26, 33  # as docs/design.md says


def traced(fn) -> list[str]:
    seen: set[str] = set()

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(ROOT + os.sep + "hal" + os.sep):
            seen.add(os.path.relpath(frame.f_code.co_filename, ROOT).replace(os.sep, "/"))

    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return sorted(seen)


def one_sender_worker(rank, world):
    from hal.sync import BroadcastTransport, Receiver, Sender, SyncConfig, TensorSource, TensorSpec, copy_into

    with hal.use("cpu"):
        pairs = [(f"w{i}", torch.full((64,), float(i))) for i in range(8)]
        transport = BroadcastTransport(None, src=0)
        if rank == 0:
            sender = Sender(transport, SyncConfig(bucket_bytes=1 << 20, timeout_s=30))
            return traced(lambda: sender.send(TensorSource(pairs), version=1))
        weights = {n: torch.zeros(64) for n, _ in pairs}
        receiver = Receiver(transport, [TensorSpec.of(n, t) for n, t in weights.items()], timeout_s=30)
        return traced(lambda: receiver.receive(copy_into(weights)))


def many_senders_worker(rank, world):
    from torch.distributed.tensor import DeviceMesh, DTensor, Shard

    from hal.sync import BroadcastTransport, ShardedReceiver, ShardedSender, SyncConfig, TensorSpec, copy_into

    with hal.use("cpu"):
        trainers, shape = 2, (8, 64)
        trainer_group = dist.new_group(list(range(trainers)))
        groups = [dist.new_group([t, trainers]) for t in range(trainers)]  # each trainer rank with the engine worker
        if rank < trainers:
            mesh = DeviceMesh.from_group(trainer_group, "cpu")
            rows = torch.full(shape, 1.0)[rank * 4 : (rank + 1) * 4]
            tensors = [(f"w{i}", DTensor.from_local(rows.clone(), mesh, [Shard(0)], shape=shape, stride=(64, 1))) for i in range(4)]
            sender = ShardedSender(BroadcastTransport(groups[rank], src=0), config=SyncConfig(bucket_bytes=1 << 20, timeout_s=30), trainer_group=trainer_group)
            return traced(lambda: sender.sync(tensors, version=1))
        weights = {f"w{i}": torch.zeros(shape) for i in range(4)}
        receiver = ShardedReceiver([BroadcastTransport(g, src=0) for g in groups], [TensorSpec.of(n, t) for n, t in weights.items()], timeout_s=30)
        files = traced(lambda: receiver.receive(copy_into(weights)))
        assert all(torch.equal(t, torch.ones(shape)) for t in weights.values())
        return files


def test_an_m_to_n_sync_runs_the_one_sender_sync_and_only_what_is_m_to_n():
    one = run_group(one_sender_worker, 2, timeout=180)
    many = run_group(many_senders_worker, 3, timeout=180)
    one_files, many_files = set(one[0]) | set(one[1]), set().union(*map(set, many))
    assert one_files <= many_files, f"the M-to-N sync skips {sorted(one_files - many_files)} of the one-sender path"
    assert many_files - one_files <= M_TO_N_ONLY, f"the M-to-N sync crosses {sorted(many_files - one_files - M_TO_N_ONLY)} besides"
    # each sending rank runs the core sender, the engine worker the core receiver
    assert all("hal/sync/send/sender.py" in files for files in many[:2]) and "hal/sync/receive/receiver.py" in many[2]
    counts = (len(one_files), len(many_files))
    assert counts[0] <= ONE_SENDER_FILES and counts[1] <= M_TO_N_FILES, f"{counts} files: update docs/design.md's counts"
