"""What engine workers tell the trainer ranks at init, and how every rank decides alike
whether a sync is received whole or in shards (hal.sync.plan.exchange)."""

from __future__ import annotations

import pytest
import torch

from hal.sync.errors import HeaderError, SpecMismatchError
from hal.sync.plan.exchange import LinkPlans, choose_receive, needs_payload, read_payloads, whole_holdings
from hal.sync.plan.needs import UnexpressibleLoad
from hal.sync.plan.shards import WHOLE
from tests.sync.receive.fake_layers import checkpoint, holdings, tp_needs


def test_every_workers_word_travels_as_it_was_recorded_or_refused():
    needs = tp_needs(checkpoint(), 3)
    words = read_payloads([needs_payload(needs[0]), needs_payload("parameter 'x': loader f applies mul_"), needs_payload(needs[2])])
    assert words[0] == needs[0] and words[2] == needs[2] and words[1] == "parameter 'x': loader f applies mul_"
    assert words[2].specs is words[0].specs  # decoded once for every worker
    with pytest.raises(HeaderError, match="engine worker 0 sent the needs of engine worker 1"):
        read_payloads([needs_payload(needs[1])])
    with pytest.raises(HeaderError, match="engine worker 1: its word on its needs is unreadable"):
        read_payloads([needs_payload(needs[0]), b"{}"])


def test_shard_where_every_worker_recorded_whole_or_a_refusal_by_name_otherwise():
    needs = tp_needs(checkpoint(), 2)
    assert choose_receive("auto", needs) == choose_receive("shard", needs)
    assert choose_receive("auto", needs).shard and choose_receive("auto", needs).needs == tuple(needs)
    assert choose_receive("whole", needs) == choose_receive("whole", [needs[0], "no"])
    assert not choose_receive("whole", needs).shard
    mixed = [needs[0], "parameter 'lm_head.weight': loader f applies to(torch.bfloat16)"]
    auto = choose_receive("auto", mixed)
    assert not auto.shard and auto.why == "engine worker 1: parameter 'lm_head.weight': loader f applies to(torch.bfloat16)"
    with pytest.raises(UnexpressibleLoad, match=r"receive='shard': engine worker 1: parameter 'lm_head.weight'"):
        choose_receive("shard", mixed)
    with pytest.raises(ValueError, match="receive must be one of 'auto', 'shard', 'whole', got 'some'"):
        choose_receive("some", needs)


def test_a_trainer_rank_builds_its_plan_once_per_layout_and_refuses_another_dtype_by_name():
    specs = checkpoint()
    plans = LinkPlans(tp_needs(specs, 2))
    one = whole_holdings(specs)
    assert one.kinds == (WHOLE,) * len(specs) and len(one.shares) == 1
    plan = plans.plan(one)
    assert plans.plan(whole_holdings(specs)) is plan and plans.builds == 1  # the same declaration: the same plan
    assert plan.bytes_out == (sum(plan.bytes_in),)
    fsdp = holdings(specs, 2)
    assert plans.plan(fsdp) is not plan and plans.plan(fsdp) is plans.plan(fsdp) and plans.builds == 2
    half = whole_holdings([type(s)(s.name, s.shape, torch.bfloat16) for s in specs])
    with pytest.raises(SpecMismatchError, match=r"'model.embed_tokens.weight': the trainer sends it as torch.bfloat16 .* the engine's workers receive torch.float32"):
        plans.plan(half)
    wide = LinkPlans(tp_needs(tuple(type(s)(s.name, s.shape, torch.bfloat16) for s in specs), 2), wire_dtype=torch.bfloat16)
    assert wide.plan(one).bytes_out[0] * 2 == plan.bytes_out[0]  # fp32 cast to the bf16 the workers recorded
