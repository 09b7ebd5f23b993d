"""The sync group: trainer rank 0 and every engine worker, outside c10d's registry.

A group made here leaves each process's default process group (a trainer's FSDP group)
alone, and its rendezvous listens only where it is told: rank 0 serves the store on a
socket it bound to `SyncGroupSpec.address` (torch's own TCPStore server listens on every
interface, whatever host it is given: measured), and gloo's listener goes on a loopback
address when the group is one node's. Every rank joins here: the trainer's sender and
the hal vLLM engine's workers alike (vLLM's own stateless helper would ask the vLLM platform
for a device group, which vllm-ascend's `NPUPlatform` cannot build). The group object of a
library other than gloo is the hal backend's to build (`Backend.new_process_group`:
torch_npu's HCCL group on the npu backend). The rendezvous layout is that of vLLM's
`stateless_init_torch_distributed_process_group`, so a process joining with that helper
still meets the ranks that join here (unless rank 0 joins with a `RendezvousServer` of its
caller's: it then waits for every other rank to count itself in, as only ranks joining here do).

    spec = SyncGroupSpec.create(world_size=1 + workers)           # on the trainer's side
    group = join_sync_group(spec, rank, timeout_s=60)             # every rank, concurrently
    transport = BroadcastTransport(group, src=0)
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from hal.backends.interface import Backend
from hal.procs import free_port
from hal.sync.errors import PeerError

LOOPBACK = "127.0.0.1"
# Where every rank but 0 counts itself in once it reached the store, before it builds the
# group; rank 0 serving a closable `RendezvousServer` builds its own once all have (see there).
_ARRIVED = "hal/arrived"
_POLL_S = 0.005


def _is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncGroupSpec:
    """Where the sync group meets: rank 0 (the trainer's sender) serves the rendezvous.

    Made once by the trainer side and handed to every actor of the group (it pickles).
    """

    address: str
    """Where rank 0's rendezvous store listens (that address only) and every rank connects.
    127.0.0.1 when every rank is on one node; the trainer rank 0's node address otherwise."""
    port: int
    """TCP port of the rendezvous store."""
    world_size: int
    """Ranks in the group: the sender (rank 0) and every receiving engine worker."""

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not self.address.strip():
            raise ValueError(f"SyncGroupSpec.address must be a non-empty host, got {self.address!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"SyncGroupSpec.port must be a TCP port (1..65535), got {self.port!r}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 2:
            raise ValueError(f"SyncGroupSpec.world_size must be an int of at least 2 (a sender and a receiver), got {self.world_size!r}")

    @classmethod
    def create(cls, world_size: int, *, address: str = LOOPBACK) -> SyncGroupSpec:
        """A spec on a port of `address` that was free a moment ago (call it on rank 0's node).

        The port is only reserved once rank 0 joins: should something take it in between,
        rank 0's `join_sync_group` fails at once, naming it, and a new spec is the remedy.
        """
        return cls(address=address, port=free_port(address), world_size=world_size)

    @property
    def init_method(self) -> str:
        """`tcp://<address>:<port>`: also the prefix of every key the group keeps in the store."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"tcp://{host}:{self.port}"


def join_sync_group(
    spec: SyncGroupSpec,
    rank: int,
    *,
    backend: Backend | str | None = None,
    timeout_s: float = 60.0,
    bind_address: str | None = None,
    server: "RendezvousServer | None" = None,
) -> Any:
    """Join the sync group as `rank`; returns the group hal's transports speak to.

    Every rank of `spec` calls this (concurrently: it returns once all have joined). The
    group is a c10d backend object created outside c10d's registry: for gloo,
    `torch.distributed.ProcessGroupGloo` (bound as below); for any other library, what the
    hal backend that speaks it builds, `Backend.new_process_group` (torch.distributed's
    `ProcessGroup<NAME>` by default; torch_npu's HCCL group on the npu backend). It leaves
    this process's default process group (a trainer's FSDP group) alone, and
    `torch.distributed.broadcast(..., group=...)` does not accept it; hal's transports call
    its methods. `backend`: a hal Backend whose `dist_backend` to use, or a collective
    library's name ("gloo", or the library of the backend in use, `hal.current()`, which then
    builds the group); None: `hal.current()`. Every rank must name the same library.

    Rank 0 serves the rendezvous store on `spec.address` only. A gloo rank's own listener
    goes on `bind_address`: by default `spec.address` when that is a loopback address (a
    one-node group), else where gloo puts it by default (the address the host name
    resolves to, or GLOO_SOCKET_IFNAME): pass the node's address across nodes (in a Ray
    actor, `ray.util.get_node_ip_address()`). Other libraries pick their interface from
    their own variables (NCCL_SOCKET_IFNAME, HCCL_IF_IP); `bind_address` is refused for them.

    Rank 0 serves the rendezvous from `server` when given (a `RendezvousServer` of this
    spec the caller made first, so that it can end a join still waiting from another
    thread: `server.close()`), else from one of its own. Either way the server lives as
    long as the group and closes with `destroy_sync_group`. With `server` given, rank 0
    builds its group only once every other rank has counted itself in (as this function
    does on those ranks; a rank that joins with vLLM's helper does not), so that a rendezvous
    closed before then ends the join quietly (`RendezvousServer.wait_for_ranks`).

    Raises PeerError when the other ranks do not all arrive within `timeout_s` (which is
    also the group's default timeout for every collective), or at once when `server` closes.
    """
    if not isinstance(spec, SyncGroupSpec):
        raise TypeError(f"spec must be a SyncGroupSpec, got {type(spec).__name__}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < spec.world_size:
        raise ValueError(f"rank {rank!r} is not a rank of a sync group of world_size {spec.world_size}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    library = _library_name(backend)
    builder = None if library == "gloo" else _group_builder(backend, library)
    if library == "gloo":
        if bind_address is None and _is_loopback(spec.address):
            bind_address = spec.address
    elif bind_address is not None:
        raise ValueError(
            f"bind_address applies to gloo only; collective library {library!r} chooses its "
            f"interface from its own environment variables"
        )
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    where = f"sync group {spec.init_method} (world_size {spec.world_size}), rank {rank}"
    owned = None
    if rank == 0 and server is None:
        server = owned = RendezvousServer(spec, timeout_s=timeout_s)
    elif server is not None and (rank != 0 or server.spec != spec):
        raise ValueError(f"{where}: a RendezvousServer is rank 0's, of the same spec")
    if server is not None and server.closed:
        raise PeerError(f"{where}: the rendezvous was closed before rank 0 joined")
    try:
        # Every rank, rank 0 too, is a client of the server: a join waiting for the others
        # ends as soon as the server closes (its connection drops), not at the timeout.
        store = server.client if server is not None else dist.TCPStore(spec.address, spec.port, spec.world_size, False, timeout)
        # vLLM's stateless helper keeps its keys under this prefix: either side may use it.
        prefixed = dist.PrefixStore(spec.init_method, store)
        if rank != 0:
            prefixed.add(_ARRIVED, 1)
        elif owned is None and server is not None:
            server.wait_for_ranks(prefixed, spec.world_size - 1, timeout_s, where)
        if builder is None:
            group = _gloo_group(prefixed, rank, spec.world_size, timeout, bind_address)
        else:
            group = builder.new_process_group(prefixed, rank, spec.world_size, timeout)
    except BaseException as exc:
        if owned is not None:
            owned.close()
        if isinstance(exc, (RuntimeError, TimeoutError)) and not isinstance(exc, PeerError):
            # torch's DistStoreError and gloo's errors are RuntimeErrors
            closed = " (the rendezvous was closed)" if server is not None and server.closed else ""
            raise PeerError(f"{where}: could not join within {timeout_s:g} s{closed}: {type(exc).__name__}: {exc}") from exc
        raise
    if server is not None:
        # c10d's group objects take no attributes: the server closes when the group object
        # goes, or at destroy_sync_group
        _SERVERS[group] = weakref.finalize(group, server.close)
    return group


def _library_name(backend: Backend | str | None) -> str:
    if backend is None:
        import hal

        return hal.current().dist_backend
    if isinstance(backend, Backend):
        return backend.dist_backend
    if isinstance(backend, str) and backend.strip():
        return backend.strip().lower()
    raise TypeError(f"backend must be a collective library name, a hal Backend or None, got {backend!r}")


# Rank 0's rendezvous server of each group: closing it, by the group it serves.
_SERVERS: "weakref.WeakKeyDictionary[Any, weakref.finalize]" = weakref.WeakKeyDictionary()


class RendezvousServer:
    """Rank 0's rendezvous store, served on a socket bound to `spec.address` only (torch's
    own TCPStore server listens on every interface, whatever host it is given: measured).

    Made before rank 0 joins (`join_sync_group(..., server=...)`), it can be closed from
    any thread: a join still waiting for ranks that will never come (an engine refused
    the trainer's init) then fails at once, and its port and thread are gone, instead of
    lingering until the timeout.
    """

    def __init__(self, spec: SyncGroupSpec, *, timeout_s: float = 60.0) -> None:
        import torch.distributed as dist

        self.spec = spec
        fd = _listening_socket(spec.address, spec.port)
        ours = os.fstat(fd)
        try:
            # The store owns the descriptor from here on: it closes it when the store is freed,
            # and also when its constructor fails. It does not wait for the ranks: they join
            # as its clients (rank 0 too), and only they wait.
            self._store: Any = dist.TCPStore(
                spec.address, spec.port, spec.world_size, True, datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False, master_listen_fd=fd,
            )
        except BaseException:
            # Close it only if it is still our socket: the number may already be someone else's.
            try:
                still = os.fstat(fd)
            except OSError:
                still = None
            if still is not None and (still.st_dev, still.st_ino) == (ours.st_dev, ours.st_ino):
                os.close(fd)
            raise
        # Rank 0's own connection, made now: a connect retries until its timeout when
        # nothing listens, so joining after a close would wait; this one fails at once.
        self.client: Any = dist.TCPStore(spec.address, spec.port, spec.world_size, False, datetime.timedelta(seconds=timeout_s))
        self._lock = threading.Lock()  # no call of rank 0's on the store is under way when it closes

    @property
    def closed(self) -> bool:
        return self._store is None

    def close(self) -> None:
        """Stop serving: the port closes and every rank still joining fails. Safe to call twice."""
        with self._lock:
            self._store = self.client = None

    def wait_for_ranks(self, store: Any, count: int, timeout_s: float, where: str) -> None:
        """Return once `count` ranks have counted themselves in (`store`: rank 0's view of
        this server, prefixed as the group's keys are); PeerError, naming `where`, if the
        server closes first or `timeout_s` passes. The count is polled, never waited for in
        the store: a store call that a close cuts off prints c10d's C++ stack (its
        "recvValue failed" warning), and the group's own rendezvous, in which rank 0 would
        otherwise wait, is such a call. Ranks refused before they reach the store (an engine
        that refuses the trainer's token) so never leave rank 0 in one."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self.closed:
                    raise PeerError(f"{where}: the rendezvous was closed while waiting for the other ranks")
                arrived = store.add(_ARRIVED, 0)
            if arrived >= count:
                return
            if time.monotonic() >= deadline:
                raise PeerError(f"{where}: {arrived} of the {count} other ranks arrived within {timeout_s:g} s")
            time.sleep(_POLL_S)


def _listening_socket(address: str, port: int) -> int:
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ValueError(f"sync group address {address!r} does not resolve: {exc}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen()
    except OSError as exc:
        sock.close()
        raise PeerError(
            f"sync group rank 0 cannot listen on {address}:{port}: {exc} "
            f"(taken since the SyncGroupSpec was made? make a new spec)"
        ) from None
    return sock.detach()


def _gloo_group(store: Any, rank: int, size: int, timeout: datetime.timedelta, bind_address: str | None) -> Any:
    import torch.distributed as dist

    if bind_address is None:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    # Private names, here only: the constructor that takes a device needs ProcessGroupGloo's
    # `_Options` (its `_devices`, `_timeout`); torch offers no public way to put gloo's
    # listener on one address (GLOO_SOCKET_IFNAME takes an interface name, process-wide).
    # `create_device` is public. tests/integrations/ray/test_ray.py checks these still exist.
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_address)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, options)


def _group_builder(backend: Backend | str | None, library: str) -> Backend:
    """The hal backend that builds a `library` group: the one passed, else the one in use,
    which must speak `library` (a library named for another device is a mistake to name)."""
    if isinstance(backend, Backend):
        return backend
    import hal

    current = hal.current()
    if current.dist_backend != library:
        raise ValueError(
            f"collective library {library!r}: the hal backend in use, {current.name!r}, speaks "
            f"{current.dist_backend!r}; pass the hal Backend whose library {library!r} is (backend=...)"
        )
    return current


def destroy_sync_group(group: Any) -> None:
    """Shut down a group from `join_sync_group` (or vLLM's stateless helper).

    Its sockets (the rendezvous store on rank 0, gloo's listener and connections) close
    when the last reference to the group goes: drop the transport, Sender or Receiver
    that holds it as well. Safe to call twice.
    """
    shutdown = getattr(group, "shutdown", None)
    try:
        if shutdown is not None:
            shutdown()
    finally:
        close = _SERVERS.pop(group, None)
        if close is not None:
            close()
