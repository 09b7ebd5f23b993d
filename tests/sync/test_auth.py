"""Who may push weights: a receiver started with a token takes a sync only from a sender
that proves the same token (hal.sync.auth.check_auth, called by Receiver._check_header).

Sender and receivers run in spawned processes joined by gloo, over the broadcast and the
shared-memory transports. A refused sync must fail with `AuthError` on every rank (the
sender included, told which rank refused and why), before any segment is received:
nothing reaches the sink, the engine's tensors keep their bytes, the receiver's version
does not move, and the same group then carries a correct sync.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

import hal
from hal import kernels
from hal.sync import BroadcastTransport, IpcTransport, Receiver, Sender, SyncConfig, SyncError, TensorSource, TensorSpec
from hal.sync.sink import SinkPolicy
from tests.multiproc import run_group

pytestmark = pytest.mark.multiprocess

TOKEN = "s3cret"
WRONG = "s3cret-but-not-quite"
BUCKET = 16 * 1024  # several buckets, and a tensor chunked over two
SEGMENT = 4096
TIMEOUT_S = 20.0  # every wait of every rank; a refusal must come long before it
NO_TOKEN = r"the trainer presented no token, but this engine requires one"
MISMATCH = r"the trainer's token does not match this engine's"
REPLAY = "replay the last header"  # a step's sender token: resend the header of the step before


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(100, 64, generator=g)),  # 25 KiB: over two buckets
        ("layers.0.w", torch.randn(33, 7, generator=g)),
        ("layers.0.b", torch.randn(5, generator=g)),
        ("layers.1.w", torch.randn(40, 40, generator=g)),
        ("step", torch.tensor([seed], dtype=torch.int64)),
    ]


def specs() -> list[TensorSpec]:
    return [TensorSpec.of(n, t) for n, t in weights(0)]


def raw(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """Every tensor's bytes, to compare bit for bit."""
    return {n: bytes(kernels.as_bytes(t.contiguous()).numpy()) for n, t in tensors.items()}


class CountingDataPhases:
    """Counts the syncs whose data phase this transport began: `prepare` is called once the
    header check passed on every rank, before the first segment."""

    data_phases = 0

    def prepare(self, *args, **kwargs):
        self.data_phases += 1
        return super().prepare(*args, **kwargs)


class Replaying:
    """On the sender: records every header it sends; with `replay` set, sends the last one
    recorded in place of the new one (what someone who captured a header could do)."""

    replay = False
    recorded: bytes | None = None

    def exchange_header(self, payload):
        if self.is_sender and self.replay:
            payload = self.recorded
        elif self.is_sender:
            self.recorded = payload
        return super().exchange_header(payload)


class CountingBroadcast(CountingDataPhases, Replaying, BroadcastTransport):
    pass


class CountingIpc(CountingDataPhases, Replaying, IpcTransport):
    pass


class RecordingEngine:
    """A sink whose tensors are the destinations (bytes may land in them in place), and
    which records every call that would apply anything."""

    policy = SinkPolicy()

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.calls: list[str] = []

    def destination(self, name):
        return self.tensors[name]

    def apply(self, pairs):
        self.calls.extend(f"apply {name}" for name, _ in pairs)

    def abort(self):
        self.calls.append("abort")


class RecordingLoader:
    """A plain `apply(pairs)` callable that copies the views it is handed (load_weights-style)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.calls: list[str] = []

    def __call__(self, pairs):
        for name, tensor in pairs:
            self.calls.append(f"apply {name}")
            self.tensors[name].copy_(tensor)


def auth_worker(rank, world, kind, receiver_tokens, steps, segment_bytes):
    """Each step is (sender token, version): the sender sends weights(version) with that
    token; every receiver receives it. Returns what each rank saw, step by step."""
    with hal.use("cpu"):
        transport = {"broadcast": CountingBroadcast, "ipc": CountingIpc}[kind](None, src=0)
        out = []
        if rank == 0:
            cfg = SyncConfig(bucket_bytes=BUCKET, segment_bytes=segment_bytes, timeout_s=TIMEOUT_S)
            for token, version in steps:
                transport.replay = token == REPLAY
                sender = Sender(transport, cfg, token=TOKEN if transport.replay else token)
                start = time.perf_counter()
                try:
                    sender.send(TensorSource(weights(version)), version=version)
                    out.append({"error": None})
                except SyncError as exc:
                    out.append(
                        {
                            "error": type(exc).__name__,
                            "message": str(exc),
                            "failed": exc.failed_ranks,
                            "trainer_side": exc.trainer_side,
                            "seconds": time.perf_counter() - start,
                        }
                    )
            return out
        held = {n: t.clone() for n, t in weights(0)}
        sink = RecordingEngine(held) if rank % 2 == 1 else RecordingLoader(held)
        receiver = Receiver(transport, specs(), timeout_s=TIMEOUT_S, token=receiver_tokens[rank - 1])
        for _, version in steps:
            before, calls, phases = raw(held), len(sink.calls), transport.data_phases
            step = {"error": None}
            try:
                receiver.receive(sink)
            except SyncError as exc:
                step = {"error": type(exc).__name__, "message": str(exc)}
            step.update(
                version=receiver.version,
                consistent=receiver.consistent,
                calls=sink.calls[calls:],
                data_phases=transport.data_phases - phases,
                unchanged=raw(held) == before,
                matches=raw(held) == raw(dict(weights(version))),
            )
            out.append(step)
        return out


def run(kind, receiver_tokens, steps, segment_bytes=None):
    world = 1 + len(receiver_tokens)
    return run_group(
        auth_worker, world, args=(kind, receiver_tokens, steps, segment_bytes), timeout=90, collective_timeout=TIMEOUT_S
    )


def assert_accepted(results, i, version):
    assert results[0][i] == {"error": None}, results[0][i]
    for rank, steps in enumerate(results[1:], start=1):
        got = steps[i]
        where = f"rank {rank}, step {i}: {got}"
        assert got["error"] is None and got["version"] == version and got["consistent"], where
        assert got["matches"] and got["data_phases"] == 1, where
        assert got["calls"] and all(c.startswith("apply ") for c in got["calls"]), where


def assert_refused(results, i, pattern, *, held_version, refusing):
    """Step i failed with AuthError on every rank before any segment; nothing changed."""
    sent = results[0][i]
    assert sent["error"] == "AuthError", sent
    # the sender is told which rank refused, and why
    assert re.search(rf"rank {refusing[0]}: {pattern}", sent["message"]), sent
    assert sent["failed"] == refusing and not sent["trainer_side"], sent
    assert sent["seconds"] < TIMEOUT_S / 4, f"refused only after {sent['seconds']:.1f} s: {sent}"
    for rank, steps in enumerate(results[1:], start=1):
        got = steps[i]
        where = f"rank {rank}, step {i}: {got}"
        assert got["error"] == "AuthError", where
        assert re.search(pattern, got["message"]), where
        assert got["data_phases"] == 0, where  # refused at the header: no segment was received
        assert got["calls"] == [], where  # nothing applied, nothing to abort
        assert got["unchanged"], where  # the engine's tensors kept every byte
        assert got["version"] == held_version and got["consistent"], where


@pytest.mark.parametrize(
    "kind,receivers,segment_bytes",
    [("broadcast", 1, None), ("broadcast", 2, SEGMENT), ("ipc", 2, None)],
    ids=["point-to-point", "broadcast-2-receivers-segments", "shared-memory-2-receivers"],
)
def test_only_a_sender_with_the_receivers_token_is_accepted(kind, receivers, segment_bytes):
    # every step sends other weights under a newer version: had a refused one been taken,
    # the tensors and the version would show it
    steps = [(TOKEN, 1), (None, 2), (WRONG, 3), (TOKEN, 4)]
    results = run(kind, [TOKEN] * receivers, steps, segment_bytes)
    refusing = list(range(1, receivers + 1))
    assert_accepted(results, 0, version=1)
    assert_refused(results, 1, NO_TOKEN, held_version=1, refusing=refusing)
    assert_refused(results, 2, MISMATCH, held_version=1, refusing=refusing)
    # the group survived both refusals: the right token gets the next sync through
    assert_accepted(results, 3, version=4)


def test_an_open_receiver_accepts_any_sender():
    """Token None: today's behaviour, whatever the sender presents."""
    steps = [(None, 1), (TOKEN, 2), (WRONG, 3)]
    results = run("broadcast", [None], steps)
    for i, (_, version) in enumerate(steps):
        assert_accepted(results, i, version)


def test_one_receiver_requiring_a_token_refuses_the_sync_for_every_rank():
    """An open receiver beside one that requires the token: a sender without it is refused
    everywhere (the open one applies nothing either), then the right token reaches both."""
    steps = [(None, 1), (WRONG, 2), (TOKEN, 3)]
    results = run("broadcast", [None, TOKEN], steps)
    assert_refused(results, 0, NO_TOKEN, held_version=None, refusing=[2])
    assert_refused(results, 1, MISMATCH, held_version=None, refusing=[2])
    assert_accepted(results, 2, version=3)


@pytest.mark.parametrize("kind", ["broadcast", "ipc"])
def test_a_recorded_header_is_refused_when_replayed(kind):
    """A header captured on the wire carries a valid proof for its version and plan, and an
    engine takes a version equal to the one it holds. Replayed as it was (same version,
    same weights), it is still refused: its proof covers the challenge the receivers drew
    for that exchange, and every exchange draws a new one. Nothing lands; the group goes on."""
    steps = [(TOKEN, 1), (REPLAY, 1), (TOKEN, 2), (REPLAY, 2), (TOKEN, 2)]
    results = run(kind, [TOKEN, TOKEN], steps)
    assert_accepted(results, 0, version=1)
    assert_refused(results, 1, MISMATCH + r", or the header was not made for this sync \(a replay\)", held_version=1, refusing=[1, 2])
    assert_accepted(results, 2, version=2)
    assert_refused(results, 3, MISMATCH, held_version=2, refusing=[1, 2])
    assert_accepted(results, 4, version=2)  # the same version again, with a fresh proof: taken


def challenge_worker(rank, world):
    """Three syncs with a token; returns the collectives each rank made for challenges."""
    with hal.use("cpu"):
        transport = BroadcastTransport(None, src=0)
        made: list[str] = []
        allreduce = transport.allreduce

        def recording(tensor, what):
            made.append(what)
            return allreduce(tensor, what)

        transport.allreduce = recording
        challenges = []
        real_challenge = transport.challenge
        transport.challenge = lambda: challenges.append(real_challenge()) or challenges[-1]
        if rank == 0:
            sender = Sender(transport, SyncConfig(bucket_bytes=BUCKET, timeout_s=TIMEOUT_S), token=TOKEN)
            for version in (1, 2, 3):
                sender.send(TensorSource(weights(version)), version=version)
        else:
            receiver = Receiver(transport, specs(), timeout_s=TIMEOUT_S, token=TOKEN)
            for _ in range(3):
                receiver.receive(RecordingLoader({n: t.clone() for n, t in weights(0)}))
        return [w for w in made if "challenge" in w], challenges


def test_only_a_groups_first_header_costs_a_collective_for_its_challenge():
    """The challenge for the next header comes along with every agreement: after the first
    sync, no header waits for a collective of its own. Every rank sees the same challenges,
    each different."""
    results = run_group(challenge_worker, 3, timeout=60, collective_timeout=TIMEOUT_S)
    for standalone, challenges in results:
        assert standalone == ["header challenge"]  # the first sync's only
        assert len(challenges) == 3 and len(set(challenges)) == 3
    assert results[0][1] == results[1][1] == results[2][1]
