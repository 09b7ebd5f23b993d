"""The one place a sync's sender and receiver are chosen (hal.sync.endpoints), the one way a
failure of any class crosses ranks (`RankReport`, `rebuild`), and the pieces derived once:
the version check, the wait bounds. No process group is needed: fakes stand in for groups."""

from __future__ import annotations

import pytest
import torch

import hal
from hal.sync import (
    SENDING,
    TRANSPORTS,
    BroadcastTransport,
    HierarchicalTransport,
    IpcTransport,
    Receiver,
    Sender,
    ShardedReceiver,
    SpecMismatchError,
    SyncConfig,
    SyncReceiver,
    TensorSpec,
    VersionError,
    WaitBounds,
    make_receiver,
    open_transport,
)
from hal.sync import errors
from hal.sync.endpoints import make_sender
from hal.sync.errors import RankReport, check_version

pytestmark = pytest.mark.cpu


class FakeGroup:
    """What a channel asks of a process group at construction: its rank and size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


SPECS = [TensorSpec("w", (4,), torch.float32)]


def test_the_registry_names_every_transport_and_refuses_others_by_name():
    assert dict(TRANSPORTS) == {"broadcast": BroadcastTransport, "ipc": IpcTransport, "hierarchical": HierarchicalTransport}
    transport = open_transport("broadcast", FakeGroup(1, 2), control_device="cpu")
    assert isinstance(transport, BroadcastTransport) and transport.rank == 1 and not transport.is_sender
    with pytest.raises(ValueError, match=r"unknown transport 'carrier-pigeon'; valid: broadcast, ipc, hierarchical"):
        open_transport("carrier-pigeon", FakeGroup(1, 2), control_device="cpu")


def test_a_transport_has_a_control_channel_and_is_not_one():
    from hal.sync.wire import GroupChannel, SyncChannel

    transport = BroadcastTransport(FakeGroup(0, 3), src=0)
    assert not isinstance(transport, GroupChannel)
    assert isinstance(transport.channel, SyncChannel) and transport.channel.name == "broadcast"
    assert (transport.rank, transport.world_size, transport.src, transport.is_sender) == (0, 3, 0, True)
    with transport.bounded(2.5):
        assert transport.channel.timeout_s == 2.5  # one bound for the bytes and the control messages


def test_the_receiver_follows_who_sends():
    with hal.use("cpu"):
        one = make_receiver("one", [BroadcastTransport(FakeGroup(1, 2))], SPECS, timeout_s=5.0)
        gathered = make_receiver("gather", [BroadcastTransport(FakeGroup(1, 2))], SPECS, timeout_s=5.0)
        every = make_receiver("all", [BroadcastTransport(FakeGroup(1, 2)), BroadcastTransport(FakeGroup(1, 2))], SPECS, timeout_s=5.0, version=3)
    assert type(one) is Receiver and type(gathered) is Receiver
    assert type(every) is ShardedReceiver and every.sender_count == 2 and every.version == 3
    for receiver in (one, every):
        assert isinstance(receiver, SyncReceiver)
        assert (receiver.consistent, receiver.torn) == (True, ())
    with pytest.raises(ValueError, match="one transport, got 2"):
        make_receiver("one", [BroadcastTransport(FakeGroup(1, 2))] * 2, SPECS, timeout_s=5.0)
    with pytest.raises(ValueError, match=r"sending must be one of one, gather, all, got 'master'"):
        make_receiver("master", [BroadcastTransport(FakeGroup(1, 2))], SPECS, timeout_s=5.0)
    assert SENDING == ("one", "gather", "all")


def test_the_sender_of_one_process():
    with hal.use("cpu"):
        sender = make_sender("one", BroadcastTransport(FakeGroup(0, 2)), config=SyncConfig(timeout_s=3.0))
    assert type(sender) is Sender and sender.config.bounds == WaitBounds(3.0)
    with pytest.raises(ValueError, match="this rank sends, so it needs its transport"):
        make_sender("all", None)


def test_a_version_is_checked_once_the_same_way_everywhere():
    assert check_version(7) == 7
    for bad in (-1, 2**63, True, "3", 1.0):
        with pytest.raises(VersionError, match="version must be a non-negative int below 2\\*\\*63"):
            check_version(bad)
    # both of what callers caught before: a ValueError (Sender, TrainerSync) and a TypeError (WeightSync)
    assert issubclass(VersionError, ValueError) and issubclass(VersionError, TypeError)


def test_every_derived_wait_bound_comes_from_the_timeout():
    bounds = SyncConfig(timeout_s=4.0).bounds
    assert (bounds.step_s, bounds.behind_s) == (4.0, 8.0)


def test_a_failure_of_any_class_crosses_ranks_and_is_rebuilt_alike():
    for exc, cls in ((ValueError("bad value"), ValueError), (KeyError("k"), KeyError), (OSError("port taken"), RuntimeError),
                     (TimeoutError("slow"), TimeoutError), (NotImplementedError("later"), NotImplementedError)):
        report = errors.report_exception(exc, sender=True, keep_class=True)
        told = RankReport.decode(report.encode(), report.flags)
        rebuilt = errors.rebuild(told, "trainer rank 1: ")
        message = rebuilt.args[0]  # (str() of a KeyError quotes it)
        assert type(rebuilt) is cls and message.startswith("trainer rank 1: ") and str(exc) in message
    # a sync's own agreement never raises a plain class, whatever a peer says
    with pytest.raises(errors.SyncError) as raised:
        errors.raise_if_any([RankReport(error="told", kind="value")], 1, "sync")
    assert type(raised.value) is errors.SyncError


def test_a_retold_sync_error_keeps_who_failed_and_who_holds_part_of_it():
    failure = SpecMismatchError("shapes", reports={0: RankReport(sender=True, error="x"), 2: RankReport(inconsistent=True)})
    report = errors.report_exception(failure, sender=True, keep_class=True)
    rebuilt = errors.rebuild(RankReport.decode(report.encode(), report.flags))
    assert type(rebuilt) is SpecMismatchError and rebuilt.trainer_side and rebuilt.inconsistent_ranks == [2]
    # without keep_class a sync's report is as before: the class named in the message
    plain = errors.report_exception(KeyError("k"), sender=False)
    assert (plain.kind, plain.error, plain.told) == ("error", "KeyError: 'k'", ())
    assert RankReport.decode('{"e":"x","k":"spec","r":[[1,"a"]]}').kind == "peer"  # malformed: refused as unreadable
