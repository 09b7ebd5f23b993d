"""Who may push weights: a receiver started with a token takes a sync only from a sender
that proves the same token (hal.sync.wire.auth.check_auth, called by IncomingSync.check).

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
    """On the sender: records every header its channel sends; with `replay` set, sends the
    last one recorded in place of the new one (what someone who captured a header could do)."""

    replay = False
    recorded: bytes | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        exchange = self.channel.exchange_header

        def replaying(payload):
            if self.is_sender and self.replay:
                payload = self.recorded
            elif self.is_sender:
                self.recorded = payload
            return exchange(payload)

        self.channel.exchange_header = replaying


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


def auth_worker(rank, world, kind, receiver_tokens, steps, segment_bytes, forger_rank=None):
    """Each step is (sender token, version): the sender sends weights(version) with that
    token; every receiver receives it. Returns what each rank saw, step by step. Rank
    `forger_rank`, if any, forges the first sync's closing agreement ("sync status") so
    that the second sync's challenge is the first's (`forger`)."""
    with hal.use("cpu"):
        transport = {"broadcast": CountingBroadcast, "ipc": CountingIpc}[kind](None, src=0)
        if forger_rank == rank:
            forger(transport, world, record="header challenge", forge="sync status lengths", draw=3)
        elif forger_rank is not None:
            honest(rank)
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


def run(kind, receiver_tokens, steps, segment_bytes=None, forger_rank=None):
    world = 1 + len(receiver_tokens)
    return run_group(
        auth_worker, world, args=(kind, receiver_tokens, steps, segment_bytes, forger_rank), timeout=90, collective_timeout=TIMEOUT_S
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
        allreduce = transport.channel.allreduce

        def recording(tensor, what):
            made.append(what)
            return allreduce(tensor, what)

        transport.channel.allreduce = recording
        challenges = []
        real_challenge = transport.channel.challenge
        transport.channel.challenge = lambda: challenges.append(real_challenge()) or challenges[-1]
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


# -- a member that makes up the challenge's all-reduce -------------------------------------
#
# Each rank's random bits for a challenge sit in its own row of an all-reduce; the others
# add zeros there. A member that computes the reduction itself sees the others' bits before
# it contributes, and can steer the result to any rows it likes: to a challenge seen
# before, which makes a recorded header's proof valid again. Here the honest ranks draw
# predictable bits (`predictable_words`), which stands in for what such a member sees.


def predictable_words(rank: int, draw: int) -> torch.Tensor:
    return torch.tensor([rank * 1_000_003 + draw, -draw], dtype=torch.int64)


def honest(rank):
    """Rank `rank` draws `predictable_words(rank, 1)`, then 2, ...; otherwise follows the protocol."""
    from hal.sync.wire import channel as protocol

    draws = iter(range(1, 1_000_000))
    protocol._random_words = lambda: predictable_words(rank, next(draws))


def forger(transport, world, *, record, forge, draw):
    """Makes this rank a member that replays a challenge: the rows of the all-reduce named
    `record` are remembered; in the next all-reduce named `forge` (the honest ranks' draw
    number `draw`), its own row is its remembered one (so its own check passes) and each
    honest row gets what turns that rank's fresh bits into its remembered bits."""
    from hal.sync.wire import channel as protocol

    me, kept, forged, draws = transport.rank, {}, [], iter(range(1, 1_000_000))
    real_words, real_allreduce = protocol._random_words, transport.channel.allreduce

    def words():  # drawn in step with the honest ranks' draws
        return kept["rows"][me].clone() if next(draws) == draw else real_words()

    def allreduce(tensor, what):
        if what == forge and "rows" in kept and not forged:
            for r in range(world):
                if r != me:
                    tensor[r, -2:] = kept["rows"][r] - predictable_words(r, draw)
            forged.append(what)
        real_allreduce(tensor, what)
        if what == record and "rows" not in kept:
            kept["rows"] = tensor.cpu()[:, -2:].clone()

    protocol._random_words = words
    transport.channel.allreduce = allreduce


def forged_challenge_worker(rank, world):
    """Rank 2 replays the first challenge in the second (a standalone all-reduce each);
    every rank then draws a third. Returns each challenge, or the error it raised."""
    from hal.sync.errors import AuthError

    with hal.use("cpu"):
        transport = BroadcastTransport(None, src=0)
        if rank == 2:
            forger(transport, world, record="header challenge", forge="header challenge", draw=2)
        else:
            honest(rank)
        out = []
        with transport.bounded(TIMEOUT_S):
            for _ in range(3):
                try:
                    out.append(transport.channel.challenge())
                except AuthError as exc:
                    out.append(f"AuthError: {exc}")
        return out


def test_a_rank_refuses_a_challenge_whose_own_bits_did_not_survive_the_all_reduce():
    """A member contributes rows that turn the honest ranks' fresh bits into those of the
    challenge before: every honest rank refuses with AuthError naming itself, instead of
    taking the old challenge again; the next challenge is fresh and the same on every rank."""
    (first0, second0, third0), (first1, second1, third1), (first2, second2, third2) = run_group(
        forged_challenge_worker, 3, timeout=60, collective_timeout=TIMEOUT_S
    )
    assert first0 == first1 == first2
    assert second2 == first2  # the forger got the challenge it wanted
    for rank, second in ((0, second0), (1, second1)):
        assert second != first0, f"rank {rank} took the replayed challenge again"
        assert second.startswith("AuthError: ") and f"rank {rank} of a group of 3" in second, second
        assert "header challenge all-reduce" in second and "came back changed" in second, second
    assert third0 == third1 == third2 and third0 not in (first0, second2)


def test_a_header_replayed_under_a_forged_challenge_is_refused():
    """The sender records the first sync's header, steers the agreement that ends it so that
    the next challenge is the first one again, and replays the recorded header: its proof
    is for that challenge. Each receiver sees that its own bits did not survive, and the
    sync is refused with AuthError on every rank, before any segment; nothing lands, the
    version does not move, and the group then carries a correct sync."""
    steps = [(TOKEN, 1), (REPLAY, 1), (TOKEN, 2)]
    results = run("broadcast", [TOKEN, TOKEN], steps, forger_rank=0)
    assert_accepted(results, 0, version=1)
    sent = results[0][1]
    assert sent["error"] == "AuthError" and sent["failed"] == [1, 2] and not sent["trainer_side"], sent
    assert sent["seconds"] < TIMEOUT_S / 4, sent
    for rank in (1, 2):
        assert_forgery_seen(results[rank][1], rank, held_version=1)
    assert_accepted(results, 2, version=2)


def test_a_sender_whose_challenge_was_forged_proves_nothing_over_it():
    """A receiver steers the agreement to the last challenge. The sender sees that its own
    bits did not survive: it still sends its header, so the ranks stay in step, but with
    no proof over that challenge, and says why at the header's agreement. The honest
    receiver refuses for the same reason, the forging one for want of a proof; every
    rank raises AuthError, nothing lands, and the next sync goes through."""
    steps = [(TOKEN, 1), (TOKEN, 2), (TOKEN, 3)]
    results = run("broadcast", [TOKEN, TOKEN], steps, forger_rank=2)
    assert_accepted(results, 0, version=1)
    sent = results[0][1]
    assert sent["error"] == "AuthError" and sent["failed"] == [0, 1, 2], sent
    assert "rank 0 of a group of 3: its own row of the sync status lengths all-reduce" in sent["message"], sent
    assert_forgery_seen(results[1][1], 1, held_version=1)
    forging = results[2][1]
    assert forging["error"] == "AuthError" and re.search(NO_TOKEN, forging["message"]), forging
    assert forging["data_phases"] == 0 and forging["calls"] == [] and forging["unchanged"], forging
    assert_accepted(results, 2, version=3)


def assert_forgery_seen(got, rank, *, held_version):
    where = f"rank {rank}: {got}"
    assert got["error"] == "AuthError", where
    assert f"rank {rank} of a group of 3: its own row of the sync status lengths all-reduce" in got["message"], where
    assert got["data_phases"] == 0 and got["calls"] == [] and got["unchanged"], where
    assert got["version"] == held_version and got["consistent"], where
