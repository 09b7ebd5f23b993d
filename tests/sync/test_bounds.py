"""One owner per wait bound (issue 19, item 5): a channel keeps no timeout; the sync that
makes a collective bounds it (`Sender` from its SyncConfig, `Receiver` from its own), and
a collective outside any sync is refused rather than waiting on a copied default.

The sender's config says 2 s, the receiver's own setting 30 s: when the receiver stops
answering, the sender gives up after its own bound, not after a value copied from elsewhere.
"""

from __future__ import annotations

import time

import pytest
import torch

from hal.sync import BroadcastTransport, Receiver, Sender, SyncConfig, SyncError, TensorSource, TensorSpec, copy_into
from hal.sync.errors import RankReport
from tests.multiproc import run_group

pytestmark = pytest.mark.multiprocess


def bounds_worker(rank, world):
    transport = BroadcastTransport(None, src=0)
    out: dict = {}
    try:
        transport.channel.agree(RankReport(), "unbounded")
    except RuntimeError as exc:
        out["outside"] = str(exc)
    for bad in (0, -1.0, True, "5"):
        try:
            with transport.bounded(bad):
                pass
        except ValueError as exc:
            out.setdefault("refused", []).append(str(exc))
    with transport.bounded(5):
        with transport.bounded(1.5):
            out["inner"] = transport.channel.timeout_s
        out["outer"] = transport.channel.timeout_s
    pairs = [("w", torch.arange(8, dtype=torch.float32))]
    if rank == 0:
        sender = Sender(transport, SyncConfig(bucket_bytes=4096, timeout_s=2.0))
        sender.send(TensorSource(pairs), version=1)  # the receiver takes this one
        start = time.monotonic()
        try:
            sender.send(TensorSource(pairs), version=2)  # and never answers this one
        except SyncError as exc:
            out["second"] = (type(exc).__name__, time.monotonic() - start)
    else:
        held = {"w": torch.zeros(8)}
        receiver = Receiver(transport, [TensorSpec.of("w", held["w"])], timeout_s=30.0)
        receiver.receive(copy_into(held))
        out["first"] = held["w"].tolist()
        time.sleep(8)  # not in a sync: the sender's own bound ends its wait
    return out


def test_the_sync_bounds_its_waits_and_a_channel_keeps_no_timeout():
    sender, receiver = run_group(bounds_worker, 2, timeout=120)
    for out in (sender, receiver):
        assert "a collective outside a sync" in out["outside"]
        assert len(out["refused"]) == 4 and all("timeout_s must be a positive number" in m for m in out["refused"])
        assert (out["inner"], out["outer"]) == (1.5, 5.0)  # restored when the inner bound ends
    assert receiver["first"] == list(range(8))
    kind, waited = sender["second"]
    assert kind == "PeerError" and 1.5 <= waited < 8, sender["second"]
