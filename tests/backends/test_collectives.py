"""Collectives through torch.distributed with the resolved backend's own backend string.

Two spawned processes, each joining a group with `hal.current().dist_backend_string()`
(gloo on the cpu backend); every collective waits with a timeout, the whole run has a
deadline, and no child process outlives a test.
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import pytest

from tests.multiproc import RankError, free_port, run_group

pytestmark = pytest.mark.multiprocess

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)


def _join(rank: int, world_size: int, port: int, timeout: datetime.timedelta):
    import torch.distributed as dist

    import hal

    backend = hal.current()
    dist.init_process_group(
        backend.dist_backend_string(),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    return backend, dist


def collectives_worker(rank: int, world_size: int, port: int) -> dict:
    import torch

    backend, dist = _join(rank, world_size, port, COLLECTIVE_TIMEOUT)
    try:
        device = backend.device()
        out = {"hal_backend": backend.name, "group_backend": str(dist.get_backend())}

        payload = torch.arange(6, dtype=torch.bfloat16, device=device) if rank == 0 else torch.zeros(6, dtype=torch.bfloat16, device=device)
        dist.broadcast(payload, src=0, async_op=True).wait(timeout=COLLECTIVE_TIMEOUT)
        out["broadcast"] = payload.float().tolist()

        gathered = [torch.empty(2, dtype=torch.int64, device=device) for _ in range(world_size)]
        mine = torch.tensor([rank, 10 * rank], dtype=torch.int64, device=device)
        dist.all_gather(gathered, mine, async_op=True).wait(timeout=COLLECTIVE_TIMEOUT)
        out["all_gather"] = [t.tolist() for t in gathered]

        total = torch.full((3,), float(rank + 1), device=device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, async_op=True).wait(timeout=COLLECTIVE_TIMEOUT)
        out["all_reduce"] = total.tolist()
        return out
    finally:
        dist.destroy_process_group()


def lonely_all_reduce_worker(rank: int, world_size: int, port: int, seconds: float) -> str:
    """Rank 0 calls all_reduce; rank 1 never does, but stays alive past the timeout."""
    import torch

    _, dist = _join(rank, world_size, port, datetime.timedelta(seconds=seconds))
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(4), async_op=True).wait(timeout=datetime.timedelta(seconds=seconds))
            return "all_reduce returned without its peer"
        time.sleep(seconds + 5)
        return "idle"
    finally:
        dist.destroy_process_group()


def sleeper(rank: int, world_size: int, seconds: float) -> None:
    time.sleep(seconds)


def _children() -> set[int]:
    """Live child processes of this one, except multiprocessing's own resource tracker and
    fork server (hal.procs forks ranks from it; it lives as long as this process)."""
    pids = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue
    alive = set()
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"resource_tracker" in cmdline or b"forkserver" in cmdline or state == "Z":
            continue
        alive.add(pid)
    return alive


@pytest.fixture
def no_leftover_processes():
    before = _children()
    yield
    left = _children() - before
    assert not left, f"child processes left behind: {sorted(left)}"


def test_broadcast_all_gather_all_reduce(no_leftover_processes):
    results = run_group(
        collectives_worker, 2, args=(free_port(),), init_process_group=False, timeout=180, env={"VERL_DEVICE": "cpu"}
    )
    for rank, out in enumerate(results):
        assert out["hal_backend"] == "cpu", rank
        assert out["group_backend"] == "gloo", rank
        assert out["broadcast"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], rank
        assert out["all_gather"] == [[0, 0], [1, 10]], rank
        assert out["all_reduce"] == [3.0, 3.0, 3.0], rank


def test_collective_without_its_peer_times_out(no_leftover_processes):
    results = run_group(
        lonely_all_reduce_worker,
        2,
        args=(free_port(), 3.0),
        init_process_group=False,
        timeout=180,
        env={"VERL_DEVICE": "cpu"},
        allow_failure=True,
    )
    assert isinstance(results[0], RankError), results[0]
    assert "timed out" in results[0].lower() or "timeout" in results[0].lower(), results[0]
    assert results[1] == "idle"


def test_hung_rank_is_killed_at_the_deadline(no_leftover_processes):
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 8 s"):
        run_group(sleeper, 2, args=(600,), init_process_group=False, timeout=8)


def fails_first(rank, world, marker, message):
    """Raises `message` on the first attempt (rank 0, while `marker` does not exist), then returns the attempt count."""
    path = Path(marker)
    attempts = int(path.read_text()) if path.exists() else 0
    if rank == 0:
        path.write_text(str(attempts + 1))
        if attempts == 0:
            raise RuntimeError(message)
    return attempts + 1


@pytest.mark.parametrize("allow_failure", [False, True])
def test_a_failed_rendezvous_is_made_again_once_and_nothing_else_is(tmp_path, allow_failure):
    flake = "in init_process_group: Gloo connectFullMesh failed with ... Connection closed by peer"
    results = run_group(fails_first, 2, args=(str(tmp_path / "a"), flake), init_process_group=False, allow_failure=allow_failure)
    assert results[0] == 2  # the second attempt ran, on a fresh group
    # any other failure stands at once: the test sees it
    other = run_group(fails_first, 2, args=(str(tmp_path / "b"), "a real failure"), init_process_group=False, allow_failure=True)
    assert isinstance(other[0], RankError) and "a real failure" in other[0]
    assert (tmp_path / "b").read_text() == "1"


def test_a_group_whose_rendezvous_port_was_taken_is_made_again_on_a_fresh_port():
    """tests.multiproc.run_group retries once when rank 0 could not listen on the port it
    was given (another process took it between free_port and the listen)."""
    import socket

    import tests.multiproc as multiproc

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = multiproc.free_port
    multiproc.free_port = lambda: next(ports, None) or real()
    try:
        assert multiproc.run_group(_rank_of, 2, timeout=120) == [0, 1]
    finally:
        multiproc.free_port = real
        taken.close()


def _rank_of(rank, world):
    import torch.distributed as dist

    return dist.get_rank()
