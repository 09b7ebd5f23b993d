"""The suite's own check that it leaves /dev/shm as it found it (tests/conftest.py) fails a
run that leaves a file there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this machine")
def test_a_run_that_leaves_a_file_in_dev_shm_fails(tmp_path):
    leftover = Path("/dev/shm") / f"hal-shm-check-{uuid.uuid4().hex[:12]}"
    (tmp_path / "conftest.py").write_text((
        "from tests.conftest import (  # noqa: F401\n"
        "    pytest_configure, pytest_runtest_logfinish, pytest_runtest_logstart, pytest_sessionfinish, pytest_sessionstart,\n"
        ")\n"
    ))
    (tmp_path / "test_leaks.py").write_text(textwrap.dedent(f"""
        def test_leaves_a_file():
            open({str(leftover)!r}, "w").close()
        """))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )
    finally:
        leftover.unlink(missing_ok=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(rf"left \d+ file\(s\) in /dev/shm: .*{leftover.name}", done.stdout), done.stdout
    # and it names the test that was running when the file was written
    assert re.search(rf"{leftover.name}: last written .* while: .*test_leaks.py::test_leaves_a_file", done.stdout), done.stdout


def test_a_file_is_traced_to_the_test_that_wrote_it_despite_the_coarse_file_clock(tmp_path):
    from tests.conftest import _running_at

    timeline = tmp_path / "timeline.log"
    timeline.write_text("100.000 start a.py::one\n101.000 end a.py::one\n102.000 start a.py::two\n103.000 end a.py::two\n")
    # a file written at once by a test can look a few ms older than the test's start
    assert _running_at(timeline, 99.996) == ["a.py::one"]
    assert _running_at(timeline, 102.5) == ["a.py::two"]
    assert _running_at(timeline, 101.6) == ["(after) a.py::one"]
    assert _running_at(timeline, 50.0) == []


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this machine")
def test_a_file_another_program_holds_is_not_this_runs_leftover(tmp_path):
    """On a shared machine other sessions make /dev/shm files (multiprocessing's sem.mp-*, an
    engine's segments) while a run goes on: one that a live process outside the run holds is
    in use, not left behind. A file nobody holds is still counted, as is one this run's own
    process holds."""
    import signal
    import time

    from tests.conftest import _held_elsewhere

    foreign, orphan, mine = (Path("/dev/shm") / f"hal-shm-check-{uuid.uuid4().hex[:12]}" for _ in range(3))
    ready = tmp_path / "pid"
    # a process outside this run: detached (its parent exits at once), so init adopts it;
    # it writes its pid when it holds the file, and is ended by that pid
    holder = textwrap.dedent(f"""
        import os, time
        if os.fork():
            os._exit(0)
        os.setsid()
        f = open({str(foreign)!r}, "w")
        with open({str(ready) + ".tmp"!r}, "w") as out:
            out.write(str(os.getpid()))
        os.replace({str(ready) + ".tmp"!r}, {str(ready)!r})
        time.sleep(60)
        """)
    subprocess.run([sys.executable, "-c", holder], check=True, timeout=30)
    pid = None
    try:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int(ready.read_text())
        orphan.write_text("")
        with open(mine, "w"):
            assert _held_elsewhere([foreign.name, orphan.name, mine.name]) == {foreign.name}
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        for path in (foreign, orphan, mine):
            path.unlink(missing_ok=True)
