"""hal.engine_processes: what an engine's processes leave in /dev/shm is gone after a stop,
and nothing else is touched.

Each test starts a small process tree (a parent and a child, as vLLM's engine core and its
worker) in which the processes create and map files in /dev/shm the way vLLM's message
queue and CPU communicator do, then kills it the hard way (SIGKILL: no process gets to
unlink anything) and checks what `EngineProcesses.release` removes and keeps.
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from hal.engine_processes import EngineProcesses, ShmName, held_anywhere

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists() or not Path("/dev/shm").is_dir(), reason="needs Linux /proc and /dev/shm")

# A parent that maps `argv[1]` and starts a child mapping `argv[2]` (created if missing,
# 1 MiB each), prints "ready" once both are mapped, then sleeps; with "stubborn" both
# ignore SIGTERM (as a worker stuck in a collective would not exit on request).
_TREE = textwrap.dedent(
    """
    import mmap, os, signal, subprocess, sys, time
    def hold(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 1 << 20)
        return mmap.mmap(fd, 1 << 20)
    if "stubborn" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.argv[1] == "child":
        m = hold(sys.argv[2])
        print("ready", flush=True)
        time.sleep(600)
    m = hold(sys.argv[1])
    child = subprocess.Popen([sys.executable, __file__, "child", *sys.argv[2:]], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def shm_paths():
    """Fresh /dev/shm paths for a test; whatever is left of them is removed afterwards."""
    made: list[str] = []

    def new() -> str:
        path = f"/dev/shm/hal-test-{uuid.uuid4().hex[:12]}"
        made.append(path)
        return path

    yield new
    for path in made:
        Path(path).unlink(missing_ok=True)


@pytest.fixture
def start_tree(tmp_path):
    """Start a parent+child tree mapping the given paths; returns (parent Popen, child pid).
    Every process started is killed at the end whatever happened."""
    script = tmp_path / "tree.py"
    script.write_text(_TREE)
    started: list[tuple[subprocess.Popen, int]] = []

    def start(parent_path: str, child_path: str, *flags: str) -> tuple[subprocess.Popen, int]:
        proc = subprocess.Popen([sys.executable, str(script), parent_path, child_path, *flags], stdout=subprocess.PIPE, text=True)
        child = int(proc.stdout.readline())
        started.append((proc, child))
        return proc, child

    yield start
    for proc, child in started:
        for pid in (child, proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=10)


def _running(pid: int) -> bool:
    """Exists and is no zombie (an orphan killed here stays a zombie until its new parent reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def _kill(*pids: int) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def test_a_killed_tree_leaves_nothing_of_what_it_mapped(shm_paths, start_tree):
    parent_path, child_path = shm_paths(), shm_paths()
    proc, child = start_tree(parent_path, child_path)
    engine = EngineProcesses.record([proc.pid])

    assert {p.pid for p in engine.processes} == {proc.pid, child}
    assert {n.path for n in engine.names} == {parent_path, child_path}
    _kill(proc.pid, child)
    proc.wait(timeout=10)
    assert Path(parent_path).exists() and Path(child_path).exists()  # SIGKILL unlinks nothing

    assert sorted(engine.release(grace_s=5)) == sorted([parent_path, child_path])
    assert not Path(parent_path).exists() and not Path(child_path).exists()


def test_a_process_dead_before_the_stop_is_released_from_the_record_made_while_it_ran(shm_paths, start_tree):
    # a vLLM worker that died mid-sync: at the stop its names are in no live process, so only
    # the record made while it ran knows them (vllm internals.record_llm_processes)
    parent_path, child_path = shm_paths(), shm_paths()
    proc, child = start_tree(parent_path, child_path)
    while_running = EngineProcesses.record([proc.pid])
    _kill(child)
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:  # SIGKILL lands asynchronously
        time.sleep(0.01)
    at_stop = EngineProcesses.record([proc.pid])
    assert {n.path for n in at_stop.names} == {parent_path}  # the dead child's name: found by no one now
    engine = while_running.merged(at_stop)
    assert sorted(p.pid for p in engine.processes) == sorted({proc.pid, child})
    _kill(proc.pid)
    proc.wait(timeout=10)
    assert sorted(engine.release(grace_s=5)) == sorted([parent_path, child_path])


def test_processes_left_running_after_the_stop_are_killed_first(shm_paths, start_tree):
    # the parent is killed (as vLLM kills its engine core); its child ignores SIGTERM and
    # would run on, orphaned, holding its mapping: release kills it, then unlinks
    parent_path, child_path = shm_paths(), shm_paths()
    proc, child = start_tree(parent_path, child_path, "stubborn")
    engine = EngineProcesses.record([proc.pid])
    _kill(proc.pid)
    proc.wait(timeout=10)
    os.kill(child, signal.SIGTERM)  # ignored

    started = time.monotonic()
    unlinked = engine.release(grace_s=1)

    assert time.monotonic() - started < 10
    assert not _running(child)
    assert sorted(unlinked) == sorted([parent_path, child_path])


def test_a_name_another_live_process_holds_is_kept(shm_paths, start_tree):
    shared, own = shm_paths(), shm_paths()
    proc, child = start_tree(shared, own)
    fd = os.open(shared, os.O_RDWR)  # this process (not the engine's) maps it too
    held = mmap.mmap(fd, 1 << 20)
    try:
        engine = EngineProcesses.record([proc.pid])
        _kill(proc.pid, child)
        proc.wait(timeout=10)

        assert engine.release(grace_s=5) == [own]
        assert Path(shared).exists()
        assert ShmName(shared, os.fstat(fd).st_ino) in held_anywhere()
    finally:
        held.close()
        os.close(fd)


def test_a_name_reused_for_another_file_is_kept(shm_paths, start_tree):
    parent_path, child_path = shm_paths(), shm_paths()
    proc, child = start_tree(parent_path, child_path)
    engine = EngineProcesses.record([proc.pid])
    _kill(proc.pid, child)
    proc.wait(timeout=10)
    os.unlink(child_path)  # its owner unlinked it and someone else made a file of that name
    Path(child_path).write_bytes(b"not the engine's")

    assert engine.release(grace_s=5) == [parent_path]
    assert Path(child_path).read_bytes() == b"not the engine's"


def test_the_callers_own_process_is_never_recorded(shm_paths):
    path = shm_paths()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    held = mmap.mmap(fd, 4096)
    try:
        engine = EngineProcesses.record([os.getpid()])
        assert engine.processes == [] and engine.names == set()
        assert engine.release(grace_s=0.1) == []
        assert Path(path).exists()
    finally:
        held.close()
        os.close(fd)


def test_nothing_recorded_for_processes_already_gone():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    engine = EngineProcesses.record([proc.pid])
    assert engine.processes == [] and engine.release(grace_s=0.1) == []
