"""`PeerTransport` (hal.sync.transport.peer): the links of one sync group, point to point from
its sender to each receiver alone: each receiver its own header, its own segments after
their own statuses; a failure announced on one link leaves the other's bytes alone."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hal.sync.errors import RankReport
from hal.sync.plan.buckets import build_plan
from hal.sync.spec import TensorSpec
from hal.sync.transport import PeerChannel, PeerTransport, peer_links
from tests.multiproc import run_group

TIMEOUT_S = 30.0


def link_plan(link: int):
    """Link 1: three buckets of two tensors; link 2: two buckets (another layout)."""
    count = 6 if link == 1 else 4
    return build_plan([TensorSpec(f"t{link}.{i}", (512,), torch.float32) for i in range(count)], 4096 + 64, segment_bytes=4096)


def pattern(link: int, k: int, nbytes: int) -> torch.Tensor:
    return (torch.arange(nbytes, dtype=torch.int64) * (link + 1) + k).to(torch.uint8)


def peer_worker(rank, world):
    import hal

    with hal.use("cpu"):
        backend = hal.get_backend("cpu")
        group = dist.group.WORLD
        if rank == 0:
            links = peer_links(group)
            channel = links[0].channel
            with channel.bounded(TIMEOUT_S):
                channel.send_headers({1: b"to one", 2: b"to two, longer"})
                channel.exchange_header(b"to both")
                plans = {t.peer: link_plan(t.peer) for t in links}
                for t in links:
                    t.prepare(backend, plans[t.peer])
                ready = backend.new_stream().record_event()
                steps = {t.peer: [(b.index, j, s) for b in plans[t.peer].buckets for j, s in enumerate(b.segments)] for t in links}
                for i in range(max(len(s) for s in steps.values())):  # rounds: link 1's segment i, then link 2's
                    for t in links:
                        if i >= len(steps[t.peer]):
                            continue
                        k, j, segment = steps[t.peer][i]
                        if k >= 2 and j == 0:
                            t.wait_sent(k - 2)
                        if t.peer == 2 and k == 1:
                            t.send_failure(k, j)  # link 2's source failed at bucket 1: announced on link 2 alone
                            steps[2] = []
                            continue
                        buffer = t.buffer(k)
                        buffer[segment.start : segment.stop] = pattern(t.peer, k, segment.stop - segment.start)
                        t.send_segment(k, j, segment.start, buffer[segment.start : segment.stop], ready=ready, direct=False)
                for t in links:
                    t.finish()
                channel.agree(RankReport(sender=True), "done")
            return [t.peer for t in links], len({id(t.channel) for t in links})
        transport = PeerTransport(group, src=0)
        channel = transport.channel
        with channel.bounded(TIMEOUT_S):
            own, both = channel.receive_header(), channel.exchange_header(None)
            plan = link_plan(rank)
            transport.prepare(backend, plan)
            got = []

            def complete(k, j, landed, status):
                segment = plan.buckets[k].segments[j]
                data = transport.buffer(k)[segment.start : segment.start + status.nbytes]
                got.append((k, j, torch.equal(data, pattern(rank, k, status.nbytes))))

            failed = transport.receive_segments(lambda k, j, status: None, complete)
            transport.finish()
            channel.agree(RankReport(), "done")
        return own, both, failed, got


@pytest.mark.multiprocess
def test_each_receiver_gets_its_own_header_and_segments_and_a_failure_stays_on_its_link():
    sender, one, two = run_group(peer_worker, 3, timeout=120, collective_timeout=TIMEOUT_S)
    assert sender == ([1, 2], 1)  # one link per receiver, sharing the group's channel
    own, both, failed, got = one
    assert (own, both, failed) == (b"to one", b"to both", False)
    assert got == [(k, j, True) for k, b in enumerate(link_plan(1).buckets) for j, _ in enumerate(b.segments)] and len(got) >= 3
    own, both, failed, got = two
    assert (own, both, failed) == (b"to two, longer", b"to both", True)
    assert got == [(0, j, True) for j, _ in enumerate(link_plan(2).buckets[0].segments)]  # bucket 0, then the failure


class FakeGroup:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def test_a_link_names_its_receiver_and_a_receiver_only_its_own():
    with pytest.raises(ValueError, match="needs peer="):
        PeerTransport(FakeGroup(0, 3), src=0)
    with pytest.raises(ValueError, match="peer=0 is not a receiver"):
        PeerTransport(FakeGroup(0, 3), src=0, peer=0)
    with pytest.raises(ValueError, match="receives its own link only, not rank 2's"):
        PeerTransport(FakeGroup(1, 3), src=0, peer=2)
    with pytest.raises(ValueError, match="is not the group's sender"):
        peer_links(FakeGroup(1, 3))
    assert PeerTransport(FakeGroup(2, 3), src=0).peer == 2
    links = peer_links(FakeGroup(0, 3))
    assert [t.peer for t in links] == [1, 2] and links[0].channel is links[1].channel
    assert isinstance(links[0].channel, PeerChannel) and links[0].channel.receivers == [1, 2]
    with pytest.raises(ValueError, match="a header for each of the receivers"):
        links[0].channel.send_headers({1: b"x"})

