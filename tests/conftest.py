"""Shared test fixtures and helpers. What other test modules may use:

Fixtures
    hal_reset        Forget hal's backend resolution before and after the test and unset
                     VERL_DEVICE, so the test sees a fresh process's view. Use
                     `monkeypatch.setenv("VERL_DEVICE", ...)` inside the test to choose.
    sim_backend      A fresh `sim` backend with 20 ms injected latency per stream operation;
                     its streams are synchronized at teardown (an error left there fails).
    (autouse) no_process_left_behind
                     After each test module, every multiprocessing child this process
                     started must have exited (waited for up to 20 s); one that has not
                     is killed and the module's last test errors, naming the process.
    fake_torch_npu   A directory holding a fake `torch_npu` package (see FAKE_TORCH_NPU);
                     put it on PYTHONPATH of a *subprocess* only: it renames PrivateUse1 to
                     "npu" for the rest of that process.

Helpers
    BACKEND_PARAMS   pytest.param list over every built-in backend: cpu and sim always run,
                     cuda / npu carry their marker and skip (with the reason) without hardware.
    HARDWARE_PARAMS  the cuda and npu entries of BACKEND_PARAMS alone: for a test that the
                     cpu lane already runs on cpu and sim, again on the accelerator.
    run_python(code, env=None, timeout=120)
                     Run `code` in a fresh interpreter of this venv; returns CompletedProcess
                     (text, stdout/stderr captured). `env` entries are added to a copy of
                     os.environ without VERL_DEVICE; a value of None removes that variable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import hal
from hal.backends.cuda import CudaBackend
from hal.backends.npu import NpuBackend

REPO_ROOT = Path(__file__).resolve().parent.parent


def _hardware_param(name: str, cls: type) -> object:
    reason = cls.unavailable_reason()
    marks = [getattr(pytest.mark, name)]
    if reason is not None:
        marks.append(pytest.mark.skip(reason=f"{name} backend not usable here: {reason}"))
    return pytest.param(name, marks=marks, id=name)


# Asked once at collection: cheap (no device context beyond is_available()).
BACKEND_PARAMS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("sim", id="sim"),
    _hardware_param("cuda", CudaBackend),
    _hardware_param("npu", NpuBackend),
]
HARDWARE_PARAMS = BACKEND_PARAMS[2:]


@pytest.fixture
def hal_reset(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("VERL_DEVICE", raising=False)
    hal.reset()
    yield
    hal.reset()


_REPORTED_CHILDREN: set[int] = set()


@pytest.fixture(scope="module", autouse=True)
def no_process_left_behind(request: pytest.FixtureRequest):
    # Tests that check for leftovers (test_bench, test_ray) would otherwise blame whichever
    # module happened to run after the one that leaked (a vLLM EngineCore, say). A child
    # reaped behind multiprocessing's back (os.waitpid, psutil.wait_procs) stays listed as
    # alive for good: that is reported too, once, since later checks would fail on it.
    import multiprocessing
    import time

    yield
    deadline = time.monotonic() + 20.0
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [c for c in multiprocessing.active_children() if c.pid not in _REPORTED_CHILDREN]
    for child in left:
        _REPORTED_CHILDREN.add(child.pid)
        child.kill()
        child.join(timeout=5)
    if left:
        names = ", ".join(f"{c.name} (pid {c.pid})" for c in left)
        pytest.fail(f"{request.module.__name__} left process(es) behind, or reaped them behind multiprocessing's back: {names}", pytrace=False)


@pytest.fixture
def sim_backend():
    from hal.backends.sim import SimBackend

    backend = SimBackend(latency=0.02)
    yield backend
    backend.synchronize()


# A stand-in for torch_npu on a machine without CANN: enough of a device module for
# names, resolution and dispatch (tensors cannot be allocated on it). The knobs are
# environment variables so that one file serves every scenario.
FAKE_TORCH_NPU = textwrap.dedent(
    '''
    """Fake torch_npu for tests: registers a device module as torch.npu."""
    import os
    import types

    import torch

    if os.environ.get("FAKE_NPU_IMPORT_ERROR"):
        raise OSError(os.environ["FAKE_NPU_IMPORT_ERROR"])

    npu = types.ModuleType("fake_torch_npu_device_module")
    calls = []  # what hal asked of the fake, in order, for assertions
    _current = [0]

    def _log(name, *args):
        calls.append((name, *args))

    npu.calls = calls
    npu.is_available = lambda: os.environ.get("FAKE_NPU_AVAILABLE", "1") == "1"
    npu.device_count = lambda: int(os.environ.get("FAKE_NPU_COUNT", "2"))
    npu.current_device = lambda: _current[0]

    def set_device(device):  # torch_npu's parameter names (tests/hosts/ checks them)
        _log("set_device", device)
        _current[0] = device

    npu.set_device = set_device
    npu._is_in_bad_fork = lambda: False
    npu.manual_seed_all = lambda seed: _log("manual_seed_all", seed)
    npu.synchronize = lambda device=None: _log("synchronize")
    npu.empty_cache = lambda: _log("empty_cache")
    npu.mem_get_info = lambda device=None: (3 * 2**30, 64 * 2**30)

    torch.utils.rename_privateuse1_backend("npu")
    torch._register_device_module("npu", npu)
    torch.utils.generate_methods_for_privateuse1_backend()
    '''
)


@pytest.fixture
def fake_torch_npu(tmp_path: Path) -> Path:
    package = tmp_path / "fake_npu" / "torch_npu"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_TORCH_NPU)
    return package.parent


def run_python(code: str, env: dict[str, str | None] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "VERL_DEVICE"}
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    # The child imports the tests package and hal from this checkout.
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (full_env.get("PYTHONPATH"), str(REPO_ROOT)) if p)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---- the suite leaves /dev/shm as it found it ------------------------------------------
# A killed or failed rank must leave no shared-memory file (hal's own shared memory has no
# name at all: hal.backends.cpu). The controlling pytest process (not an xdist worker)
# lists /dev/shm at the start and fails the run if anything new is left at the end.
_SHM = Path("/dev/shm")


def _shm_entries() -> set[str]:
    return set(os.listdir(_SHM)) if _SHM.is_dir() else set()


# Which tests ran when, so that a file left in /dev/shm can be traced to the tests that
# were running when it was last written (every process of one run appends to one file:
# xdist workers are children of the controlling process).
def _timeline(config: pytest.Config) -> Path:
    owner = os.getppid() if hasattr(config, "workerinput") else os.getpid()
    return Path(f"/tmp/hal-test-timeline-{owner}.log")


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    _mark("start", nodeid)


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    _mark("end", nodeid)


_TIMELINE: Path | None = None


def _mark(what: str, nodeid: str) -> None:
    if _TIMELINE is not None:
        with open(_TIMELINE, "a") as f:
            f.write(f"{time.time():.3f} {what} {nodeid}\n")


def pytest_configure(config: pytest.Config) -> None:
    global _TIMELINE
    _TIMELINE = _timeline(config)
    if not hasattr(config, "workerinput"):
        _TIMELINE.unlink(missing_ok=True)


def _running_at(timeline: Path, when: float) -> list[str]:
    """The tests that were running at `when` (or the last one to end before it). A file's
    times come from the kernel's coarse clock, up to a few ms behind `time.time()`: a file
    a test writes at once can look older than the test's start, hence the slack."""
    slack = 0.25
    try:
        lines = timeline.read_text().splitlines()
    except OSError:
        return []
    started: dict[str, float] = {}
    spans: list[tuple[float, float, str]] = []
    for line in lines:
        stamp, what, nodeid = line.split(" ", 2)
        if what == "start":
            started[nodeid] = float(stamp)
        elif nodeid in started:
            spans.append((started.pop(nodeid), float(stamp), nodeid))
    spans += [(start, float("inf"), nodeid) for nodeid, start in started.items()]
    running = sorted({nodeid for start, end, nodeid in spans if start - slack <= when <= end + slack})
    if running:
        return running
    before = [(end, nodeid) for _, end, nodeid in spans if end < when]
    return [f"(after) {max(before)[1]}"] if before else []


def _held_elsewhere(names: list[str]) -> set[str]:
    """The names among `names` that a live process outside this run maps or holds open: another
    program's, in use, not left behind by this run (on a shared machine other sessions' test
    runs make `sem.mp-*` and engines' files while this one runs). A name held by this run's
    own processes (this one and its descendants), or by none, is this run's leftover."""
    proc = Path("/proc")
    parent: dict[int, int] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                text = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(text[text.rfind(")") + 2 :].split()[1])
    ours = {os.getpid()}
    for pid in sorted(parent):  # a process is ours when one of its ancestors is this one
        chain, cursor = [], pid
        while cursor in parent and cursor not in ours and cursor not in chain and cursor > 1:
            chain.append(cursor)
            cursor = parent[cursor]
        if cursor in ours:
            ours.update(chain)
    wanted = {f"/dev/shm/{name}": name for name in names}
    held: set[str] = set()
    for pid in parent.keys() - ours:
        try:
            paths = [line.split(None, 5)[-1] for line in (proc / str(pid) / "maps").read_text().splitlines()]
            paths += [os.readlink(fd) for fd in (proc / str(pid) / "fd").iterdir()]
        except OSError:
            continue
        held |= {wanted[p] for p in paths if p in wanted}
    return held


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):
        session.config._hal_shm_before = _shm_entries()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = getattr(session.config, "_hal_shm_before", None)
    if before is None:
        return
    # processes that end with the run (xdist workers, their fork servers and semaphores)
    # may still be on their way out: give them a moment
    deadline = time.monotonic() + (15 if getattr(session.config.option, "numprocesses", None) else 2)
    while (left := sorted(_shm_entries() - before)) and time.monotonic() < deadline:
        time.sleep(0.5)
    elsewhere = _held_elsewhere(left)
    if elsewhere:
        print(f"in /dev/shm, held by processes outside this test run (not counted): {', '.join(sorted(elsewhere))}",
              file=sys.stderr)
        left = [name for name in left if name not in elsewhere]
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"the test run left {len(left)} file(s) in /dev/shm: {', '.join(left[:10])}"]
        for name in left[:10]:
            try:
                written = (_SHM / name).stat().st_mtime
            except OSError:
                continue
            tests = _running_at(_timeline(session.config), written)
            lines.append(f"  {name}: last written {time.strftime('%H:%M:%S', time.gmtime(written))} UTC, while: {'; '.join(tests) or 'no test'}")
        for line in lines:
            if reporter is not None:
                reporter.write_line(line, red=True)
            else:
                print(line, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
