"""A sink declares what it needs of the receiver once, as a `SinkPolicy` (issue 19, item 4),
and a receiver built with `specs=None` takes what the header declares.

Each field changes what the receiver does, so each is tested by what the sink sees:
`whole_buckets` (apply once per bucket, not per segment), `apply_unchanged` (a delta sync
still hands over every tensor), `in_place` (no tensor received straight into a
destination). A sink that declares no policy, or still sets the former attributes, is
refused by name before any sync.
"""

from __future__ import annotations

import pytest
import torch

import hal
from hal.sync import BroadcastTransport, Receiver, Sender, SinkPolicy, SyncConfig, TensorSource, TensorSpec, as_sink, copy_into
from hal.sync.config import DeltaConfig
from tests.multiproc import run_group

BUCKET = 16 * 1024
SEGMENT = 4096


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    out = {f"layers.{i}.w": torch.randn(16, 32, generator=g) for i in range(12)}  # 2 KiB each: 2 per segment
    out["norm"] = torch.randn(8, generator=g)
    return out


def specs() -> list[TensorSpec]:
    return [TensorSpec.of(n, t) for n, t in weights(0).items()]


class Recording:
    """Keeps copies of what `apply` is handed, one list per call."""

    def __init__(self, policy: SinkPolicy, destinations: dict[str, torch.Tensor] | None = None) -> None:
        self.policy = policy
        self.destinations = destinations or {}
        self.calls: list[list[str]] = []
        self.got: dict[str, torch.Tensor] = {}

    def destination(self, name):
        return self.destinations.get(name)

    def apply(self, pairs):
        self.calls.append([n for n, _ in pairs])
        for name, tensor in pairs:
            self.got[name] = tensor.clone()

    def abort(self):
        pass


def policy_worker(rank, world, policy_fields, delta, accept_any):
    with hal.use("cpu"):
        transport = BroadcastTransport(None, src=0)
        config = SyncConfig(bucket_bytes=BUCKET, segment_bytes=SEGMENT, delta=DeltaConfig(choose="bytes") if delta else None)
        if rank == 0:
            sender = Sender(transport, config)
            for step in (1, 2):
                tensors = weights(1)
                if step == 2:
                    tensors["layers.3.w"] = tensors["layers.3.w"] + 1  # one tensor changes
                sender.send(TensorSource(list(tensors.items())), version=step)
            return None
        receiver = Receiver(transport, None if accept_any else specs(), timeout_s=30)
        out = []
        for _ in (1, 2):
            sink = Recording(SinkPolicy(**policy_fields))
            metrics = receiver.receive(sink)
            expected = weights(1)
            if len(out) == 1:
                expected["layers.3.w"] = expected["layers.3.w"] + 1
            exact = all(torch.equal(sink.got[n], expected[n]) for n in sink.got)
            out.append((sink.calls, exact, receiver.version, metrics.buckets))
        return out


@pytest.mark.multiprocess
def test_whole_buckets_applies_once_per_bucket():
    _, (first, _) = run_group(policy_worker, 2, args=({"whole_buckets": True}, False, False))
    calls, exact, version, buckets = first
    assert exact and version == 1 and buckets > 1
    assert len(calls) == buckets
    _, (first, _) = run_group(policy_worker, 2, args=({}, False, False))
    assert len(first[0]) >= 2 * buckets  # by default, per segment (4 in a bucket)


@pytest.mark.multiprocess
def test_apply_unchanged_hands_every_tensor_in_a_delta_sync():
    _, (_, second) = run_group(policy_worker, 2, args=({}, True, False))
    calls, exact, version, _ = second
    assert exact and version == 2
    assert sum(calls, []) == ["layers.3.w"]  # a delta sync hands over only what changed
    _, (_, second) = run_group(policy_worker, 2, args=({"apply_unchanged": True}, True, False))
    calls, exact, _, _ = second
    assert exact and sorted(sum(calls, [])) == sorted(weights(0))


@pytest.mark.multiprocess
def test_receiver_without_specs_takes_what_the_header_declares():
    _, (first, second) = run_group(policy_worker, 2, args=({}, False, True))
    assert first[1] and second[1] and (first[2], second[2]) == (1, 2)
    assert sorted(sum(first[0], [])) == sorted(weights(0))


def in_place_worker(rank, world, in_place):
    with hal.use("cpu"):
        transport = BroadcastTransport(None, src=0)
        config = SyncConfig(bucket_bytes=BUCKET, segment_bytes=SEGMENT)
        if rank == 0:
            Sender(transport, config).send(TensorSource(list(weights(1).items())), version=1)
            return None
        held = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs()}
        landed: list[str] = []
        receiver = Receiver(transport, specs(), timeout_s=30)
        original = transport.receive_segments

        def watching(land, complete):
            def spy(k, j, status):
                where = land(k, j, status)
                if where is not None:
                    landed.extend(n for n, t in held.items() if t.data_ptr() <= where.data_ptr() < t.data_ptr() + t.nbytes)
                return where

            return original(spy, complete)

        transport.receive_segments = watching
        receiver.receive(copy_into(held, in_place=in_place))
        return sorted(set(landed)), all(torch.equal(held[n], t) for n, t in weights(1).items())


@pytest.mark.multiprocess
def test_in_place_false_never_lands_in_a_destination():
    _, (landed, exact) = run_group(in_place_worker, 2, args=(True,))
    assert exact and landed  # whole tensors alone in their segments land in place by default
    _, (landed, exact) = run_group(in_place_worker, 2, args=(False,))
    assert exact and landed == []


def test_policy_is_declared_or_the_sink_is_refused_by_name():
    class NoPolicy:
        def destination(self, name):
            return None

        def apply(self, pairs):
            pass

        def abort(self):
            pass

    class Former(NoPolicy):
        whole_buckets = True

    with pytest.raises(TypeError, match=r"sink NoPolicy must declare `policy = SinkPolicy\(...\)`.*got none$"):
        as_sink(NoPolicy())
    with pytest.raises(TypeError, match=r"sink Former .* \(it sets whole_buckets: move them into the policy\)"):
        as_sink(Former())
    wrong = NoPolicy()
    wrong.policy = {"in_place": False}
    with pytest.raises(TypeError, match="got a dict"):
        as_sink(wrong)
    with pytest.raises(TypeError, match="SinkPolicy.in_place must be a bool, got 'no'"):
        SinkPolicy(in_place="no")
    with pytest.raises(TypeError):
        SinkPolicy(True)  # keyword only
    # how the receiver learns the destinations (hal.sync.plan.steady): declared, never guessed
    assert as_sink(lambda pairs: None).policy == SinkPolicy(destinations="none")
    assert copy_into({}, in_place=False).policy == SinkPolicy(in_place=False, destinations="mapped")
    with pytest.raises(ValueError, match="SinkPolicy.destinations must be one of 'ask', 'mapped', 'generation', 'none', got 'some'"):
        SinkPolicy(destinations="some")
    with pytest.raises(TypeError, match="SinkPolicy.generation must be an int >= 0, got -1"):
        SinkPolicy(destinations="generation", generation=-1)
    with pytest.raises(ValueError, match="destinations='ask' keeps no generation"):
        SinkPolicy().bumped()
    assert SinkPolicy(destinations="generation").bumped().bumped().generation == 2
    unmapped = NoPolicy()
    unmapped.policy = SinkPolicy(destinations="mapped")
    with pytest.raises(TypeError, match="sink NoPolicy declares SinkPolicy\\(destinations='mapped'\\) but has no `tensors` mapping"):
        as_sink(unmapped)
