"""The LoRA sync decision table: every combination of the five inputs, written out."""

from __future__ import annotations

import itertools

import pytest

from hal.sync.lora import BaseWeightTracker, LoraSyncDecision, decide_lora_sync

pytestmark = pytest.mark.cpu

BASE = ("base",)
ADAPTER = ("adapter",)
BASE_ADAPTER = ("base", "adapter")
MERGED = ("merged",)
INVALID = ValueError

# has_adapter, adapter_merged, sleep_level, free_cache_engine, base_sent -> what travels
#
# Rows to read first:
#   adapter, level 2, free_cache_engine, base_sent     -> base + adapter  (verl 3461: the engine lost the base)
#   adapter, level 2, no free_cache_engine, base_sent  -> adapter only    (verl PR 5147: resending cost 26%)
#   adapter, no free_cache_engine                      -> never nothing   (verl 4248: the adapter still changed)
TABLE = [
    (False, False, 0, False, False, BASE),
    (False, False, 0, False, True , BASE),
    (False, False, 0, True , False, BASE),
    (False, False, 0, True , True , BASE),
    (False, False, 1, False, False, BASE),
    (False, False, 1, False, True , BASE),
    (False, False, 1, True , False, BASE),
    (False, False, 1, True , True , BASE),
    (False, False, 2, False, False, BASE),
    (False, False, 2, False, True , BASE),
    (False, False, 2, True , False, BASE),
    (False, False, 2, True , True , BASE),
    (False, True , 0, False, False, INVALID),
    (False, True , 0, False, True , INVALID),
    (False, True , 0, True , False, INVALID),
    (False, True , 0, True , True , INVALID),
    (False, True , 1, False, False, INVALID),
    (False, True , 1, False, True , INVALID),
    (False, True , 1, True , False, INVALID),
    (False, True , 1, True , True , INVALID),
    (False, True , 2, False, False, INVALID),
    (False, True , 2, False, True , INVALID),
    (False, True , 2, True , False, INVALID),
    (False, True , 2, True , True , INVALID),
    (True , False, 0, False, False, BASE_ADAPTER),
    (True , False, 0, False, True , ADAPTER),
    (True , False, 0, True , False, BASE_ADAPTER),
    (True , False, 0, True , True , ADAPTER),
    (True , False, 1, False, False, BASE_ADAPTER),
    (True , False, 1, False, True , ADAPTER),
    (True , False, 1, True , False, BASE_ADAPTER),
    (True , False, 1, True , True , ADAPTER),
    (True , False, 2, False, False, BASE_ADAPTER),
    (True , False, 2, False, True , ADAPTER),
    (True , False, 2, True , False, BASE_ADAPTER),
    (True , False, 2, True , True , BASE_ADAPTER),
    (True , True , 0, False, False, MERGED),
    (True , True , 0, False, True , MERGED),
    (True , True , 0, True , False, MERGED),
    (True , True , 0, True , True , MERGED),
    (True , True , 1, False, False, MERGED),
    (True , True , 1, False, True , MERGED),
    (True , True , 1, True , False, MERGED),
    (True , True , 1, True , True , MERGED),
    (True , True , 2, False, False, MERGED),
    (True , True , 2, False, True , MERGED),
    (True , True , 2, True , False, MERGED),
    (True , True , 2, True , True , MERGED),
]


def test_table_covers_every_combination():
    combos = {row[:5] for row in TABLE}
    assert len(combos) == len(TABLE) == 2 * 2 * 3 * 2 * 2
    assert combos == set(itertools.product([False, True], [False, True], [0, 1, 2], [False, True], [False, True]))


@pytest.mark.parametrize("has_adapter,adapter_merged,sleep_level,free_cache_engine,base_sent,expected", TABLE)
def test_decision(has_adapter, adapter_merged, sleep_level, free_cache_engine, base_sent, expected):
    kwargs = dict(
        has_adapter=has_adapter,
        adapter_merged=adapter_merged,
        sleep_level=sleep_level,
        free_cache_engine=free_cache_engine,
        base_sent=base_sent,
    )
    if expected is INVALID:
        with pytest.raises(ValueError, match="adapter_merged=True needs has_adapter=True"):
            decide_lora_sync(**kwargs)
        return
    decision = decide_lora_sync(**kwargs)
    assert isinstance(decision, LoraSyncDecision)
    assert decision.parts == expected
    assert (decision.send_base, decision.send_adapter, decision.send_merged) == (
        "base" in expected,
        "adapter" in expected,
        "merged" in expected,
    )
    assert decision.reason  # every decision says why
    assert decide_lora_sync(**kwargs) == decision  # pure


def test_decision_is_frozen_and_keyword_only():
    d = decide_lora_sync(has_adapter=True, adapter_merged=False, sleep_level=1, free_cache_engine=True, base_sent=True)
    with pytest.raises(AttributeError):
        d.send_base = True  # type: ignore[misc]
    with pytest.raises(TypeError):  # three booleans in a row are too easy to swap
        LoraSyncDecision(True, False, False, "positional")  # type: ignore[misc]
    assert LoraSyncDecision(send_base=True, send_adapter=False, send_merged=False, reason="r").parts == ("base",)


def test_reasons_name_the_cause():
    lost = decide_lora_sync(has_adapter=True, adapter_merged=False, sleep_level=2, free_cache_engine=True, base_sent=True)
    assert "level 2" in lost.reason and "free_cache_engine" in lost.reason
    kept = decide_lora_sync(has_adapter=True, adapter_merged=False, sleep_level=2, free_cache_engine=False, base_sent=True)
    assert "free_cache_engine is off" in kept.reason
    first = decide_lora_sync(has_adapter=True, adapter_merged=False, sleep_level=1, free_cache_engine=True, base_sent=False)
    assert "first sync" in first.reason


@pytest.mark.parametrize("level", [-1, 3, 1.5, True, None])
def test_bad_sleep_level_is_named(level):
    with pytest.raises(ValueError, match=r"sleep_level must be one of \(0, 1, 2\)"):
        decide_lora_sync(has_adapter=True, adapter_merged=False, sleep_level=level, free_cache_engine=True, base_sent=False)


@pytest.mark.parametrize("field", ["has_adapter", "adapter_merged", "free_cache_engine", "base_sent"])
def test_non_bool_flags_are_named(field):
    kwargs = dict(has_adapter=True, adapter_merged=False, sleep_level=1, free_cache_engine=True, base_sent=False)
    kwargs[field] = 1
    with pytest.raises(TypeError, match=field):
        decide_lora_sync(**kwargs)


def test_tracker_steady_state_and_loss():
    t = BaseWeightTracker(has_adapter=True, sleep_level=1, free_cache_engine=True)
    history = []
    for step in range(5):
        if step == 3:
            t.engine_lost_weights()
        d = t.decide()
        history.append(d.parts)
        t.sent(d)
    assert history == [BASE_ADAPTER, ADAPTER, ADAPTER, BASE_ADAPTER, ADAPTER]


def test_tracker_level_2_with_freeing_sends_base_every_time():
    t = BaseWeightTracker(has_adapter=True, sleep_level=2, free_cache_engine=True)
    parts = []
    for _ in range(3):
        d = t.decide()
        parts.append(d.parts)
        t.sent(d)
    assert parts == [BASE_ADAPTER] * 3


def test_tracker_merged_weights_do_not_count_as_the_base():
    t = BaseWeightTracker(has_adapter=True, sleep_level=1, free_cache_engine=True, adapter_merged=True)
    t.sent(t.decide())
    assert t.base_sent is False
    t.adapter_merged = False  # switching to adapter mode: the engine holds merged weights, resend the base
    assert t.decide().parts == BASE_ADAPTER
