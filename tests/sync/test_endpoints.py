"""The one place a sync's sender and receiver are chosen (hal.sync.endpoints), the one
contract of each side (`SyncSender`, `SyncReceiver`), the trainer's side of a sync group
opened one way (`TrainerSide`), the one way a failure of any class crosses ranks
(`RankReport`, `rebuild`, `agree_failure`), and the pieces derived once: the version check,
the wait bounds. Fakes stand in for groups, but for `TrainerSide`'s (threads of this process)."""

from __future__ import annotations

import threading

import pytest
import torch

import hal
from hal.procs import free_port
from hal.sync import (
    SENDING,
    TRANSPORTS,
    BroadcastTransport,
    HierarchicalTransport,
    IpcTransport,
    Receiver,
    Sender,
    ShardedReceiver,
    ShardedSender,
    SpecMismatchError,
    SyncConfig,
    SyncReceiver,
    SyncSender,
    TensorSource,
    TensorSpec,
    TrainerSide,
    TrainerSync,
    VersionError,
    WaitBounds,
    make_receiver,
    open_transport,
)
from hal.sync import errors
from hal.sync.endpoints import make_sender
from hal.sync.errors import PeerError, RankReport, agree_failure, check_version
from hal.sync.wire import SyncGroupSpec, destroy_sync_group, join_sync_group

pytestmark = pytest.mark.cpu


class FakeGroup:
    """What a channel asks of a process group at construction: its rank and size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def allreduce(self, tensors, options):
        assert self._size == 1, "a fake group reduces only over itself"
        return Done()


class Done:
    def wait(self, timeout=None) -> bool:
        return True


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


def test_every_sending_side_is_a_sync_sender_and_frees_its_transport_on_close():
    """`Sender`, `TrainerSync` and `ShardedSender` have one contract: `sync`, `version`, `close`."""
    with hal.use("cpu"):
        transports = [BroadcastTransport(FakeGroup(0, 2)) for _ in range(3)]
        one = make_sender("one", transports[0])
        gather = make_sender("gather", transports[1], trainer_group=FakeGroup(0, 1))  # this rank sends, alone in its group
        every = make_sender("all", transports[2], trainer_group=FakeGroup(0, 1))
    assert (type(one), type(gather), type(every)) == (Sender, TrainerSync, ShardedSender)
    for sender in (one, gather, every):
        assert isinstance(sender, SyncSender) and sender.version is None
        sender.close()
    assert not isinstance(Receiver(BroadcastTransport(FakeGroup(1, 2)), SPECS, timeout_s=5.0), SyncSender)


def _receive_in_thread(spec: SyncGroupSpec, got: dict) -> threading.Thread:
    """The receiving rank of `spec` (rank 1): joins, then receives one sync into `got`."""

    def run() -> None:
        group = join_sync_group(spec, 1, backend="gloo", timeout_s=20)
        try:
            receiver = Receiver(BroadcastTransport(group), [TensorSpec("w", (4,), torch.float32)], timeout_s=20)
            receiver.receive(lambda pairs: got.update((n, t.clone()) for n, t in pairs))
            got["version"] = receiver.version
        finally:
            destroy_sync_group(group)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_trainer_side_serves_joins_in_a_thread_opens_the_transport_and_makes_the_sender():
    spec = SyncGroupSpec(address="127.0.0.1", port=free_port(), world_size=2)
    got: dict = {}
    with hal.use("cpu") as backend:
        side = TrainerSide(spec, backend=backend, timeout_s=20)
        joining = side.join()
        assert side.join() is joining  # once
        receiving = _receive_in_thread(spec, got)
        group = side.group_within("the test's sync group", 30)
        sender = side.open("one", "broadcast", config=SyncConfig(timeout_s=20))
        try:
            assert type(sender) is Sender and sender.transport.group is group and side.group is group
            metrics = sender.sync(TensorSource([("w", torch.arange(4.0))]), version=3)
            receiving.join(30)
            assert (metrics.sending, sender.version, got["version"]) == ("one", 3, 3)
            assert torch.equal(got["w"], torch.arange(4.0))
        finally:
            sender.close()
            destroy_sync_group(group)


def test_a_trainer_side_closed_before_the_receivers_came_ends_its_join_and_opens_nothing():
    spec = SyncGroupSpec(address="127.0.0.1", port=free_port(), world_size=2)
    with hal.use("cpu") as backend:
        side = TrainerSide(spec, backend=backend, timeout_s=60)
        joining = side.join()
        side.close()  # an engine refused: nobody comes
        with pytest.raises(PeerError, match="the rendezvous was closed"):
            joining.result(30)
        assert side.group is None
        with pytest.raises(RuntimeError, match="is not joined"):
            side.open("one", "broadcast")


class Told:
    """A channel whose agreement hands back what each rank told (this rank's report at `rank`)."""

    def __init__(self, others: list[RankReport | None], rank: int = 0) -> None:
        self.others, self.rank = others, rank

    def agree(self, report: RankReport, what: str) -> list[RankReport]:
        told = [report if r is None else r for r in self.others]
        return [RankReport.decode(r.encode(), r.flags) for r in told]  # as they cross ranks


def test_a_step_of_a_composite_of_ranks_ends_in_the_same_error_on_every_rank():
    prefix = lambda rank: f"trainer rank {rank}: "  # noqa: E731
    assert agree_failure(Told([None, RankReport()]), None, "init", prefix) is None
    # rank 1's ValueError, even without a message, is every rank's
    told = errors.report_exception(ValueError(), sender=True, keep_class=True)
    failure = agree_failure(Told([None, told]), None, "init", prefix)
    assert type(failure) is ValueError and failure.args[0] == "trainer rank 1: "
    mine = agree_failure(Told([None, told]), KeyError("k"), "init", prefix)
    assert type(mine) is KeyError and mine.args[0] == "trainer rank 0: 'k'"  # the lowest rank first
    # the outcome of M groups alike: every failing rank's retold reports as one
    lost = PeerError("worker 2 died", reports={0: RankReport(sender=True), 2: RankReport(error="x")})
    torn = SpecMismatchError("shapes", reports={0: RankReport(sender=True, error="bad"), 1: RankReport(inconsistent=True)})
    failure = agree_failure(
        Told([None, errors.report_exception(torn, sender=True, keep_class=True)]), lost, "outcome",
        lambda rank: "" if rank == 0 else prefix(rank), my_rank=0, together=True,
    )
    assert type(failure) is PeerError and str(failure) == "worker 2 died"
    assert (failure.trainer_side, failure.inconsistent_ranks, failure.failed_ranks) == (True, [1], [0, 2])


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


_SENDING_SIDES = {"Sender", "TrainerSync", "ShardedSender", "Driver", "OneSender", "GatherThenSend", "EveryRankSends"}


def test_no_module_of_hal_branches_on_which_sending_side_it_holds():
    """A caller that asks `isinstance(sender, ...)` is a missing method of the contract
    (`SyncSender`; the vLLM drivers' `Driver`): each says what differs itself."""
    import ast
    from pathlib import Path

    root = Path(hal.__file__).parent
    offences = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass"):
                if len(node.args) == 2:
                    named = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", "") for n in ast.walk(node.args[1])}
                    if named & _SENDING_SIDES:
                        offences.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert not offences, offences
