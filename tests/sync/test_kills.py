"""A rank SIGKILLed in the middle of a sync leaves nothing behind, and the others stop.

The sender dies after the header (as it gathers its first tensor) or in the middle of a
bucket; a receiver dies as its first destination is asked for or while it applies; in
`ipc` syncs (shared memory) and hierarchical ones (a node leader serving its followers
through shared memory). Afterwards: every other rank raised a `SyncError` within the
timeout, every engine tensor still holds its old or its new bytes, no process of those
ranks or of their children is alive, and no shared-memory file of theirs is anywhere
(hal's shared memory has no name: hal.backends.cpu).
"""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest
import torch

import hal
from hal.sync import HierarchicalTransport, IpcTransport, Receiver, Sender, SyncConfig, SyncError, TensorSource, copy_into
from hal.sync.sink import SinkPolicy
from tests.multiproc import RankError, run_group
from tests.sync.test_failures import classify, fail_points, specs, weights

pytestmark = pytest.mark.multiprocess

BUCKET = 16 * 1024
TIMEOUT_S = 15.0


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KilledSource(TensorSource):
    """The trainer's tensors, with the process killed as it reaches `kill_at`."""

    def __init__(self, pairs, kill_at: str) -> None:
        super().__init__(pairs)
        self.kill_at = kill_at

    def __iter__(self):
        for name, tensor in self.pairs:
            if name == self.kill_at:
                _die()
            yield name, tensor


class KilledSink:
    """`copy_into(held)`, with the process killed at the first `destination` or `apply`."""

    policy = SinkPolicy()

    def __init__(self, held: dict[str, torch.Tensor], at: str) -> None:
        self.inner = copy_into(held)
        self.at = at

    def destination(self, name):
        if self.at == "destination":
            _die()
        return self.inner.destination(name)

    def apply(self, pairs):
        if self.at == "apply":
            _die()
        self.inner.apply(pairs)

    def abort(self):
        self.inner.abort()


def _children() -> list[int]:
    found = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(path) as f:
                found += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return found


def kill_worker(rank, world, backend, transport_kind, nodes, victim, point, pid_dir):
    with open(os.path.join(pid_dir, f"rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if nodes:
        os.environ["VERL_HAL_NODE"] = nodes[rank]
    with hal.use(backend):
        kind = {"ipc": IpcTransport, "hier": HierarchicalTransport}[transport_kind]
        transport = kind(None, src=0)
        config = SyncConfig(bucket_bytes=BUCKET, timeout_s=TIMEOUT_S)
        if rank == 0:
            sender = Sender(transport, config)
            sender.send(TensorSource(weights(1)), version=1)
            source = KilledSource(weights(2), point) if victim == 0 else TensorSource(weights(2))
            start = time.monotonic()
            try:
                sender.send(source, version=2)
                outcome = "sent"
            except SyncError as exc:
                outcome = type(exc).__name__
            return {"outcome": outcome, "seconds": time.monotonic() - start, "children": _children()}
        held = {n: torch.zeros_like(t) for n, t in weights(0)}
        receiver = Receiver(transport, specs())
        receiver.receive(copy_into(held))
        sink = KilledSink(held, point) if rank == victim else copy_into(held)
        start = time.monotonic()
        try:
            receiver.receive(sink)
            outcome = "received"
        except SyncError as exc:
            outcome = type(exc).__name__
        return {"outcome": outcome, "seconds": time.monotonic() - start, "held": classify(held), "children": _children()}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


# (transport, nodes or None, victim rank, where it dies)
MID_BUCKET = fail_points(None, False)[2]
FIRST = specs()[0].name
IPC = ("ipc", None)
HIER = ("hier", ("trainer", "a", "a", "a"))  # rank 1 leads node a and serves 2 and 3 through shared memory
SCENARIOS = [
    (*IPC, 0, FIRST), (*IPC, 0, MID_BUCKET), (*IPC, 1, "destination"), (*IPC, 2, "apply"),
    (*HIER, 0, FIRST), (*HIER, 0, MID_BUCKET), (*HIER, 1, "destination"), (*HIER, 1, "apply"), (*HIER, 3, "apply"),
]


def _id(case) -> str:
    transport, _, victim, point = case
    return f"{transport}-rank{victim}-{'after-header' if point == FIRST else 'mid-bucket' if point == MID_BUCKET else point}"


@pytest.mark.parametrize(
    "backend,transport,nodes,victim,point",
    [("cpu", *s) for s in SCENARIOS] + [("sim", *s) for s in SCENARIOS if s[2] in (0, 1)],
    ids=[f"cpu-{_id(s)}" for s in SCENARIOS] + [f"sim-{_id(s)}" for s in SCENARIOS if s[2] in (0, 1)],
)
def test_a_killed_rank_leaves_nothing_and_every_other_rank_stops(backend, transport, nodes, victim, point, tmp_path):
    world = len(nodes) if nodes else 3
    results = run_group(
        kill_worker, world, args=(backend, transport, nodes, victim, point, str(tmp_path)),
        timeout=120, collective_timeout=TIMEOUT_S, allow_failure=True,
    )
    assert isinstance(results[victim], RankError) and "exit code -9" in results[victim], results[victim]
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        assert not isinstance(result, RankError), f"rank {rank} failed instead of raising a SyncError:\n{result}"
        assert result["outcome"] not in ("sent", "received"), (rank, result)
        assert result["seconds"] < 3 * TIMEOUT_S, (rank, result)
        if rank != 0:
            assert "OTHER" not in result["held"].values(), (rank, result["held"])
    pids = [int((tmp_path / f"rank{r}").read_text()) for r in range(world)]
    children = [c for r in results if not isinstance(r, RankError) for c in r["children"]]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids + children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids + children if _alive(p)], "a rank or a child of one outlived the test"
    for pid in pids:
        assert not glob.glob(f"/dev/shm/verl-hal-{pid}-*"), f"rank pid {pid} left shared-memory files"
