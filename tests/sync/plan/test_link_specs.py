"""An engine worker reads its links from the trainer ranks' headers (hal.sync.plan.link_specs):
the pieces the plan sends it, announced by each rank, read back into the same pieces; and
what would land wrong (a box missing, sent twice, another dtype, a tensor it does not hold,
a piece inside two needs without saying which) refused by name before any byte lands."""

from __future__ import annotations

import pytest
import torch

from hal.sync.errors import SpecMismatchError
from hal.sync.plan.link_specs import link_specs, links_from_headers
from hal.sync.spec import TensorSpec
from tests.sync.receive.fake_layers import plan_of


@pytest.mark.parametrize("senders", [1, 2, 3])
def test_the_headers_give_back_the_plans_links_piece_for_piece(senders):
    plan = plan_of(senders, 2)
    for w in range(2):
        planned = [link_specs(plan, r, w) for r in range(senders)]
        read = links_from_headers(plan.needs[w], [link.specs for link in planned])
        for want, got in zip(planned, read):
            assert got.specs == want.specs and got.nbytes == want.nbytes and (got.sender, got.worker) == (want.sender, want.worker)
            assert [(p.tensor, p.offsets, p.sizes, p.need) for p in got.pieces] == [(p.tensor, p.offsets, p.sizes, p.need) for p in want.pieces]


def test_a_tied_box_needed_twice_travels_twice_and_says_which_need():
    from hal.sync.plan.mxn import build_mxn_plan
    from hal.sync.plan.needs import Need, Target, WorkerNeeds
    from tests.sync.receive.fake_layers import holdings

    specs = (TensorSpec("embed.weight", (4, 2), torch.float32),)
    targets = (Target("embed", "weight", (4, 2)), Target("head", "weight", (4, 2)))
    needs = WorkerNeeds(0, specs, targets, (Need(0, (0, 0), (4, 2), 0, 0, (2, 1)), Need(0, (0, 0), (4, 2), 1, 0, (2, 1))))
    plan = build_mxn_plan(holdings(specs, 2), [needs])
    headers = [link_specs(plan, r, 0).specs for r in range(2)]
    assert [s.name for s in headers[0]] == ["embed.weight@0#0", "embed.weight@0#1"]
    read = links_from_headers(needs, headers)
    assert [p.need for link in read for p in link.pieces] == [0, 1, 0, 1]
    unmarked = [tuple(TensorSpec(s.name.partition("#")[0], s.shape, s.dtype) for s in h) for h in headers]
    with pytest.raises(SpecMismatchError, match=r"inside 2 of its needs and does not say which"):
        links_from_headers(needs, unmarked)


def test_what_would_land_wrong_is_refused_by_name():
    plan = plan_of(2, 2)
    needs = plan.needs[1]
    headers = [list(link_specs(plan, r, 1).specs) for r in range(2)]
    q = next(i for i, s in enumerate(headers[1]) if s.name.startswith("model.layers.0.self_attn.q_proj.weight"))
    lost = [list(h) for h in headers]
    del lost[1][q]  # rank 1's rows of worker 1's query heads never come
    with pytest.raises(SpecMismatchError, match=r"'model.layers.0.self_attn.q_proj.weight': engine worker 1 needs rows 4..8, columns 0..8; no trainer rank sends any of it"):
        links_from_headers(needs, lost)
    twice = [list(h) for h in headers]
    twice[0].append(headers[1][q])
    with pytest.raises(SpecMismatchError, match=r"q_proj.weight.*sent twice"):
        links_from_headers(needs, twice)
    other = [list(h) for h in headers]
    other[1][q] = TensorSpec(headers[1][q].name, headers[1][q].shape, torch.bfloat16)
    with pytest.raises(SpecMismatchError, match=r"trainer rank 1 sends \[4, 8\] torch.bfloat16 at \[4, 0\], which does not fit its \[8, 8\] torch.float32"):
        links_from_headers(needs, other)
    stranger = [list(h) for h in headers]
    stranger[0].append(TensorSpec("model.rotary.inv_freq@0", (4,), torch.float32))
    with pytest.raises(SpecMismatchError, match=r"'model.rotary.inv_freq': trainer rank 0 sends a piece of it, which this engine worker's checkpoint does not hold"):
        links_from_headers(needs, stranger)
    elsewhere = [list(h) for h in headers]
    elsewhere[0].append(TensorSpec("model.layers.0.self_attn.q_proj.weight@0", (2, 8), torch.float32))  # worker 0's rows
    with pytest.raises(SpecMismatchError, match=r"rows 0..2, columns 0..8, no box this engine worker needs"):
        links_from_headers(needs, elsewhere)
