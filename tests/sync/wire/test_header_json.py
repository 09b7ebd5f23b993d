"""Hostile headers over a real process group: every rank gets a `SyncError` subclass, fast.

A sending rank that does not follow the protocol sends 1,000+ malformed, truncated,
mutated and random headers, and announces one far larger than any header may be, to two
receivers. Each attempt must end on every rank with a `SyncError` subclass (HeaderError,
or SpecMismatchError for a well-formed header that describes other tensors) well within
the timeout, nothing must be applied, and the group must still carry a correct sync
afterwards. The decode-level fuzzing is in test_header.py.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from hal.sync import BroadcastTransport, HeaderError, Receiver, Sender, SyncConfig, SyncError, SyncHeader, TensorSource, TensorSpec
from hal.sync.errors import RankReport, raise_if_any
from hal.sync.wire.header_json import MAX_HEADER_BYTES
from hal.sync.plan import build_plan
from tests.multiproc import run_group
from tests.sync.wire.test_header import _mutate, _random_input

pytestmark = pytest.mark.multiprocess

ATTEMPTS = 1100
TIMEOUT_S = 10.0


def weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(64, 32, generator=g)), ("a.bias", torch.randn(32, generator=g)), ("step", torch.tensor([1]))]


def hostile_payloads() -> list[bytes]:
    """Mutations of the header a real sender sends, and random inputs; none of them one the
    receivers would accept (those would start a data phase this sender never sends)."""
    specs = [TensorSpec.of(n, t) for n, t in weights()]
    plan = build_plan(specs, 8192)
    real = SyncHeader(version=1, specs=plan.specs, bucket_bytes=8192, segment_bytes=None, verify=False, digest=plan.digest)
    seeds = [real.encode(), SyncHeader(**{**_fields(real), "version": 7}).encode()]
    rng = random.Random(11)
    out: list[bytes] = []
    while len(out) < ATTEMPTS:
        data = _random_input(rng) if rng.random() < 0.3 else _mutate(rng, rng.choice(seeds), rng.choice(seeds))
        try:
            decoded = SyncHeader.decode(data)
        except HeaderError:
            out.append(data)
            continue
        if decoded.specs != plan.specs or decoded.digest != plan.digest:
            out.append(data)  # well formed, but not what the receivers accept
    return out


def _fields(header: SyncHeader) -> dict:
    return {name: getattr(header, name) for name in header.__dataclass_fields__}


def hostile_sender_worker(rank, world):
    transport = BroadcastTransport(None, src=0)
    kinds, slowest = [], 0.0
    if rank == 0:
        for payload in hostile_payloads():
            start = time.monotonic()
            try:
                with transport.bounded(TIMEOUT_S):  # as a Sender bounds a sync of its own
                    transport.channel.challenge()  # the protocol's first step, as a sender's: the receivers draw theirs
                    transport.channel.exchange_header(payload)
                    raise_if_any(transport.channel.agree(RankReport(sender=True), "header check"), rank, "hostile sync")
                kinds.append("accepted")
            except SyncError as exc:
                kinds.append(type(exc).__name__)
            slowest = max(slowest, time.monotonic() - start)
        # a length far beyond any header: every rank refuses it before a payload moves
        with transport.bounded(TIMEOUT_S):
            transport.channel.challenge()
            size = torch.tensor([MAX_HEADER_BYTES + 1], dtype=torch.int64)
            transport.channel.wait(transport.channel.broadcast(size, "header size"), "header size")
        # and then a correct sync
        Sender(transport, SyncConfig(bucket_bytes=8192)).send(TensorSource(weights()), version=1)
        return kinds, slowest
    receiver = Receiver(transport, [TensorSpec.of(n, t) for n, t in weights()], timeout_s=TIMEOUT_S)
    applied = []
    for _ in range(ATTEMPTS + 1):
        start = time.monotonic()
        try:
            receiver.receive(lambda pairs: applied.extend(pairs))
            kinds.append("accepted")
        except SyncError as exc:
            kinds.append(type(exc).__name__)
        slowest = max(slowest, time.monotonic() - start)
    receiver.receive(lambda pairs: applied.extend(n for n, _ in pairs))
    return kinds, slowest, applied, receiver.version


def test_hostile_headers_fail_every_rank_with_a_sync_error_within_the_timeout():
    (sent, sender_slowest), *receivers = run_group(hostile_sender_worker, 3, timeout=240)
    assert len(sent) == ATTEMPTS and "accepted" not in sent
    assert set(sent) <= {"HeaderError", "SpecMismatchError"} and "HeaderError" in sent
    assert sender_slowest < TIMEOUT_S
    for kinds, slowest, applied, version in receivers:
        assert kinds[:ATTEMPTS] == sent  # the same verdict on every rank, attempt by attempt
        assert kinds[ATTEMPTS] == "HeaderError"  # the oversize announcement
        assert slowest < TIMEOUT_S
        assert applied == ["a.weight", "a.bias", "step"] and version == 1  # only the correct sync applied anything
