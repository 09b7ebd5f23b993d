"""Choosing by time (`DeltaConfig.choose == "time"`): the pacer's decisions from injected timings.

No sync runs and nothing sleeps. `Pacer` is driven with numbers; the sender's side of delta
sync (`DeltaSender`, `DeltaSegments`: the samples, the compares, the stop part-way) is
driven segment by segment on real bytes with a fake clock: the encode kernel advances it
by a link's cost per byte instead of taking that long, the wire and the receivers' apply
advance it too, and a sync's time is what the clock says. Each link below is one of the
cases docs/delta.md ("Choosing by time") describes; the decisions must come out as it says,
whatever the machine's load. The end-to-end check that the sender consults the pacer and
feeds it its measurements is tests/sync/delta/test_delta.py's
`test_by_time_the_sender_follows_the_pacer_and_lands_every_byte`.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import hal
from hal import kernels
from hal.sync import TensorSpec
from hal.sync.config import DeltaConfig
from hal.sync.delta import encode as delta_encode_module
from hal.sync.delta.encode import DeltaSender
from hal.sync.delta.pacer import Pacer
from hal.sync.plan import bucket_offsets
from hal.sync.plan.buckets import build_plan

pytestmark = pytest.mark.cpu

BUCKET = 16 * 1024
SEGMENT = 4096
SPECS = [TensorSpec("embed.weight", (300, 32), torch.float32), TensorSpec("proj.weight", (64, 40), torch.float32),
         TensorSpec("norm.weight", (7,), torch.float32)]


# ---- Pacer alone ------------------------------------------------------------------------------


def test_with_nothing_measured_the_pacer_pauses_and_samples():
    pacer = Pacer()
    assert pacer.whole_s_per_byte() is None
    assert pacer.choose() == ("paused", True)
    pacer.record("paused", 1.0, 1000, warm=True, encode_rate=None)  # no encode measured yet
    assert pacer.choose() == ("paused", True)


def test_a_whole_sync_is_judged_by_the_fastest_of_the_recent_warm_ones():
    pacer = Pacer()
    pacer.record("anchor", 9.0, 1000, warm=False, encode_rate=None)  # allocated the baseline: not a fair time
    assert pacer.whole_s_per_byte() is None
    for seconds in (5.0, 3.0, 4.0):
        pacer.record("paused", seconds, 1000, warm=True, encode_rate=None)
    assert pacer.whole_s_per_byte() == pytest.approx(0.003)  # the minimum: noise makes deltas look worse, not better
    for seconds in (6.0,) * Pacer.WHOLE_KEPT:  # only the last WHOLE_KEPT count
        pacer.record("anchor", seconds, 1000, warm=True, encode_rate=None)
    assert pacer.whole_s_per_byte() == pytest.approx(0.006)
    pacer.record("paused", 0.0, 0, warm=True, encode_rate=None)  # nothing sent: nothing learnt
    assert pacer.whole_s_per_byte() == pytest.approx(0.006)


def test_an_encode_slower_than_a_whole_sync_pauses_ever_longer_up_to_the_longest_pause():
    pacer = Pacer()
    pacer.record("paused", 1.0, 1000, warm=True, encode_rate=0.002)  # encode 2 ms/byte, a whole sync 1 ms/byte
    pauses = []
    for _ in range(8):
        run = 0
        while True:
            choice, sample = pacer.choose()
            assert choice == "paused"
            run += 1
            if sample:  # the pause's last sync measures again, for the decision after it
                pacer.record("paused", 1.0, 1000, warm=True, encode_rate=0.002)
                break
        pauses.append(run)
    assert pauses == [2, 4, 8, 16, 32, 64, 64, 64]  # FIRST_PAUSE, doubling, LONGEST_PAUSE


def test_a_delta_sync_that_wins_ends_the_doubling():
    pacer = Pacer()
    pacer.record("paused", 1.0, 1000, warm=True, encode_rate=0.002)
    assert [pacer.choose() for _ in range(2)] == [("paused", False), ("paused", True)]
    pacer.record("paused", 1.0, 1000, warm=True, encode_rate=0.0001)  # the encode got faster
    assert pacer.choose() == ("delta", False)
    pacer.record("delta", 0.5, 1000, warm=True, encode_rate=0.0001)
    assert pacer.pause_next == Pacer.FIRST_PAUSE and pacer.delta_rest == pytest.approx(0.0004)
    assert pacer.choose() == ("delta", False)


def test_what_a_delta_sync_cost_beyond_its_encode_counts_against_the_samples_after_it():
    pacer = Pacer()
    pacer.record("paused", 1.0, 1000, warm=True, encode_rate=0.0001)
    assert pacer.choose() == ("delta", False)
    pacer.record("delta", 3.0, 1000, warm=True, encode_rate=0.0001)  # lost: the receivers' apply was slow
    assert pacer.delta_rest == pytest.approx(0.0029)
    assert [pacer.choose() for _ in range(2)] == [("paused", False), ("paused", True)]
    pacer.record("paused", 1.0, 1000, warm=True, encode_rate=0.0001)  # a fast sample alone would say "delta"
    assert pacer.choose() == ("paused", False)  # 0.0001 + 0.0029 > 0.001: a pause of 4 instead


def test_a_delta_sync_stopped_part_way_counts_as_lost():
    pacer = Pacer()
    pacer.record("paused", 1.0, 1000, warm=True, encode_rate=0.0001)
    assert pacer.choose() == ("delta", False)
    pacer.record("stopped", 0.9, 1000, warm=True, encode_rate=0.003)  # faster than a whole sync, but stopped
    assert pacer.encode_rate == 0.003 and pacer.pausing == Pacer.FIRST_PAUSE


# ---- the sender's side, on a fake clock ---------------------------------------------------------


@dataclasses.dataclass
class Link:
    """What each part of a sync costs, in fake seconds: the encode per byte compared (a
    delta sync's compare) and per byte sampled (a whole sync's sample), the wire per byte
    sent, the receivers' apply per segment that arrives as a delta."""

    compare_s_per_byte: float
    sample_s_per_byte: float
    wire_s_per_byte: float
    apply_s_per_delta_segment: float = 0.0


SLOW_ENCODE = Link(compare_s_per_byte=1e-4, sample_s_per_byte=1e-4, wire_s_per_byte=1e-8)  # every compare far slower than the wire
SLOW_COMPARE = Link(compare_s_per_byte=2.5e-5, sample_s_per_byte=1e-9, wire_s_per_byte=2e-6)  # samples fast, a delta sync's compares slow
SLOW_APPLY = Link(compare_s_per_byte=1e-9, sample_s_per_byte=1e-9, wire_s_per_byte=2e-6, apply_s_per_delta_segment=0.1)
SLOW_WIRE = Link(compare_s_per_byte=1e-9, sample_s_per_byte=1e-9, wire_s_per_byte=1e-5)  # the wire far slower than any compare


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class Buffers:
    """The transport's part a sender's delta side uses: the bucket buffers."""

    def __init__(self, plan) -> None:
        self.buffers = [torch.zeros(b.nbytes, dtype=torch.uint8) for b in plan.buckets]

    def buffer(self, k: int) -> torch.Tensor:
        return self.buffers[k]


class PacedSender:
    """The sender's loop over one `DeltaSender` (hal.sync.send.sender's order of calls:
    `base`, `begin`, per segment `pack_target` then `encode`, `completed` when the sync
    ended well) on the bytes of `SPECS`, each sync's time read from `clock`."""

    def __init__(self, link: Link, clock: FakeClock, monkeypatch, *, anchor_every: int = 100) -> None:
        self.link, self.clock = link, clock
        self.backend = hal.current()
        self.delta = DeltaSender(DeltaConfig(anchor_every=anchor_every, choose="time"), self.backend)
        self.plan = build_plan(SPECS, BUCKET, segment_bytes=SEGMENT)
        self.transport = Buffers(self.plan)
        self.stream = self.backend.new_stream()
        self.offsets = bucket_offsets(self.plan)
        self.model = torch.randint(0, 256, (sum(b.nbytes for b in self.plan.buckets),), dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(0))
        self.generator = torch.Generator().manual_seed(1)
        self.segments = None
        real = kernels.delta_encode

        def timed_encode(new, old, word):  # the kernel's result, the link's time
            rate = link.compare_s_per_byte if self.segments.compare else link.sample_s_per_byte
            clock.now += new.numel() * rate
            return real(new, old, word)

        monkeypatch.setattr(kernels, "delta_encode", timed_encode)
        monkeypatch.setattr(delta_encode_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))

    def change(self, fraction: float = 0.03) -> None:
        words = self.model.view(torch.int32)
        hit = torch.rand(words.numel(), generator=self.generator) < fraction
        words[hit] += 1

    def sync(self, version: int, *, fail_at_segment: int | None = None) -> dict:
        """One sync; its metrics (and "failed" when it failed at that segment: no `completed`)."""
        start = self.clock.now
        base, choice, sample = self.delta.base(self.plan)
        segments = self.segments = self.delta.begin(
            self.plan, base, choice, sample, new_plan=version == 0, bypass_cpu=True, transport=self.transport, stream=self.stream
        )
        n = 0
        for bucket in self.plan.buckets:
            for j, segment in enumerate(bucket.segments):
                if n == fail_at_segment:
                    return {**segments.metrics(), "failed": True}
                n += 1
                target = segments.pack_target(bucket, j)
                target = self.transport.buffer(bucket.index) if target is None else target
                packed = self.model[self.offsets[bucket.index] + segment.start : self.offsets[bucket.index] + segment.stop]
                target[segment.start : segment.stop].copy_(packed)
                data, encoding, _ = segments.encode(bucket, j, target[segment.start : segment.stop], self.stream.record_event())
                self.clock.now += data.numel() * self.link.wire_s_per_byte
                if encoding != kernels.DENSE:
                    self.clock.now += self.link.apply_s_per_delta_segment
        self.delta.completed(segments, version, self.clock.now - start)
        return {**segments.metrics(), "sampled_segments": len(segments.samples), "failed": False}

    def run(self, steps: int, fail_at: dict[int, int] | None = None) -> list[dict]:
        out = []
        for step in range(steps):
            if step:
                self.change()
            out.append(self.sync(step, fail_at_segment=(fail_at or {}).get(step)))
        return out


def dense_bytes(sender: PacedSender) -> int:
    return sum(segment.stop - segment.start for b in sender.plan.buckets for segment in b.segments)


@pytest.fixture
def paced(monkeypatch):
    def make(link: Link, **kwargs) -> PacedSender:
        return PacedSender(link, FakeClock(), monkeypatch, **kwargs)

    with hal.use("cpu"):
        yield make


def test_a_compare_slower_than_the_wire_never_sends_deltas_and_samples_ever_less_often(paced):
    sender = paced(SLOW_ENCODE)
    out = sender.run(16)
    assert [m["delta_choice"] for m in out] == ["anchor"] + ["paused"] * 15
    # the samples: sync 1 (nothing to judge by yet), then the last sync of each pause, the
    # pauses doubling: 2 (syncs 2-3), 4 (4-7), 8 (8-15)
    assert [s for s, m in enumerate(out) if m["sampled_bytes"]] == [1, 3, 7, 15]
    for m in out:
        assert not m["delta"] and m["compared_bytes"] == 0 and m["wire_bytes"] == m["dense_wire_bytes"] == dense_bytes(sender)
        # a sample: the start of SAMPLE_SEGMENTS segments (here each whole: under SAMPLE_BYTES)
        assert m["sampled_segments"] == (Pacer.SAMPLE_SEGMENTS if m["sampled_bytes"] else 0)
        assert m["sampled_bytes"] <= Pacer.SAMPLE_SEGMENTS * SEGMENT


def test_a_delta_sync_whose_compares_are_slow_stops_after_two_segments(paced):
    sender = paced(SLOW_COMPARE)
    out = sender.run(12)
    # 1 samples (fast), 2 tries a delta and stops, pauses 2 (3, 4: samples, fast again),
    # 5 stops, pauses 4 (6-9), 10 stops, 11 paused
    assert [m["delta_choice"] for m in out] == (
        ["anchor", "paused", "stopped", "paused", "paused", "stopped"] + ["paused"] * 4 + ["stopped", "paused"]
    )
    for m in out:
        assert m["delta"] == (m["delta_choice"] == "stopped")
        if m["delta_choice"] == "stopped":  # two segments compared (MIN_COMPARED), the rest sent whole without a compare
            assert m["compared_bytes"] == 2 * SEGMENT and m["sampled_bytes"] == 0 and m["wire_bytes"] < m["dense_wire_bytes"]
        else:
            assert m["compared_bytes"] == 0 and m["wire_bytes"] == m["dense_wire_bytes"]


def test_a_delta_sync_lost_to_the_receivers_apply_is_not_tried_again_on_samples_alone(paced):
    sender = paced(SLOW_APPLY)
    out = sender.run(10)
    assert [m["delta_choice"] for m in out] == ["anchor", "paused", "delta"] + ["paused"] * 7
    assert [s for s, m in enumerate(out) if m["sampled_bytes"]] == [1, 4, 8]  # measure, then after pauses of 2 and 4


def test_a_wire_slower_than_the_compare_keeps_sending_deltas(paced):
    sender = paced(SLOW_WIRE)
    out = sender.run(8)
    assert [m["delta_choice"] for m in out] == ["anchor", "paused"] + ["delta"] * 6
    for m in out[2:]:
        assert m["delta"] and m["compared_bytes"] == m["dense_wire_bytes"] and m["sampled_bytes"] == 0
        assert m["wire_bytes"] < m["dense_wire_bytes"] // 2


@pytest.mark.parametrize("link,fail_at", [(SLOW_ENCODE, 2), (SLOW_WIRE, 4)], ids=["during-a-pause", "during-a-delta"])
def test_after_a_failed_sync_the_next_is_an_anchor_whatever_the_pacer_says(paced, link, fail_at):
    """Whole syncs pack straight into the baseline: one that fails part-way leaves it
    neither old nor new, so the next sync must be whole."""
    sender = paced(link)
    out = sender.run(7, fail_at={fail_at: 3})
    assert out[fail_at]["failed"] and out[fail_at]["delta_choice"] == ("paused" if link is SLOW_ENCODE else "delta")
    assert out[fail_at + 1]["delta_choice"] == "anchor"
    assert all(not m["failed"] for s, m in enumerate(out) if s != fail_at)


def test_a_sync_anchor_every_syncs_after_the_last_whole_one_is_an_anchor_and_samples(paced):
    sender = paced(SLOW_WIRE, anchor_every=4)
    out = sender.run(10)
    # whole: 0 (the first), 1 (nothing to judge by yet), then every 4th: 5, 9
    assert [m["delta_choice"] for m in out] == ["anchor", "paused", "delta", "delta", "delta", "anchor", "delta", "delta", "delta", "anchor"]
    assert out[5]["sampled_bytes"] and out[9]["sampled_bytes"]  # an anchor measures the compare for the next decision
