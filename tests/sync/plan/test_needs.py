"""A worker's needs as data (hal.sync.plan.needs): boxes from views, destinations, the
coverage check, the JSON it travels as. Pure: no engine (tests/integrations/vllm/test_recording.py
records them from vLLM's loaders)."""

from __future__ import annotations

import math

import pytest
import torch

from hal.sync.errors import HeaderError
from hal.sync.plan.needs import (
    Fill, Need, Target, UnexpressibleLoad, WorkerNeeds, coverage_problems, decode_needs, encode_needs, need_of_copy, view_to_box,
)
from hal.sync.spec import TensorSpec


def geometry(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return t.storage_offset(), tuple(t.shape), tuple(t.stride())


ROOT = torch.empty(6, 8, 4)


@pytest.mark.parametrize("view, box", [
    (ROOT, ((0, 0, 0), (6, 8, 4), ((0,), (1,), (2,)))),
    (ROOT.narrow(0, 2, 3), ((2, 0, 0), (3, 8, 4), ((0,), (1,), (2,)))),  # rows
    (ROOT.narrow(1, 4, 4), ((0, 4, 0), (6, 4, 4), ((0,), (1,), (2,)))),  # a column block: strided
    (ROOT[5], ((5, 0, 0), (1, 8, 4), ((1,), (2,)))),  # one expert of a fused tensor
    (ROOT[1].t(), ((1, 0, 0), (1, 8, 4), ((2,), (1,)))),  # transposed: each view dim walks another
    (ROOT[2:4].reshape(2, 32), ((2, 0, 0), (2, 8, 4), ((0,), (1, 2)))),  # a reshape of whole rows: one dim walks two
    (ROOT.view(-1)[32:96], ((1, 0, 0), (2, 8, 4), ((0, 1, 2),))),
    (ROOT[3, 2, 1].reshape(1), ((3, 2, 1), (1, 1, 1), ((),))),  # one element as a 1-element tensor
])
def test_a_view_of_a_box_is_that_box_and_the_dimensions_it_walks(view, box):
    assert view_to_box(tuple(ROOT.shape), geometry(view)) == box


@pytest.mark.parametrize("view", [
    ROOT[::2],  # a step
    ROOT[:, :1].expand(6, 3, 4),  # a broadcast (stride 0)
    ROOT.view(-1)[4:40],  # wraps around a row
    ROOT.narrow(1, 0, 2).narrow(0, 0, 2).reshape(2, 8)[:, :5],  # a reshape over a partial row, then a cut
])
def test_a_view_that_is_no_box_is_none(view):
    assert view_to_box(tuple(ROOT.shape), geometry(view)) is None


def _replayed(need: Need, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    out = target.clone()
    box = source[tuple(slice(o, o + n) for o, n in zip(need.offsets, need.sizes))]
    out.as_strided(need.sizes, need.dst_strides, need.dst_offset).copy_(box)
    return out


# a loader's view of the checkpoint tensor (4, 6), the parameter's shape, the loader's view of it
COPIES = {
    "rows into rows (qkv, gate_up)": (lambda w: w.narrow(0, 2, 2), (6, 6), lambda p: p.narrow(0, 4, 2)),
    "columns into the whole (row parallel)": (lambda w: w.narrow(1, 3, 3), (4, 3), lambda p: p),
    "transposed (an oriented fused expert)": (lambda w: w.t(), (4, 6), lambda p: p.t()),
    "transposed into a transposed region": (lambda w: w[:, :2].t(), (3, 4, 2), lambda p: p[1].t().t().t()),
    "a reshape of a row block": (lambda w: w[1:3].reshape(-1), (30,), lambda p: p[6:18]),
    "a scalar into one element (0-d reshape(1))": (lambda w: w[1, 2].reshape(1), (3, 3), lambda p: p.view(-1)[5:6]),
    "with a leading 1 on one side": (lambda w: w[0], (3, 6), lambda p: p[2:3]),
}


@pytest.mark.parametrize("kind", COPIES)
def test_a_need_replayed_lands_what_the_copy_landed(kind):
    take, shape, into = COPIES[kind]
    source = torch.arange(24.0).reshape(4, 6) + 1
    target = torch.zeros(shape)
    src, dst = take(source), into(target)
    need = need_of_copy(0, TensorSpec("w", (4, 6), torch.float32), geometry(src), 0, geometry(dst))
    assert isinstance(need, Need), need
    expected = target.clone()
    expected.as_strided(dst.shape, dst.stride(), dst.storage_offset()).copy_(src)
    assert torch.equal(_replayed(need, source, target), expected)
    assert int((expected != 0).sum()) == src.numel()


def test_a_need_narrowed_to_a_piece_lands_that_piece_where_the_whole_would():
    # o_proj under TP: columns 3..6 of the checkpoint tensor land in the whole parameter
    source = torch.arange(24.0).reshape(4, 6)
    target = torch.zeros(4, 3)
    need = need_of_copy(0, TensorSpec("w", (4, 6), torch.float32), geometry(source.narrow(1, 3, 3)), 0, geometry(target))
    whole = _replayed(need, source, target)
    pieces = target.clone()
    for rows in ((0, 1), (1, 3), (3, 4)):  # the rows of three trainer ranks
        offset, shape, strides = need.destination((rows[0], 3), (rows[1] - rows[0], 3))
        pieces.as_strided(shape, strides, offset).copy_(source[rows[0]:rows[1], 3:6])
    assert torch.equal(pieces, whole)


def test_a_broadcasting_copy_or_a_step_is_no_need():
    spec = TensorSpec("w", (4, 6), torch.float32)
    source, target = torch.empty(4, 6), torch.empty(8, 6)
    assert "broadcast" in need_of_copy(0, spec, geometry(source[:2, :3]), 0, geometry(target[:3, :2]))
    assert "not one box" in need_of_copy(0, spec, geometry(source[::2]), 0, geometry(target[:2]))


# ---- coverage -------------------------------------------------------------------------------
SPECS = (TensorSpec("a", (4, 6), torch.float32), TensorSpec("b", (2, 6), torch.float32), TensorSpec("n", (6,), torch.float32))
TARGETS = (Target("layer", "weight", (6, 6)), Target("layer", "bias", (6,)), Target("other", "weight", (3,)))


def rows(tensor: int, lo: int, hi: int, at: int, target: int = 0) -> Need:
    return Need(tensor, (lo, 0), (hi - lo, 6), target, at * 6, (6, 1))


def record(*needs: Need, fills: tuple[Fill, ...] = (), targets=TARGETS) -> WorkerNeeds:
    return WorkerNeeds(0, SPECS, targets, tuple(needs), fills)


BIAS = Need(2, (0,), (6,), 1, 0, (1,))


def test_a_layer_written_exactly_once_passes():
    assert coverage_problems(record(rows(0, 0, 4, 0), rows(1, 0, 2, 4), BIAS)) == []
    # a fill completes it (vLLM zeroes a vocabulary's padded rows)
    assert coverage_problems(record(rows(0, 0, 4, 0), BIAS, fills=(Fill(0, 24, (2, 6), (6, 1), 0.0),))) == []


def test_overlaps_and_holes_are_refused_naming_the_parameter_and_the_writers():
    (twice,) = coverage_problems(record(rows(0, 0, 4, 0), rows(1, 0, 2, 3), BIAS))
    assert twice.startswith("parameter 'layer.weight': rows 3..4, columns 0..6 are written twice")
    assert "checkpoint tensor 'a'" in twice and "checkpoint tensor 'b'" in twice
    (hole,) = coverage_problems(record(rows(0, 0, 4, 0), BIAS))
    assert hole == "parameter 'layer.weight': 12 of 36 elements are written by no loader (rows 4..6, columns 0..6 among them)"
    # a tensor of a touched layer that nothing writes at all
    assert coverage_problems(record(rows(0, 0, 4, 0), rows(1, 0, 2, 4))) == [
        "parameter 'layer.bias': 6 of 6 elements are written by no loader"]


def test_declared_padding_may_stay_unwritten_and_untouched_layers_are_not_checked():
    padded = (Target("layer", "weight", (6, 6), padding=12), TARGETS[1], TARGETS[2])
    assert coverage_problems(record(rows(0, 0, 4, 0), BIAS, targets=padded)) == []
    assert coverage_problems(record(rows(0, 0, 2, 0), BIAS, targets=padded)) != []  # more holes than padding
    # 'other' receives nothing here: another rank's expert, a tied head
    assert all("other" not in p for p in coverage_problems(record(rows(0, 0, 4, 0), rows(1, 0, 2, 4), BIAS)))


def test_a_destination_outside_the_parameter_is_refused():
    problem = coverage_problems(record(rows(0, 0, 4, 3), rows(1, 0, 2, 0), BIAS))[0]
    assert problem == "parameter 'layer.weight': checkpoint tensor 'a' lands in a region that is not a box of (6, 6)"


def test_many_experts_are_checked_in_arrays():
    # a fused w13 of 256 experts, each expert's gate and up rows: 512 boxes
    experts, inter, hidden = 256, 4, 3
    specs = tuple(TensorSpec(f"e{e}.{w}", (inter, hidden), torch.float32) for e in range(experts) for w in ("gate", "up"))
    target = Target("experts", "w13_weight", (experts, 2 * inter, hidden))
    needs = tuple(Need(2 * e + w, (0, 0), (inter, hidden), 0, (e * 2 * inter + w * inter) * hidden, (hidden, 1))
                  for e in range(experts) for w in (0, 1))
    assert coverage_problems(WorkerNeeds(0, specs, (target,), needs)) == []
    broken = needs[:-1] + (Need(0, (0, 0), (inter, hidden), 0, 0, (hidden, 1)),)  # expert 255's up missing, expert 0's gate twice
    problem = " ".join(coverage_problems(WorkerNeeds(0, specs, (target,), broken)))
    assert "written twice" in problem and "e0.gate" in problem


# ---- as it travels --------------------------------------------------------------------------
def test_the_record_travels_as_json_and_comes_back_equal_with_its_digest():
    original = record(rows(0, 0, 4, 0), rows(1, 0, 2, 4), BIAS, fills=(Fill(2, 0, (3,), (1,), -1.5),))
    payload = encode_needs(original)
    assert payload.startswith(b"{") and b"layer" in payload
    back = decode_needs(payload)
    assert back == original and back.digest == original.digest
    assert record(rows(0, 0, 4, 0)).digest != original.digest


def test_a_malformed_record_is_refused_naming_the_worker():
    payload = encode_needs(WorkerNeeds(3, SPECS, TARGETS, (rows(0, 0, 4, 0),))).replace(b'"needs":[[0,0,0,', b'"needs":[[0,9,0,')
    with pytest.raises(HeaderError, match="engine worker 3's record of its needs is unreadable"):
        decode_needs(payload)
    with pytest.raises(HeaderError, match="unreadable"):
        decode_needs(b"not json")


def test_bytes_and_unused_tensors():
    needs = record(rows(0, 0, 4, 0), BIAS)
    assert needs.nbytes == (24 + 6) * 4
    assert needs.unused() == ("b",)
    assert issubclass(UnexpressibleLoad, ValueError)
    assert math.prod(TARGETS[0].shape) == TARGETS[0].numel


def cols(tensor: int, lo: int, hi: int, at: int) -> Need:
    """Columns lo..hi of a (4, 6) tensor into columns at.. of the (6, 6) target's first 4 rows."""
    return Need(tensor, (0, lo), (4, hi - lo), 0, at, (6, 1))


def test_column_blocks_are_counted_on_the_grid_of_their_edges():
    full = (Need(1, (0, 0), (2, 6), 0, 24, (6, 1)), BIAS)  # rows 4..6 from b
    assert coverage_problems(record(cols(0, 0, 3, 0), cols(0, 3, 6, 3), *full)) == []
    (twice,) = coverage_problems(record(cols(0, 0, 4, 0), cols(0, 3, 6, 3), *full))
    assert twice.startswith("parameter 'layer.weight': rows 0..4, columns 3..4 are written twice")
    (hole,) = coverage_problems(record(cols(0, 0, 2, 0), cols(0, 3, 6, 3), *full))
    assert hole == "parameter 'layer.weight': 4 of 36 elements are written by no loader (rows 0..4, columns 2..3 among them)"


def test_workers_of_one_checkpoint_share_its_specs_when_decoded():
    first = decode_needs(encode_needs(record(rows(0, 0, 4, 0))))
    second = decode_needs(encode_needs(record(rows(1, 0, 2, 4))), known=first.specs)
    assert second.specs is first.specs
    assert decode_needs(encode_needs(record(rows(1, 0, 2, 4))), known=SPECS[:2]).specs == SPECS  # not these: its own
