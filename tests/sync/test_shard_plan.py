"""The M-to-N plan from the trainer ranks' declarations (hal.sync.shard_plan), from metadata alone."""

from __future__ import annotations

import pytest
import torch

from hal.sync import SpecMismatchError
from hal.sync.errors import HeaderError
from hal.sync.shard_plan import (
    SHARD0,
    WHOLE,
    Declared,
    build_shard_plan,
    chunk_rows,
    covering,
    decode_declared,
    declared_digest,
    encode_declared,
    parse_shard_name,
    shard_name,
)
from hal.sync.plan import TensorSpec
from tests.multiproc import run_group


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 7, 8, 300, 301])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_rows_are_split_as_torch_chunk_splits_them(rows, parts):
    chunks = torch.arange(rows).chunk(parts) if rows else ()
    expected = [(int(c[0]), int(c[-1]) + 1) for c in chunks if c.numel()]
    got = [chunk_rows(rows, parts, i) for i in range(parts)]
    assert [r for r in got if r[1] > r[0]] == expected


def d(name, shape, kind=WHOLE, dtype=torch.float32):
    return Declared(name, tuple(shape), dtype, kind)


def test_shards_replicated_and_pipeline_owned_tensors_each_go_once_in_one_order():
    rank0 = [d("embed", (300, 32), SHARD0), d("norm", (32,)), d("stage0.w", (5, 4)), d("scale", ())]
    rank1 = [d("embed", (300, 32), SHARD0), d("norm", (32,)), d("stage1.w", (6, 4)), d("scale", ())]
    plan = build_shard_plan([rank0, rank1])
    assert [s.name for s in plan.specs] == ["embed", "norm", "stage0.w", "scale", "stage1.w"]
    mine = [[(s.spec.name, s.lo, s.hi) for s in shares] for shares in plan.shares]
    assert mine[0] == [("embed", 0, 150), ("norm", 0, 16), ("stage0.w", 0, 5)]
    # the 0-d tensor goes whole from one holder, chosen by its place in the order
    assert mine[1] == [("embed", 150, 300), ("norm", 16, 32), ("scale", 0, 1), ("stage1.w", 0, 6)]
    assert plan.shares[1][0].wire == TensorSpec("embed@150", (150, 32), torch.float32)
    assert plan.bytes_of(0) + plan.bytes_of(1) == plan.total_bytes
    assert not covering((s.spec, s.lo, s.hi) for shares in plan.shares for s in shares)


def test_a_rank_with_fewer_rows_than_ranks_sends_nothing_of_that_tensor():
    plan = build_shard_plan([[d("b", (3,), SHARD0)] for _ in range(4)])
    assert [len(s) for s in plan.shares] == [1, 1, 1, 0]
    assert [(s[0].lo, s[0].hi) for s in plan.shares[:3]] == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize(
    "rank1, expected",
    [
        ([d("w", (8, 4), SHARD0)], r"'v': sharded over the trainer group but not declared by trainer rank\(s\) \[1\]"),
        ([d("w", (8, 5), SHARD0), d("v", (4,), SHARD0)], r"'w': trainer rank 0 holds shard0 \(8, 4\) torch.float32, rank 1 holds shard0 \(8, 5\)"),
        ([d("w", (8, 4), SHARD0, torch.bfloat16), d("v", (4,), SHARD0)], r"'w': .* rank 1 holds shard0 \(8, 4\) torch.bfloat16"),
        ([d("w", (8, 4)), d("v", (4,), SHARD0)], r"'w': trainer rank 0 holds shard0 .* rank 1 holds whole"),
    ],
)
def test_declarations_that_do_not_fit_are_refused_naming_the_parameter_and_the_ranks(rank1, expected):
    rank0 = [d("w", (8, 4), SHARD0), d("v", (4,), SHARD0)]
    with pytest.raises(SpecMismatchError, match=expected):
        build_shard_plan([rank0, rank1])


def test_a_name_declared_twice_is_refused():
    with pytest.raises(SpecMismatchError, match=r"'w' is declared twice by trainer rank 0"):
        build_shard_plan([[d("w", (2,)), d("w", (2,))]])


def test_declarations_travel_as_json_and_unreadable_ones_are_refused_by_rank():
    declared = [d("a.b", (3, 2), SHARD0, torch.bfloat16), d("s", ())]
    assert decode_declared(encode_declared(declared), 1) == declared
    assert declared_digest(declared) == declared_digest(list(declared))
    assert declared_digest(declared) != declared_digest(declared[:1])
    for bad in (b"not json", b'[["w", [2], "Tensor", "whole"]]', b'[["w", [2], "float32", "diagonal"]]', b'[["w"]]'):
        with pytest.raises(HeaderError, match="trainer rank 3's declaration"):
            decode_declared(bad, 3)


@pytest.mark.parametrize("name", ["w@0", "model.layers.0.mlp.w@150", "a@b@7"])
def test_share_names_round_trip(name):
    base, row = name.rsplit("@", 1)
    assert parse_shard_name(name) == (base, int(row)) and shard_name(base, int(row)) == name


@pytest.mark.parametrize("name", ["w", "w@", "@3", "w@-1", "w@01", "w@x"])
def test_names_that_are_no_share_are_refused(name):
    with pytest.raises(ValueError, match="is not a share's name"):
        parse_shard_name(name)


def test_covering_finds_missing_and_twice_sent_rows():
    spec = TensorSpec("w", (10, 2), torch.float32)
    assert covering([(spec, 0, 5), (spec, 5, 10)]) == []
    assert covering([(spec, 0, 5)]) == ["parameter 'w': rows 5..10 missing"]
    assert covering([(spec, 0, 6), (spec, 5, 10)]) == ["parameter 'w': rows 6..5 sent twice"]
    assert covering([(spec, 0, 4), (spec, 5, 10)]) == ["parameter 'w': rows 4..5 missing"]


def _placements_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hal.sync.shard_plan import declare

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24.0).reshape(6, 4)
    out = {}
    out["shard0"] = [x.kind for x in declare([("w", distribute_tensor(full, mesh, [Shard(0)]))], rank, world)]
    out["replicate"] = [x.kind for x in declare([("w", distribute_tensor(full, mesh, [Replicate()]))], rank, world)]
    for label, tensor, r, w in (
        ("shard1", distribute_tensor(full, mesh, [Shard(1)]), rank, world),
        ("other group", distribute_tensor(full, mesh, [Shard(0)]), rank, world + 1),
    ):
        try:
            declare([("w", tensor)], r, w)
            out[label] = "accepted"
        except ValueError as exc:
            out[label] = str(exc)
    dist.barrier()
    return out


def test_dtensor_placements_declare_their_kind_and_others_are_refused_by_name():
    for out in run_group(_placements_worker, 2, timeout=120):
        assert out["shard0"] == [SHARD0] and out["replicate"] == [WHOLE]
        assert "parameter 'w': placement Shard(dim=1) is not supported" in out["shard1"]
        assert "sharded over a mesh of 2 ranks" in out["other group"] and "the trainer group has 3 ranks" in out["other group"]
