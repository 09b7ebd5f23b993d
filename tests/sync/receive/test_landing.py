"""The landing of a worker's pieces in its layers (hal.sync.receive.landing), driven in this
process as `LinkReceiver` drives it: one thread per trainer rank taking its link's pieces,
the caller's thread opening and closing the engine's layers (`FakeLayers`)."""

from __future__ import annotations

import threading

import pytest
import torch

import hal
from hal.sync import errors
from hal.sync.plan.link_specs import link_specs
from hal.sync.receive import EngineLayers, LandingSink
from tests.sync.receive.fake_layers import FakeLayers, expected, plan_of, values


def pieces_of(plan, sender, worker, version):
    """(wire name, bytes as they arrive) of one link, in its order, cut from `version`."""
    full = values(plan.specs, version)
    wire = link_specs(plan, sender, worker)
    out = []
    for piece, spec in zip(wire.pieces, wire.specs):
        box = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.sizes))
        out.append((spec.name, full[plan.specs[piece.tensor].name][box].contiguous()))
    return wire, out


def land(plan, worker, engine, version, *, budget=256 << 20, timeout_s=30.0, per_call=1, stop_after=None):
    """Every trainer rank's link to `worker`, each in its own thread, `per_call` pieces a
    segment; the caller's thread drains. `stop_after`: (sender, pieces) after which that
    sender's thread ends (its link lost). Returns the landing and each thread's error."""
    sink = LandingSink(plan.needs[worker], engine, budget_bytes=budget, backend=hal.get_backend("cpu"))
    links = [pieces_of(plan, r, worker, version) for r in range(len(plan.links))]
    landing = sink.landing([wire for wire, _ in links], timeout_s)
    failures = [None] * len(links)

    def deliver(sender, pairs):
        part = landing.part(sender)
        try:
            for i in range(0, len(pairs), per_call):
                if stop_after is not None and stop_after[0] == sender and i >= stop_after[1]:
                    return
                part.apply(pairs[i : i + per_call])
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            failures[sender] = exc
        finally:
            landing.sender_done(sender)

    landing.begin()
    threads = [threading.Thread(target=deliver, args=(r, pairs)) for r, (_, pairs) in enumerate(links)]
    for thread in threads:
        thread.start()
    landing.drain()
    for thread in threads:
        thread.join()
    return landing, failures


@pytest.mark.parametrize("senders", [1, 2, 3])
def test_every_layer_lands_whole_and_is_closed_once_with_its_fills(senders):
    plan = plan_of(senders, 2)
    for w in range(2):
        engine = FakeLayers(plan.needs[w], live=("lm_head.weight",) if w else ())  # worker 1 keeps one target live
        landing, failures = land(plan, w, engine, version=1, per_call=3)
        assert failures == [None] * senders and landing.error is None
        assert landing.leftover() == [] and sorted(landing.closed) == sorted(set(engine.closed))
        assert set(engine.state(1).values()) == {"new"}
        assert len(landing.closed) == len({t.layer for t in plan.needs[w].targets})
    # worker 1's padded vocabulary: rows past the 100 real ones are the fill's zeros
    assert torch.equal(engine.weights["lm_head.weight"][36:], torch.zeros(28, 8))


def test_a_lost_link_leaves_the_layers_it_feeds_unopened_or_staged_and_the_others_new():
    plan = plan_of(2, 2)
    engine = FakeLayers(plan.needs[0])
    landing, failures = land(plan, 0, engine, version=1, stop_after=(1, 3))
    assert failures == [None, None]
    state = engine.state(1)
    assert set(state.values()) == {"old", "new"}, state
    assert {layer for layer, word in state.items() if word == "new"} == set(landing.closed)
    assert landing.leftover() and set(landing.leftover()).isdisjoint(landing.closed)
    landing.abort()
    landing.abort()
    assert engine.calls == ["begin", "abort"] and engine.staged == {}  # told once, every staged layer dropped


def test_a_budget_no_layer_fits_still_lands_every_layer_the_thread_behind_never_waits():
    plan = plan_of(2, 2)
    engine = FakeLayers(plan.needs[1])
    opened = []
    real_open = engine.open_layer
    engine.open_layer = lambda layer, targets: opened.append(layer) or real_open(layer, targets)
    landing, failures = land(plan, 1, engine, version=2, budget=1)
    assert failures == [None, None] and set(engine.state(2).values()) == {"new"}
    assert sorted(opened) == sorted(set(opened)) == sorted(landing.closed)  # each layer opened once, every one closed


def test_a_thread_that_waits_for_one_never_coming_fails_within_its_timeout():
    plan = plan_of(2, 2)
    engine = FakeLayers(plan.needs[1])
    sink = LandingSink(plan.needs[1], engine, budget_bytes=1, backend=hal.get_backend("cpu"))
    links = [pieces_of(plan, r, 1, 1) for r in range(2)]
    landing = sink.landing([wire for wire, _ in links], timeout_s=0.2)
    landing.begin()
    ahead = links[1][1][-1:]  # sender 1's last piece: its layer is past sender 0's first
    opened = threading.Thread(target=landing.part(0).apply, args=(links[0][1][:1],))
    opened.start()  # sender 0 opens its first layer and stays behind, never delivering more
    failure = []

    def late():
        try:
            landing.part(1).apply(ahead)
        except errors.PeerError as exc:
            failure.append(str(exc))
        finally:
            landing.sender_done(1)

    thread = threading.Thread(target=late)
    thread.start()
    drainer = threading.Thread(target=landing.drain)
    drainer.start()
    opened.join()
    thread.join()
    landing.sender_done(0)
    drainer.join()
    assert failure and "to catch up" in failure[0] and "trainer rank(s) [0]" in failure[0]


def test_the_engine_failing_to_stage_a_layer_fails_the_landing_and_keeps_nothing_more():
    plan = plan_of(1, 2)
    engine = FakeLayers(plan.needs[0], fail_open="model.layers.1.self_attn.qkv_proj")
    landing, failures = land(plan, 0, engine, version=1)
    assert failures == [None]
    assert "cannot stage model.layers.1.self_attn.qkv_proj" in str(landing.error)
    assert "model.layers.1.self_attn.qkv_proj" in landing.leftover() and engine.state(1)["model.layers.1.self_attn.qkv_proj"] == "old"


def test_a_staged_tensor_of_another_shape_is_refused_by_name():
    plan = plan_of(1, 2)
    engine = FakeLayers(plan.needs[0])
    engine.open_layer = lambda layer, targets: [torch.zeros(3) for _ in targets]
    landing, _ = land(plan, 0, engine, version=1)
    assert "parameter 'model.embed_tokens.weight': the engine opened a tensor of shape (3,)" in str(landing.error)
    assert engine.closed == []


def test_the_sink_refuses_an_engine_that_does_not_implement_the_protocol():
    plan = plan_of(1, 1)
    assert isinstance(FakeLayers(plan.needs[0]), EngineLayers)
    with pytest.raises(TypeError, match="must implement EngineLayers"):
        LandingSink(plan.needs[0], object())


def test_expected_covers_each_target_exactly():
    plan = plan_of(2, 2)
    for needs in plan.needs:
        assert not any(bool(t.isnan().any()) for t in expected(needs, 1).values())
