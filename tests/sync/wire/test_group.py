"""The sync group asks the hal backend for the group object of its library.

`hal.sync.wire.group.join_sync_group` builds gloo itself (it binds gloo's listener) and asks the
backend that speaks any other library, `Backend.new_process_group`: torch.distributed has no
`ProcessGroupHCCL` (torch_npu's class lives in its extension and takes an options object),
so the npu backend builds its own (tests/backends/test_npu_hccl_group.py). Ranks are
threads of this process over a real rendezvous; gloo stands in for the other library.
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

import hal
from hal.backends.cpu import CpuBackend
from hal.procs import free_port
from hal.sync.errors import PeerError
from hal.sync.wire import RendezvousServer, SyncGroupSpec, destroy_sync_group, join_sync_group

pytestmark = [pytest.mark.cpu, pytest.mark.timeout(60)]


class OtherLibrary(CpuBackend):
    """A backend of another collective library, whose group object it builds itself."""

    name = "other-library"
    dist_backend = "otherlib"

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, float]] = []

    def _new_process_group(self, store, rank, size, timeout):
        self.calls.append((rank, size, timeout.total_seconds()))
        return dist.ProcessGroupGloo(store, rank, size, timeout)


def _join_both(spec: SyncGroupSpec, backends: list, timeout_s: float = 20) -> list:
    groups: list = [None, None]
    errors: list = []

    def join(rank: int) -> None:
        try:
            groups[rank] = join_sync_group(spec, rank, backend=backends[rank], timeout_s=timeout_s)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 10)
    assert not errors, errors
    return groups


def _broadcast_works(groups: list) -> None:
    tensors = [torch.tensor([7.0, 8.0]), torch.zeros(2)]
    works = []
    for group, tensor in zip(groups, tensors):
        options = dist.BroadcastOptions()
        options.rootRank = 0
        works.append(group.broadcast([tensor], options))
    for work in works:
        work.wait()
    assert tensors[1].tolist() == [7.0, 8.0]


def test_a_library_other_than_gloo_is_built_by_the_backend_that_speaks_it():
    backend = OtherLibrary()
    spec = SyncGroupSpec(address="127.0.0.1", port=free_port(), world_size=2)
    groups = _join_both(spec, [backend, backend], timeout_s=17)
    try:
        assert sorted(backend.calls) == [(0, 2, 17.0), (1, 2, 17.0)]
        _broadcast_works(groups)
    finally:
        for group in groups:
            destroy_sync_group(group)


def test_the_library_named_as_a_string_is_built_by_the_backend_in_use():
    # the trainer side names the library (WeightSync passes `dist_backend`); the engine passes its backend
    backend = OtherLibrary()
    spec = SyncGroupSpec(address="127.0.0.1", port=free_port(), world_size=2)
    with hal.use(backend):
        groups = _join_both(spec, ["otherlib", None])
    try:
        assert len(backend.calls) == 2
        _broadcast_works(groups)
    finally:
        for group in groups:
            destroy_sync_group(group)


def test_a_library_the_backend_in_use_does_not_speak_is_refused_naming_both():
    spec = SyncGroupSpec(address="127.0.0.1", port=free_port(), world_size=2)
    with hal.use(CpuBackend()):
        with pytest.raises(ValueError, match=r"collective library 'hccl': the hal backend in use, 'cpu', speaks 'gloo'"):
            join_sync_group(spec, 0, backend="hccl", timeout_s=5)


def test_the_default_group_object_is_torch_distributeds_class_of_the_library():
    store = dist.HashStore()
    group = CpuBackend().new_process_group(store, 0, 1, datetime.timedelta(seconds=5))
    assert isinstance(group, dist.ProcessGroupGloo)
    with pytest.raises(ValueError, match=r"backend 'no-such-library': collective library 'nosuchlib': torch.distributed has no ProcessGroupNOSUCHLIB"):
        type("NoSuch", (CpuBackend,), {"name": "no-such-library", "dist_backend": "nosuchlib"})().new_process_group(
            store, 0, 1, datetime.timedelta(seconds=5))


@pytest.mark.parametrize(
    ("rank", "size", "timeout", "message"),
    [
        (2, 2, datetime.timedelta(seconds=1), r"rank 2 is not a rank of a group of 2"),
        (0, 0, datetime.timedelta(seconds=1), r"size must be an int >= 1, got 0"),
        (0, 2, 5.0, r"timeout must be a positive timedelta, got 5.0"),
        (0, 2, datetime.timedelta(0), r"timeout must be a positive timedelta"),
    ],
)
def test_new_process_group_refuses_arguments_naming_them(rank, size, timeout, message):
    backend = OtherLibrary()
    with pytest.raises(ValueError, match=rf"backend 'other-library': new_process_group: {message}"):
        backend.new_process_group(dist.HashStore(), rank, size, timeout)
    assert backend.calls == []


def test_rank_0_with_a_rendezvous_server_of_its_own_meets_the_other_ranks():
    """Given its caller's server (WeightSync's trainer), rank 0 builds the group once the
    other rank counted itself in; the group then works as any."""
    spec = SyncGroupSpec.create(world_size=2)
    server = RendezvousServer(spec, timeout_s=20)
    groups: list = [None, None]

    def join(rank: int) -> None:
        groups[rank] = join_sync_group(spec, rank, backend="gloo", timeout_s=20, server=server if rank == 0 else None)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    try:
        _broadcast_works(groups)
    finally:
        for group in groups:
            if group is not None:
                destroy_sync_group(group)


def test_a_rendezvous_closed_before_the_other_ranks_came_ends_rank_0s_join_at_once_and_quietly(monkeypatch, capfd):
    """An engine that refuses the trainer's init never reaches the store; the trainer then
    closes its rendezvous. Rank 0 was waiting for the others to count themselves in, not in
    the group's own rendezvous (a store call cut off by the close prints c10d's C++ stack):
    its join raises PeerError and prints nothing."""
    spec = SyncGroupSpec.create(world_size=2)
    server = RendezvousServer(spec, timeout_s=60)
    waiting = threading.Event()
    wait_for_ranks = RendezvousServer.wait_for_ranks

    def announced(self, *args, **kwargs):
        waiting.set()
        return wait_for_ranks(self, *args, **kwargs)

    monkeypatch.setattr(RendezvousServer, "wait_for_ranks", announced)
    library = OtherLibrary()  # records every group it is asked to build
    outcome: list = []

    def join() -> None:
        try:
            outcome.append(join_sync_group(spec, 0, backend=library, timeout_s=60, server=server))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            outcome.append(exc)

    thread = threading.Thread(target=join)
    thread.start()
    assert waiting.wait(30), "rank 0 never began to wait for the other ranks"
    server.close()
    thread.join(30)
    [exc] = outcome
    assert isinstance(exc, PeerError) and "the rendezvous was closed while waiting for the other ranks" in str(exc), exc
    assert library.calls == [], "rank 0 entered the group's own rendezvous"
    printed = capfd.readouterr()
    assert "c10d" not in printed.err + printed.out
