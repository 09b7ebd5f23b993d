"""A receiver of several senders puts whole tensors together from their shares.

Each sender's sync is received by its own `Receiver` (in its own thread), whose sink is
this assembler's part sink: every share that arrives is copied into its tensor's
assembly buffer, and once all of a tensor's shares are here the receiving thread hands
the whole tensor to the engine's sink (`drain`), in one thread, the caller's. So a tensor
reaches the engine only whole, with the new rows of every sender, never some new and
some old: a sender that fails part-way leaves its tensors as they were.

Memory: a tensor's assembly buffer lives from its first share to its handover. The
senders send in one order, so few tensors are open at once; a receiving thread that is
ahead of another waits before opening a new tensor while the open ones hold more than
`budget_bytes` (never the thread furthest behind, so the wait always ends).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any
import torch

from hal.backends.interface import Backend
from hal.sync import errors
from hal.sync.spec import TensorSpec
from hal.sync.sink import Pairs, Sink, SinkPolicy


@dataclass(slots=True)
class _Open:
    tensor: torch.Tensor  # the whole tensor being put together (a typed view of `raw`)
    raw: torch.Tensor  # its bytes, returned to the pool once handed over
    missing: int  # shares not here yet


class BufferPool:
    """Assembly buffers kept across syncs by size, at most `limit_bytes` of them: a fresh
    buffer per tensor per sync is page-faulted in every time (as the core's reassembly
    buffers were: docs/benchmarks.md), and the same sizes come back every sync."""

    def __init__(self, backend: Backend, limit_bytes: int) -> None:
        self.backend = backend
        self.limit_bytes = limit_bytes
        self.held_bytes = 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self.held_bytes -= nbytes
                return free.pop()
        return self.backend.empty(nbytes)

    def give(self, raw: torch.Tensor) -> None:
        nbytes = raw.numel()
        with self._lock:
            if self.held_bytes + nbytes <= self.limit_bytes:
                self._free.setdefault(nbytes, []).append(raw)
                self.held_bytes += nbytes


_Ready = tuple[TensorSpec, torch.Tensor, torch.Tensor]  # a whole tensor to hand over: spec, tensor, its raw bytes


@dataclass(frozen=True, slots=True)
class ShareInfo:
    """Where one wire tensor's rows (or block) go."""

    spec: TensorSpec  # the whole tensor
    index: int  # its place in the sync's order
    lo: int
    hi: int
    shares: int  # how many shares the tensor travels in
    region: tuple[slice, ...] | None = None  # a block that is not whole rows: where it goes (else rows lo..hi)


class PartSink:
    """The sink of one sender's `Receiver`: shares go to the assembler."""

    policy = SinkPolicy(in_place=False, apply_unchanged=True, destinations="none")

    def __init__(self, assembler: "Assembler", sender: int) -> None:
        self.assembler = assembler
        self.sender = sender

    def destination(self, name: str) -> torch.Tensor | None:
        return None

    def apply(self, pairs: Pairs) -> None:
        self.assembler.take(self.sender, pairs)

    def abort(self) -> None:
        self.assembler.abort()  # the engine's sink hears it once, from whichever part concludes first


class Assembler:
    """One sync's assembly (see the module doc); made by `ShardedReceiver.receive`."""

    def __init__(self, pool: BufferPool, streams: list[Any], budget_bytes: int, timeout_s: float, sink: Sink) -> None:
        """`streams`: one per sender's thread, then one for handing over (kept across syncs);
        `sink`: the engine's."""
        self.pool = pool
        self.sink = sink
        self._aborted = False
        self.backend = pool.backend
        self.streams = streams
        senders = len(streams) - 1
        self.budget_bytes = budget_bytes
        self.timeout_s = timeout_s
        self.shares: dict[str, ShareInfo] = {}
        self.destinations: dict[str, torch.Tensor] = {}
        self.discard = False  # the sync already failed: take shares, keep nothing
        self.error: BaseException | None = None  # the first failure of handing over
        self.touched = False  # the engine's sink got a tensor or a destination was written
        self.apply_s = 0.0  # handing whole tensors over: their copies into destinations and the sink's apply
        self._cond = threading.Condition()
        self._open: dict[str, _Open] = {}
        self._open_bytes = 0
        self._ready: list[_Ready] = []
        self._last = [-1] * senders  # per sender, the index of the last tensor it delivered to
        self._running = set(range(senders))

    def part_sink(self, sender: int) -> PartSink:
        return PartSink(self, sender)

    # ---- the receiving threads --------------------------------------------------------
    def take(self, sender: int, pairs: Pairs) -> None:
        """A segment's shares from `sender`'s receiver: into their tensors with one
        multi-tensor copy (the receiver's views are ready on the current stream)."""
        entries: list[tuple[ShareInfo, _Open]] = []
        targets: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        for wire_name, share in pairs:
            info = self.shares.get(wire_name)
            if info is None:  # checked against the header: cannot happen
                raise errors.SyncError(f"sender {sender} delivered {wire_name!r}, which no header announced")
            entry = self._entry(sender, info)
            if entry is None:  # the sync failed: keep nothing
                return
            entries.append((info, entry))
            if info.region is not None:
                targets.append(entry.tensor[info.region])
            else:
                targets.append(entry.tensor[info.lo : info.hi] if info.spec.shape else entry.tensor)
            rows.append(share)
        self._copy(self.streams[sender], targets, rows)
        with self._cond:
            for info, entry in entries:
                entry.missing -= 1
                if entry.missing == 0:
                    del self._open[info.spec.name]
                    self._ready.append((info.spec, entry.tensor, entry.raw))
            self._cond.notify_all()

    def _entry(self, sender: int, info: ShareInfo) -> _Open | None:
        name, deadline = info.spec.name, time.monotonic() + self.timeout_s
        with self._cond:
            if self.discard:
                return None
            self._last[sender] = info.index
            while name not in self._open:
                behind = [s for s in self._running if s != sender and self._last[s] < info.index]
                if self._open_bytes + info.spec.nbytes <= self.budget_bytes or not behind or not self._open:
                    raw = self.pool.take(info.spec.nbytes)
                    self._open[name] = _Open(raw.view(info.spec.dtype).reshape(info.spec.shape), raw, info.shares)
                    self._open_bytes += info.spec.nbytes
                    break
                if self.discard:
                    return None
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise errors.PeerError(
                        f"assembling {name!r}: waited {self.timeout_s} s for sender(s) {sorted(behind)} to catch up "
                        f"({self._open_bytes} bytes of tensors open)"
                    )
            return self._open[name]

    def expect(self, senders: set[int]) -> None:
        """Only these senders' threads deliver (the others' groups left the sync at its header)."""
        with self._cond:
            self._running = set(senders)

    def sender_done(self, sender: int) -> None:
        with self._cond:
            self._running.discard(sender)
            self._cond.notify_all()

    # ---- the caller's thread ------------------------------------------------------------
    def drain(self) -> None:
        """Hand every tensor to the sink as it completes, until every sender's thread ended."""
        while True:
            with self._cond:
                while not self._ready and self._running:
                    self._cond.wait(timeout=0.5)
                batch, self._ready = self._ready, []
                if not batch and not self._running:
                    return
            if not self.discard:
                start = time.perf_counter()
                try:
                    self._hand_over(self.sink, batch)
                except Exception as exc:  # noqa: BLE001 - reported at the agreement; the others keep receiving
                    self.error = exc
                    self.discard = True
                self.apply_s += time.perf_counter() - start
            for _, _, raw in batch:
                self.pool.give(raw)
            with self._cond:
                self._open_bytes -= sum(spec.nbytes for spec, _, _ in batch)
                self._cond.notify_all()

    def _hand_over(self, sink: Sink, batch: list[_Ready]) -> None:
        """Whole tensors into their destinations (one multi-tensor copy), then to `apply`."""
        destinations = self.destinations
        dsts = [destinations[spec.name] for spec, _, _ in batch if spec.name in destinations]
        if dsts:
            self._copy(self.streams[-1], dsts, [t for spec, t, _ in batch if spec.name in destinations])
        self.touched = True
        sink.apply([(spec.name, destinations.get(spec.name, tensor)) for spec, tensor, _ in batch])

    def _copy(self, stream: Any, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """One multi-tensor copy on this thread's stream, after what the current stream did
        (where the sources were made ready), done when this returns: a receiver's views
        are reused, and a sink reads its destinations, right after. Every shape was checked
        against its spec at the header."""
        if self.backend.supports_async_streams:
            stream.wait_stream(self.backend.current_stream())
        self.backend.copy_many_(dsts, srcs, stream=stream, shapes_checked=True)
        stream.synchronize()

    def abort(self) -> None:
        """The sync failed: tell the engine's sink, once (every part's conclusion calls this)."""
        if not self._aborted:
            self._aborted = True
            self.sink.abort()

    def stop(self) -> None:
        """The sync failed: take what still arrives and keep none of it."""
        with self._cond:
            self.discard = True
            self._cond.notify_all()

    def leftover(self) -> list[str]:
        """Tensors some of whose shares never came (after every thread ended)."""
        return sorted(self._open)

    def release(self) -> None:
        with self._cond:
            for entry in self._open.values():
                self.pool.give(entry.raw)
            self._open.clear()
            self._ready.clear()
            self._open_bytes = 0

