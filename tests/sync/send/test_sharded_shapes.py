"""Three trainer ranks send the shapes a user meets, bit for bit, into one engine worker.

Four spawned processes on gloo: trainer ranks 0, 1 and 2 (one trainer group) each have a
sync group of their own with engine worker 3. Each case is one model of parameters
(FSDP2 `fully_shard`, one module per dtype), plain `distribute_tensor` DTensors
(`Shard(0)` or `Replicate()`) and module buffers, synced twice: once into a receiver
that knows the engine's tensors and writes into them, once into a fresh receiver that
knows nothing and hands views to a callable sink. Every tensor must arrive with its
exact bytes (floats compared as integers: NaN payloads, -0 and subnormals included),
each trainer rank must send exactly its plan's share (the rows `torch.chunk` gives it),
and the shares must add up to the model's bytes. M = 3 does not divide most row counts,
so some ranks hold fewer rows than others, or none. First, without processes: what one
trainer rank yields for its shares of an empty tensor, and its refusal of a shard of another shape.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from hal.sync import SyncConfig, SyncError, TensorSpec, copy_into
from hal.sync.plan import SHARD0, build_shard_plan
from hal.sync.plan.shards import WHOLE, Declared
from hal.sync.send.sharded import _Shares
from tests.multiproc import run_group

TIMEOUT_S = 10.0
BUCKET = 4096  # the smallest a SyncConfig takes: the big tensors' shares are several buckets each
SENDERS = 3
ENGINE = SENDERS  # the engine worker's world rank

# How a trainer rank holds a tensor: a parameter of an FSDP2 module, a plain DTensor, a buffer
FSDP2, DT_SHARD0, DT_REPLICATE, BUFFER = "fsdp2", "dtensor shard0", "dtensor replicate", "buffer"

# bf16 and fp16 bit patterns a sync must not touch: NaNs with distinct payloads (quiet and
# signalling, either sign), +0 and -0, +inf and -inf, the smallest and largest subnormals
SPECIAL_BITS = {
    torch.bfloat16: [0x7FC0, 0x7FC1, 0x7F81, 0x7FFF, 0xFFC3, 0xFF81, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x007F, 0x8001],
    torch.float16: [0x7E00, 0x7E01, 0x7C01, 0x7FFF, 0xFE55, 0xFC01, 0x0000, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x83FF, 0x03FF, 0x8001],
}
INT16 = {dtype: [b - 0x10000 if b >= 0x8000 else b for b in bits] for dtype, bits in SPECIAL_BITS.items()}


def _special(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits (many of them NaNs of every payload) with every special pattern in the first rows."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, generator=g)
    special = torch.tensor(INT16[dtype], dtype=torch.int16)
    bits.view(-1)[: special.numel()] = special
    return bits.view(dtype)


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# FSDP2 gives every rank a (0, 0) shard of a (3, 0) parameter, distribute_tensor (1, 0); a
# plain or Replicate() tensor is (3, 0) itself
@pytest.mark.parametrize("kind, local_shape", [(SHARD0, (0, 0)), (SHARD0, (1, 0)), (SHARD0, (3, 0)), (WHOLE, (3, 0))])
def test_an_empty_tensor_is_sent_with_its_global_shape_whatever_the_local_shard(kind, local_shape):
    declared = [Declared("w", (3, 0), torch.bfloat16, kind), Declared("v", (6, 2), torch.float32, kind)]
    plan = build_shard_plan([declared] * SENDERS)
    owners = [r for r in range(SENDERS) if any(s.spec.name == "w" for s in plan.shares[r])]
    assert len(owners) == 1 and plan.bytes_of(owners[0]) == 2 * 2 * 4  # v's rows; w has no bytes
    tensors = {"w": torch.empty(local_shape, dtype=torch.bfloat16), "v": torch.arange(12.0).reshape(6, 2)}
    if kind == SHARD0:
        tensors["v"] = tensors["v"][2 * owners[0] : 2 * owners[0] + 2]
    shares = dict(_Shares(plan, owners[0], tensors))
    assert shares["w@0"].shape == (3, 0) and shares["w@0"].dtype == torch.bfloat16
    assert torch.equal(shares[f"v@{2 * owners[0]}"], torch.arange(12.0).reshape(6, 2)[2 * owners[0] : 2 * owners[0] + 2])


def test_a_shard_of_another_shape_is_refused_naming_the_parameter_and_the_rank():
    plan = build_shard_plan([[Declared("w", (7, 2), torch.float32, SHARD0)]] * SENDERS)
    with pytest.raises(ValueError, match=r"parameter 'w': trainer rank 2's shard has shape \(3, 2\), the Shard\(0\) layout gives it rows 6..7 \(\(1, 2\)\)"):
        list(_Shares(plan, 2, {"w": torch.zeros(3, 2)}))


def case_tensors(case: str) -> list[tuple[str, str, torch.Tensor]]:
    """(name, how the trainer holds it, the whole tensor) in the order the trainers list them;
    the same on every rank (fixed seeds)."""
    if case == "empty":
        return [
            ("f32.empty", FSDP2, torch.empty(3, 0)),  # FSDP2 gives every rank a (0, 0) shard
            ("f32.no_rows", FSDP2, torch.empty(0, 4)),
            ("f32.rows7", FSDP2, _randn(7, 2, seed=1)),
            ("d_empty", DT_SHARD0, torch.empty(3, 0)),  # distribute_tensor gives every rank (1, 0)
            ("d_empty_bf16", DT_SHARD0, torch.empty(3, 0, 2, dtype=torch.bfloat16)),
            ("r_empty", DT_REPLICATE, torch.empty(3, 0)),
            ("b_empty", BUFFER, torch.empty(2, 0, dtype=torch.int64)),
            ("b_scalar", BUFFER, torch.tensor(-7, dtype=torch.int64)),
        ]
    if case == "rows":
        return [
            ("f32.rows7", FSDP2, _randn(7, 5, seed=1)),  # 3, 3, 1 rows
            ("f32.rows2", FSDP2, _randn(2, 3, seed=2)),  # 1, 1, none
            ("f32.rows1", FSDP2, _randn(1, 4, seed=3)),  # 1, none, none
            ("f32.vector7", FSDP2, _randn(7, seed=4)),
            ("f32.big", FSDP2, _randn(301, 32, seed=5)),  # 101 rows of 128 bytes a share: > a bucket
            ("d_rows7", DT_SHARD0, _randn(7, 3, seed=6)),
            ("d_rows1", DT_SHARD0, _randn(1, 6, seed=7)),
            ("d_big", DT_SHARD0, _randn(100, 50, seed=8)),
            ("b_big", BUFFER, _randn(64, 100, seed=9)),  # replicated on every rank: split in three
        ]
    if case == "bits":
        return [
            ("bf16.w", FSDP2, _special((7, 16), torch.bfloat16, 1)),
            ("bf16.big", FSDP2, _special((200, 40), torch.bfloat16, 2)),
            ("f16.w", FSDP2, _special((7, 16), torch.float16, 3)),
            ("f16.v", FSDP2, _special((2, 9), torch.float16, 4)),
            ("d_bf16", DT_SHARD0, _special((5, 7), torch.bfloat16, 5)),
            ("r_f16", DT_REPLICATE, _special((7, 3), torch.float16, 6)),
            ("b_bf16", BUFFER, _special((1, 20), torch.bfloat16, 7)),
        ]
    if case == "buffers":
        extremes = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 2**32, -(2**31) - 1], dtype=torch.int64)
        return [
            ("f32.w", FSDP2, _randn(7, 2, seed=1)),
            ("b_steps", BUFFER, extremes),
            ("b_ids", BUFFER, torch.arange(-10, 20, dtype=torch.int64).reshape(10, 3) * (2**40 + 1)),
            ("b_transposed", BUFFER, torch.arange(28, dtype=torch.int64).reshape(4, 7).t()),  # (7, 4), not contiguous
            ("b_transposed_f32", BUFFER, _randn(3, 5, seed=2).t()),  # (5, 3), not contiguous
            ("b_count", BUFFER, torch.tensor(2**62 + 3, dtype=torch.int64)),  # 0-d: one rank sends it
            ("r_rows7", DT_REPLICATE, _randn(7, 3, seed=3)),
            ("r_rows1", DT_REPLICATE, _randn(1, 5, seed=4)),
            ("r_scalar", DT_REPLICATE, torch.tensor(1.5)),
            ("r_int64", DT_REPLICATE, torch.arange(5, dtype=torch.int64) - 2**60),
        ]
    raise ValueError(f"no case {case!r}")


def raw(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes in row-major order (plain data: a tensor cannot leave a child)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def from_raw(data: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape) if data else torch.empty(shape, dtype=dtype)


def _holder(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    module = torch.nn.Module()
    for name, tensor in tensors.items():
        module.register_parameter(name, torch.nn.Parameter(tensor.clone(), requires_grad=False))
    return module


def trainer_source(case: str, trainer_group: object) -> list[tuple[str, torch.Tensor]]:
    """This rank's tensors in `case_tensors` order: FSDP2 parameters (a module of their own per
    dtype, as fully_shard needs), DTensors over the trainer group, the root's buffers."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = DeviceMesh.from_group(trainer_group, "cpu")
    entries = case_tensors(case)
    model = torch.nn.Module()
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, how, tensor in entries:
        if how == FSDP2:
            module, _, leaf = name.partition(".")
            groups.setdefault(module, {})[leaf] = tensor
        elif how == BUFFER:
            model.register_buffer(name, tensor.clone())  # clone keeps a transposed tensor's strides
    for module, tensors in groups.items():
        model.add_module(module, fully_shard(_holder(tensors), mesh=mesh))
    held = dict(model.named_parameters()) | dict(model.named_buffers())
    out = []
    for name, how, tensor in entries:
        if how == DT_SHARD0:
            out.append((name, distribute_tensor(tensor.clone(), mesh, [Shard(0)])))
        elif how == DT_REPLICATE:
            out.append((name, distribute_tensor(tensor.clone(), mesh, [Replicate()])))
        else:
            out.append((name, held[name]))
    return out


def shapes_worker(rank: int, world: int, case: str) -> object:
    import hal

    with hal.use("cpu"):
        return _shapes_worker(rank, case)


def _shapes_worker(rank: int, case: str) -> object:
    from hal.sync import BroadcastTransport
    from hal.sync.receive import ShardedReceiver
    from hal.sync.send import ShardedSender

    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    trainer_group = dist.new_group(list(range(SENDERS)), timeout=timeout)
    sync_groups = [dist.new_group([r, ENGINE], timeout=timeout) for r in range(SENDERS)]
    # every rank set up before the first sync, whose waits are TIMEOUT_S: building the
    # trainers' DTensors can take longer than that on a loaded machine
    set_up = dist.new_group(timeout=datetime.timedelta(seconds=120))
    if rank < SENDERS:
        source = trainer_source(case, trainer_group)
        local = {n: (tuple(t.to_local().shape), t.to_local().is_contiguous()) if hasattr(t, "to_local") else (tuple(t.shape), t.is_contiguous()) for n, t in source}
        dist.barrier(group=set_up)
        config = SyncConfig(bucket_bytes=BUCKET, segment_bytes=BUCKET, timeout_s=TIMEOUT_S)
        sender = ShardedSender(BroadcastTransport(sync_groups[rank], src=0), config=config, trainer_group=trainer_group)
        results = []
        for version in (1, 2):
            try:
                metrics = sender.sync(source, version=version)
                plan = sender.plan
                mine = [(s.spec.name, s.lo, s.hi) for s in plan.shares[rank]]
                results.append(("ok", metrics.bytes, metrics.model_bytes, plan.bytes_of(rank), mine))
            except SyncError as exc:
                results.append((type(exc).__name__, str(exc)[:600]))
        return {"local": local, "syncs": results}
    specs = [TensorSpec(name, tuple(t.shape), t.dtype) for name, _, t in case_tensors(case)]
    transports = [BroadcastTransport(g, src=0) for g in sync_groups]
    dist.barrier(group=set_up)
    results = []
    # version 1: a receiver that knows the engine's tensors writes into them
    weights = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs}
    sink = copy_into(weights)
    handed: dict[str, tuple] = {}
    real_apply = sink.apply

    def apply(pairs, real_apply=real_apply):
        handed.update((n, (tuple(t.shape), t.dtype)) for n, t in pairs)
        real_apply(pairs)

    sink.apply = apply
    results.append(_receive(ShardedReceiver(transports, specs, timeout_s=TIMEOUT_S), sink, handed, lambda: weights))
    # version 2: a fresh receiver without specs (the shapes come from the shares) and no destinations
    got: dict[str, torch.Tensor] = {}

    def keep(pairs):
        for n, t in pairs:  # a view, valid during the call only
            handed[n] = (tuple(t.shape), t.dtype)
            got[n] = t.clone()

    handed = {}
    results.append(_receive(ShardedReceiver(transports, None, timeout_s=TIMEOUT_S), keep, handed, lambda: got))
    return {"syncs": results}


def _receive(receiver, sink, handed, held) -> tuple:
    try:
        metrics = receiver.receive(sink)
    except SyncError as exc:
        return (type(exc).__name__, str(exc)[:600])
    tensors = {n: (tuple(t.shape), str(t.dtype), raw(t)) for n, t in held().items()}
    return ("ok", receiver.version, metrics.bytes, {n: (shape, str(dtype)) for n, (shape, dtype) in handed.items()}, tensors)


def run_case(case: str) -> tuple[list[dict], dict]:
    results = run_group(shapes_worker, SENDERS + 1, args=(case,), timeout=180, collective_timeout=TIMEOUT_S)
    return results[:SENDERS], results[ENGINE]


def check_case(case: str, trainers: list[dict], engine: dict) -> None:
    """Every sync ok on every rank, each rank sent exactly its rows, the engine holds every tensor bit for bit."""
    entries = case_tensors(case)
    total = sum(t.numel() * t.element_size() for _, _, t in entries)
    for step in range(2):
        outcomes = [trainer["syncs"][step] for trainer in trainers]
        for rank, outcome in enumerate(outcomes):
            assert outcome[0] == "ok", f"sync {step + 1}, trainer rank {rank}: {outcome}"
        sent = [outcome[1] for outcome in outcomes]
        assert [outcome[3] for outcome in outcomes] == sent, "a rank sent other than its plan's share"
        assert sum(sent) == total and all(outcome[2] == total for outcome in outcomes), (sent, total)
        shares: dict[str, list[tuple[int, int, int]]] = {}
        for rank, outcome in enumerate(outcomes):
            for name, lo, hi in outcome[4]:
                shares.setdefault(name, []).append((rank, lo, hi))
        for name, _, tensor in entries:
            if tensor.dim() and tensor.numel():  # the rows torch.chunk gives each rank: FSDP2's split
                chunks = torch.arange(tensor.shape[0]).chunk(SENDERS)
                assert shares[name] == [(r, int(c[0]), int(c[-1]) + 1) for r, c in enumerate(chunks) if c.numel()], name
            else:  # a 0-d or empty tensor: whole, from one rank
                assert len(shares[name]) == 1 and shares[name][0][1:] == (0, tensor.shape[0] if tensor.dim() else 1), (name, shares[name])
        received = engine["syncs"][step]
        assert received[0] == "ok", f"sync {step + 1}, engine: {received}"
        _, version, nbytes, handed, tensors = received
        assert (version, nbytes) == (step + 1, total)
        for name, _, want in entries:
            assert handed[name] == (tuple(want.shape), str(want.dtype)), f"sync {step + 1}: {name!r} handed to the sink as {handed[name]}"
            shape, dtype, data = tensors[name]
            assert (shape, dtype) == (tuple(want.shape), str(want.dtype)), name
            assert data == raw(want), f"sync {step + 1}: {name!r} differs from the trainer's bytes"


@pytest.mark.multiprocess
def test_empty_parameters_and_dtensors_go_whole_from_one_rank_with_their_global_shape():
    trainers, engine = run_case("empty")
    # what the trainer ranks held of the empty tensors: not the global shape, so nothing of
    # an empty tensor's local shard may be read
    for trainer in trainers:
        assert trainer["local"]["f32.empty"][0] == (0, 0) and trainer["local"]["d_empty"][0] == (1, 0)
    check_case("empty", trainers, engine)


@pytest.mark.multiprocess
def test_rows_not_divisible_by_three_and_shares_larger_than_a_bucket():
    trainers, engine = run_case("rows")
    check_case("rows", trainers, engine)


@pytest.mark.multiprocess
def test_bf16_and_fp16_nan_payloads_signed_zeros_infinities_and_subnormals_arrive_bit_exact():
    trainers, engine = run_case("bits")
    check_case("bits", trainers, engine)
    for step in range(2):
        tensors = engine["syncs"][step][4]
        for name, _, want in case_tensors("bits"):
            shape, _, data = tensors[name]
            got = from_raw(data, shape, want.dtype)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name
            # every special pattern made it, as the integer it is (NaN != NaN as a float)
            assert got.view(torch.int16).reshape(-1)[: len(INT16[want.dtype])].tolist() == INT16[want.dtype], name


@pytest.mark.multiprocess
def test_int64_buffers_transposed_buffers_and_replicated_dtensors():
    trainers, engine = run_case("buffers")
    assert trainers[0]["local"]["b_transposed"] == ((7, 4), False)  # the buffer stayed transposed
    check_case("buffers", trainers, engine)
