"""What a device runtime leaves in /dev/shm for a process is removed when that process ends
(hal.backends.process_files): at a normal end, also as a multiprocessing child (which
ends with os._exit), and by hal.procs for ranks that were killed."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from hal.backends.process_files import SHM_DIR, _remove_own_files, remove_at_exit
from hal.procs import remove_ended_process_files
from hal.backends.cuda import CudaBackend
from hal.procs import spawn_ranks

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm here")

# The names the runtimes give them (seen on an H200): the driver's, the pid in hex; torch's counters.
def _driver_file(pid: int) -> Path:
    return Path(SHM_DIR, f"cuda.shm.{os.getuid()}.{pid:x}.1")


def _torch_file(pid: int) -> Path:
    return Path(SHM_DIR, f"torch_{pid}_12345_0")


def _make_files_then(rank: int, out, how: str) -> None:
    pid = os.getpid()
    _driver_file(pid).touch()
    _torch_file(pid).touch()
    if how == "register":
        remove_at_exit(CudaBackend.process_files)
    out.put((rank, "ok", pid))
    if how == "killed":
        out.close()
        out.join_thread()  # the report is on its way: then die without running any exit code
        os.kill(pid, signal.SIGKILL)


def _left(pid: int) -> list[str]:
    return sorted(p.name for p in (_driver_file(pid), _torch_file(pid)) if p.exists())


def test_the_cuda_backend_declares_the_drivers_file_of_a_process():
    assert [f.format(pid=0x2A3) for f in CudaBackend.process_files] == ["cuda.shm.*.2a3.*"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["register", "plain", "killed"])
def test_a_rank_leaves_nothing_in_dev_shm(how):
    """A child that exported device memory registered the removal (`register`, as
    TorchDeviceBackend.export_ipc does): its driver file goes at its end. torch's counters
    (never removed under os._exit) and everything of a killed child go when spawn_ranks
    has joined it."""
    [pid] = spawn_ranks(_make_files_then, 1, args=(how,), timeout_s=60)
    assert _left(pid) == []


def test_remove_ended_process_files_takes_only_that_pids_files():
    mine, other = os.getpid(), os.getpid() + 1_000_000  # no such process
    files = [_driver_file(other), _torch_file(other), _driver_file(mine), Path(SHM_DIR, f"cuda.shm.0.{other:x}0.1")]
    for f in files:
        f.touch()
    try:
        removed = remove_ended_process_files([other])
        assert sorted(removed) == sorted([files[0].name, files[1].name])
        assert [f.exists() for f in files] == [False, False, True, True]  # not a live pid's, not a longer pid's
    finally:
        for f in files:
            f.unlink(missing_ok=True)


def test_the_exit_removal_acts_only_in_the_process_that_registered_it():
    """A child forked by hand inherits multiprocessing's finalizers: at its exit it must not
    remove the live parent's files."""
    parent = os.getpid() + 1_000_000  # stands for the registering process, seen from a child
    f = _driver_file(parent)
    f.touch()
    try:
        _remove_own_files(parent, CudaBackend.process_files)
        assert f.exists()
        _remove_own_files(os.getpid(), CudaBackend.process_files)  # its own: nothing of the other's
        assert f.exists()
    finally:
        f.unlink(missing_ok=True)
