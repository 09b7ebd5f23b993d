"""The M-to-N plan from the trainer ranks' declarations (hal.sync.plan.shards), from metadata alone."""

from __future__ import annotations

import pytest
import torch

from hal.sync import SpecMismatchError
from hal.sync.errors import HeaderError
from hal.sync.plan import BLOCK, SHARD0, Block, build_shard_plan, covering_blocks, declare, parse_block_name
from hal.sync.plan.shards import WHOLE, Declared, chunk_rows, shard_name, tiling_problem
from hal.sync.plan.declare import decode_declared, declared_digest, encode_declared
from hal.sync.spec import TensorSpec
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
    assert not covering_blocks((s.spec, s.offsets, s.wire.shape) for shares in plan.shares for s in shares)


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
    assert parse_block_name(name) == (base, (int(row),)) and shard_name(base, int(row)) == name


@pytest.mark.parametrize("name", ["w", "w@", "@3", "w@-1", "w@01", "w@x"])
def test_names_that_are_no_share_are_refused(name):
    with pytest.raises(ValueError, match="is not a share's name"):
        parse_block_name(name)


def test_covering_finds_missing_and_twice_sent_rows():
    spec = TensorSpec("w", (10, 2), torch.float32)
    assert covering_blocks([(spec, (0, 0), (5, 2)), (spec, (5, 0), (5, 2))]) == []
    assert covering_blocks([(spec, (0, 0), (5, 2))]) == ["parameter 'w': rows 5..10 missing"]
    assert covering_blocks([(spec, (0, 0), (6, 2)), (spec, (5, 0), (5, 2))]) == ["parameter 'w': rows 6..5 sent twice"]
    assert covering_blocks([(spec, (0, 0), (4, 2)), (spec, (5, 0), (5, 2))]) == ["parameter 'w': rows 4..5 missing"]


def _placements_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from hal.sync.plan import declare

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24.0).reshape(6, 4)
    out = {}
    out["shard0"] = [x.kind for x in declare([("w", distribute_tensor(full, mesh, [Shard(0)]))], rank, world)]
    out["replicate"] = [x.kind for x in declare([("w", distribute_tensor(full, mesh, [Replicate()]))], rank, world)]
    shard1 = declare([("w", distribute_tensor(full, mesh, [Shard(1)]))], rank, world)[0]
    out["shard1"] = (shard1.kind, shard1.offsets, shard1.block)
    for label, tensor, r, w in (
        ("partial", DTensor.from_local(full, mesh, [Partial()]), rank, world),
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
    for rank, out in enumerate(run_group(_placements_worker, 2, timeout=120)):
        assert out["shard0"] == [SHARD0] and out["replicate"] == [WHOLE]
        # Shard(1) of (6, 4) over 2 ranks: each holds the two columns torch.chunk gives it
        assert out["shard1"] == (BLOCK, (0, 2 * rank), (6, 2))
        assert "parameter 'w': placement Partial(sum) is not supported" in out["partial"], out["partial"]
        assert "sharded over a mesh of 2 ranks" in out["other group"] and "the trainer group has 3 ranks" in out["other group"]


# ---- blocks: column shares and general contiguous blocks (a Megatron TP rank's, a Shard(1)'s) ----
def blk(name, shape, offsets, block, dtype=torch.float32):
    return Declared(name, tuple(shape), dtype, BLOCK, tuple(offsets), tuple(block))


def test_column_blocks_go_from_their_holders_as_column_shares_and_add_up_to_the_tensor():
    # o_proj (8, 6) split by columns over two TP ranks, the last rank's block narrower
    plan = build_shard_plan([[blk("o", (8, 6), (0, 0), (8, 4))], [blk("o", (8, 6), (0, 4), (8, 2))]])
    (a,), (b,) = plan.shares
    assert (a.offsets, a.wire) == ((0, 0), TensorSpec("o@0", (8, 4), torch.float32))
    assert (b.offsets, b.wire) == ((0, 4), TensorSpec("o@0:4", (8, 2), torch.float32))
    assert plan.bytes_of(0) == 8 * 4 * 4 and plan.bytes_of(1) == 8 * 2 * 4 and plan.bytes_of(0) + plan.bytes_of(1) == plan.total_bytes
    assert plan.kinds == (BLOCK,)
    assert covering_blocks((s.spec, s.offsets, s.wire.shape) for shares in plan.shares for s in shares) == []
    # each rank's share is all of its own block
    assert a.local_index() == (slice(0, 8), slice(0, 4)) and b.local_index() == (slice(0, 8), slice(0, 2))


def test_replicas_of_a_block_split_its_rows_and_every_rank_sends_a_quarter():
    # TP=2 x DP=2: ranks 0 and 2 hold columns 0..4, ranks 1 and 3 columns 4..8 (data-parallel replicas)
    decl = [[blk("o", (6, 8), (0, 4 * (r % 2)), (6, 4))] for r in range(4)]
    plan = build_shard_plan(decl)
    got = [[(s.offsets, s.wire.shape, s.local_index()) for s in shares] for shares in plan.shares]
    assert got[0] == [((0, 0), (3, 4), (slice(0, 3), slice(0, 4)))]
    assert got[2] == [((3, 0), (3, 4), (slice(3, 6), slice(0, 4)))]
    assert got[1] == [((0, 4), (3, 4), (slice(0, 3), slice(0, 4)))]
    assert got[3] == [((3, 4), (3, 4), (slice(3, 6), slice(0, 4)))]
    assert [plan.bytes_of(r) for r in range(4)] == [plan.total_bytes // 4] * 4
    assert plan.shares[3][0].wire.name == "o@3:4"


def test_row_blocks_of_a_fused_weights_part_and_plain_tensors_share_one_plan():
    # q_proj rows from two TP ranks (cut from their linear_qkv), a norm both hold whole, a pipeline stage's own tensor
    rank0 = [blk("q", (8, 4), (0, 0), (4, 4)), d("norm", (4,)), d("layers.0.w", (2, 2))]
    rank1 = [blk("q", (8, 4), (4, 0), (4, 4)), d("norm", (4,)), d("layers.1.w", (2, 2))]
    plan = build_shard_plan([rank0, rank1])
    assert [[(s.spec.name, s.wire.name) for s in shares] for shares in plan.shares] == [
        [("q", "q@0"), ("norm", "norm@0"), ("layers.0.w", "layers.0.w@0")],
        [("q", "q@4"), ("norm", "norm@2"), ("layers.1.w", "layers.1.w@0")],
    ]
    assert plan.bytes_of(0) + plan.bytes_of(1) == plan.total_bytes


@pytest.mark.parametrize(
    "blocks, expected",
    [
        # a gap: columns 4..6 held by nobody
        ([((0, 0), (8, 4)), ((0, 6), (8, 2))], r"'o': the blocks declared do not tile \(8, 8\) exactly once: 16 of 64 elements missing"),
        # an overlap: columns 3..4 twice
        ([((0, 0), (8, 4)), ((0, 3), (8, 5))], r"'o': .*the blocks at \(0, 0\) of \(8, 4\) and at \(0, 3\) of \(8, 5\) overlap \(declared twice\)"),
        # outside the tensor
        ([((0, 0), (8, 4)), ((0, 4), (8, 6))], r"'o': .*a block of \(8, 6\) at \(0, 4\) does not fit in \(8, 8\)"),
        # row blocks that miss rows are named as rows
        ([((0, 0), (4, 8)), ((5, 0), (3, 8))], r"'o': .*rows 4..5 missing \(ranks \[0\] the block at \(0, 0\) of \(4, 8\); ranks \[1\]"),
    ],
)
def test_blocks_that_do_not_tile_the_tensor_are_refused_naming_it_and_the_ranks(blocks, expected):
    decl = [[blk("o", (8, 8), o, b)] for o, b in blocks]
    with pytest.raises(SpecMismatchError, match=expected):
        build_shard_plan(decl)


def test_a_block_on_one_rank_and_a_whole_tensor_on_another_are_refused():
    with pytest.raises(SpecMismatchError, match=r"'o': trainer rank 0 holds block \(8, 8\) torch.float32, rank 1 holds whole"):
        build_shard_plan([[blk("o", (8, 8), (0, 0), (8, 4))], [d("o", (8, 8))]])


def test_blocks_travel_in_declarations_and_change_the_digest():
    declared = [blk("o", (8, 6), (0, 4), (8, 2)), d("n", (3,)), d("s", (3,), SHARD0)]
    assert decode_declared(encode_declared(declared), 1) == declared
    moved = [blk("o", (8, 6), (0, 2), (8, 2)), *declared[1:]]
    assert declared_digest(declared) != declared_digest(moved)
    # a plain declaration's encoding (and so its digest) is what it was before blocks existed
    assert encode_declared([d("n", (3,))]) == b'[["n",[3],"float32","whole"]]'
    for bad in (b'[["o", [8], "float32", "block"]]', b'[["o", [8], "float32", "whole", [0], [8]]]'):
        with pytest.raises(HeaderError, match="trainer rank 1's declaration"):
            decode_declared(bad, 1)


@pytest.mark.parametrize(
    "offsets, name",
    [((0, 0), "w@0"), ((5, 0), "w@5"), ((0, 64), "w@0:64"), ((3, 4, 0), "w@3:4"), ((0, 0, 7), "w@0:0:7"), ((), "w@0")],
)
def test_block_names_have_one_spelling(offsets, name):
    assert shard_name("w", offsets) == name
    base, parsed = parse_block_name(name)
    assert base == "w" and parsed + (0,) * (len(offsets) - len(parsed)) == (offsets or (0,))


@pytest.mark.parametrize("name", ["w@5:0", "w@0:064", "w@:3", "w@3:", "w@1:x"])
def test_block_names_not_spelled_one_way_are_refused(name):
    with pytest.raises(ValueError, match="is not a share's name"):
        parse_block_name(name)


def test_tiling_of_boxes_finds_gaps_overlaps_and_accepts_a_checkerboard():
    quads = [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))]
    assert tiling_problem((4, 6), quads, "sent") is None
    assert tiling_problem((4, 6), quads[:3], "sent") == "6 of 24 elements missing"
    assert "overlap (sent twice)" in tiling_problem((4, 6), [*quads, ((1, 1), (1, 1))], "sent")
    assert tiling_problem((4, 6), [*quads, ((1, 1), (0, 1))], "sent") is None  # an empty block covers nothing
    # rows, with an empty block among them (a TP rank whose vocab rows are all padding)
    assert tiling_problem((8, 2), [((0, 0), (4, 2)), ((2, 0), (0, 2)), ((4, 0), (4, 2))], "sent") is None
    assert tiling_problem((3, 0), [((0, 0), (3, 0))], "sent") is None  # an empty tensor's one share
    assert tiling_problem((), [((), ())], "sent") is None  # a 0-d tensor: one share


def test_a_block_that_does_not_fit_its_tensor_is_refused_when_made():
    with pytest.raises(ValueError, match=r"a block of shape \(8, 4\) at offsets \(0, 6\) does not fit in a tensor of shape \(8, 8\)"):
        Block(torch.zeros(8, 4), (8, 8), (0, 6))
    with pytest.raises(ValueError, match="does not fit"):
        Block(torch.zeros(8, 4), (8, 8, 1), (0, 0, 0))
    assert declare([("o", Block(torch.zeros(8, 4), (8, 8), (0, 4)))], 0, 2) == [blk("o", (8, 8), (0, 4), (8, 4))]
