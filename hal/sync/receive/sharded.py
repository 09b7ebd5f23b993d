"""The receiving side of an M-to-N sync: an engine worker receives from every trainer
rank at once and hands its sink whole tensors (the protocol: hal.sync.send.sharded; the
assembly: hal.sync.receive.assembly). It is made of one `Receiver` per sender, each receive an
`IncomingSync` that checks, delivers and concludes that sender's part (hal.sync.receive.receiver);
what is its own is judging the headers together, the threads, and the agreements that
bind the senders' groups."""

from __future__ import annotations

import collections
import contextlib
import operator
import time
from typing import Any, Iterable, Sequence


from hal.backends.interface import Backend
from hal.sync import errors
from hal.sync.receive.assembly import Assembler, BufferPool, ShareInfo
from hal.sync.errors import RankReport
from hal.sync.receive.delivery import destination_problem
from hal.sync.plan.shards import covering_blocks, parse_block_name
from hal.sync.metrics import SyncMetrics
from hal.sync.spec import TensorSpec
from hal.sync.receive.every_sender import FromEverySender, unwrapped
from hal.sync.receive.receiver import IncomingSync
from hal.sync.sink import Sink, as_sink
from hal.sync.transport.base import Transport


class ShardedReceiver(FromEverySender):
    """An engine worker receiving from every trainer rank at once (see the module doc).

    `transports`: one per trainer rank, in trainer-rank order (each that rank's group with
    the engine workers). `specs`, `timeout_s`, `token`, `validate` as for `Receiver`,
    about whole tensors. `budget_bytes` bounds the tensors being put together at once
    (`hal.sync.receive.assembly`). A `SyncReceiver` (hal.sync.endpoints): `version`, `consistent`,
    `torn` and `abort_error` are its per-sender receivers' together.
    """

    GROUP = "sender"

    def __init__(
        self,
        transports: Sequence[Transport],
        specs: Iterable[TensorSpec] | None,
        *,
        timeout_s: float = 60.0,
        token: str | None = None,
        validate: Any = None,
        backend: Backend | None = None,
        budget_bytes: int = 256 << 20,
        version: int | None = None,
    ) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"ShardedReceiver budget_bytes must be a non-negative int, got {budget_bytes!r}")
        super().__init__(transports, timeout_s=timeout_s, token=token, backend=backend, version=version)
        self.validate = validate
        self.budget_bytes = int(budget_bytes)
        self.specs: dict[str, TensorSpec] | None = None if specs is None else {s.name: s for s in specs}
        # (headers' spec tuples, shares, whole specs in order, destination objects, destinations) of the last sync
        self._index_kept: tuple | None = None
        self.pool = BufferPool(self.backend, self.budget_bytes)
        """Assembly buffers kept across syncs (at most `budget_bytes`)."""
        self.streams = [self.backend.new_stream() for _ in range(len(self.per_sender) + 1)]
        """The assembly's copies: one stream per sender's thread, one for handing over."""

    def receive(self, sink: Any) -> SyncMetrics:
        sink = as_sink(sink)
        start, host_start = time.perf_counter(), time.thread_time()
        with contextlib.ExitStack() as stack:
            for receiver in self.per_sender:
                stack.enter_context(receiver.transport.bounded(self.timeout_s))
            return self._receive(sink, start, host_start)

    def _receive(self, sink: Sink, start: float, host_start: float) -> SyncMetrics:
        assembler = Assembler(self.pool, self.streams, self.budget_bytes, self.timeout_s, sink)
        incoming = [IncomingSync(receiver, assembler.part_sink(m)) for m, receiver in enumerate(self.per_sender)]
        live = set(range(self.sender_count))  # the groups still in the sync (header agreed, none broken)
        failure = self._headers(incoming, sink, assembler, live)
        if failure is not None:
            assembler.stop()
        self._deliver_all(incoming, assembler, live)
        report = self._outcome(failure, incoming, assembler)
        version, error = self._conclude(incoming, live, report)
        assembler.release()
        for inc in incoming:  # each part's outcome; the first part's abort reaches the engine's sink
            inc.settle(error, touched=assembler.touched)
        if error is not None:
            raise error
        return SyncMetrics(
            version=version,
            bytes=sum(i.plan.total_bytes for i in incoming),
            buckets=sum(len(i.plan.buckets) for i in incoming),
            tensors=len(self._index_kept[2]) if self._index_kept is not None else 0,
            transfer_s=max((i.timer.get("transfer") or 0.0) for i in incoming),
            apply_s=assembler.apply_s,
            total_s=time.perf_counter() - start,
            host_s=time.thread_time() - host_start,
            senders=self.sender_count,
            model_bytes=sum(i.plan.total_bytes for i in incoming),
        )

    # ---- the phases ---------------------------------------------------------------------
    def _headers(self, incoming: list[IncomingSync], sink: Sink, assembler: Assembler, live: set[int]) -> errors.SyncError | None:
        """Take and check every sender's header, then agree in every group on all of them."""
        reports: list[RankReport] = []
        for m, inc in enumerate(incoming):
            try:
                reports.append(inc.check())
            except errors.PeerError as exc:
                live.discard(m)
                reports.append(errors.report_exception(exc, sender=False))
        shared = next((r for r in reports if r.error and r.kind != "base"), None)
        if shared is None:
            try:
                self._index(incoming, sink, assembler)
            except errors.SyncError as exc:
                shared = errors.report_exception(exc, sender=False)
        failure: errors.SyncError | None = None
        for m in sorted(live):
            inc, report = incoming[m], reports[m] if reports[m].error else (shared or reports[m])
            try:
                inc.agree_header(report, shared)
            except errors.SyncError as exc:
                live.discard(m)  # its sender stops at its offer: nothing more happens in that group
                failure = failure or unwrapped(exc)
        if failure is None and len(live) < self.sender_count:
            failure = errors.PeerError(f"sender(s) {sorted(set(range(self.sender_count)) - live)} did not send a header")
        return failure

    def _index(self, incoming: list[IncomingSync], sink: Sink, assembler: Assembler) -> None:
        """Where each share goes; refuses shares that do not fit the engine's tensors or
        do not cover every row exactly once, and destinations of another shape. Made once
        per layout: the headers' decoded spec tuples are the same objects while nothing
        changed, and the destinations are compared by identity."""
        headers = tuple(inc.header.specs for inc in incoming)
        cached = self._index_kept
        if cached is None or len(cached[0]) != len(headers) or not all(map(operator.is_, cached[0], headers)):
            self._index_kept = None
            shares, specs = self._shares_of(headers)
            cached = self._index_kept = (headers, shares, specs, [], {})
        _, shares, specs, objects, destinations = cached
        asked = [sink.destination(spec.name) for spec in specs]
        if len(asked) != len(objects) or not all(map(operator.is_, asked, objects)):
            problems = []
            destinations = {}
            for spec, dest in zip(specs, asked):
                if dest is None:
                    continue
                problem = destination_problem(spec, dest)
                if problem is not None:
                    problems.append(problem)
                    continue
                destinations[spec.name] = dest
            errors.refuse_specs(problems)
            self._index_kept = (headers, shares, specs, asked, destinations)
        if self.validate is not None:
            self.validate(list(specs))
        assembler.shares, assembler.destinations = shares, destinations

    def _shares_of(self, headers: tuple[tuple[TensorSpec, ...], ...]) -> tuple[dict[str, ShareInfo], list[TensorSpec]]:
        """Each wire tensor's place in its whole tensor, and the whole tensors in sending order."""
        problems: list[str] = []
        found: list[tuple[str, TensorSpec, tuple[int, ...], tuple[int, ...]]] = []  # wire name, whole, offsets, block shape
        sequences: list[list[str]] = []  # per sender, the tensors it sends shares of, in order
        for m, specs in enumerate(headers):
            sequences.append([])
            for wire in specs:
                try:
                    name, offsets = parse_block_name(wire.name)
                except ValueError as exc:
                    problems.append(f"sender {m}: {exc}")
                    continue
                sequences[-1].append(name)
                whole = self.specs.get(name) if self.specs is not None else None
                if self.specs is not None and whole is None:
                    problems.append(f"parameter {name!r}: not a parameter this receiver accepts")
                    continue
                ndim = len(wire.shape)
                if len(offsets) > max(ndim, 1) or (not ndim and offsets != (0,)):
                    problems.append(f"parameter {name!r}: sender {m} sends a block at {offsets} of a {ndim}-d tensor")
                    continue
                offsets = offsets[:ndim] + (0,) * (ndim - len(offsets))
                if whole is None:  # no specs of our own: every sender's shares say the shape
                    whole = TensorSpec(name, tuple(o + n for o, n in zip(offsets, wire.shape)), wire.dtype)
                if whole.dtype != wire.dtype or len(whole.shape) != ndim:
                    problems.append(f"parameter {name!r}: sender {m} sends rows of {wire.shape} {wire.dtype}, the tensor is {whole.shape} {whole.dtype}")
                    continue
                found.append((wire.name, whole, offsets, wire.shape))
        if self.specs is None:  # the whole shapes from the shares: the furthest element sent in each dimension
            ends: dict[str, tuple[int, ...]] = {}
            for _, whole, offsets, sizes in found:
                end = tuple(o + n for o, n in zip(offsets, sizes))
                ends[whole.name] = tuple(map(max, ends.get(whole.name, end), end))
            found = [(w, TensorSpec(s.name, ends[s.name], s.dtype), o, n) for w, s, o, n in found]
        problems += covering_blocks((whole, offsets, sizes) for _, whole, offsets, sizes in found)
        errors.refuse_specs(problems)
        specs = {whole.name: whole for _, whole, _, _ in found}
        count: dict[str, int] = {}
        for _, whole, _, _ in found:
            count[whole.name] = count.get(whole.name, 0) + 1
        order = {name: i for i, name in enumerate(sending_order(sequences))}
        shares = {}
        for wire_name, whole, offsets, sizes in found:
            lo = offsets[0] if offsets else 0
            rows = sizes[0] if sizes else 1
            # a block that is not whole rows lands in a strided region of its tensor
            region = None if sizes[1:] == whole.shape[1:] else tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
            shares[wire_name] = ShareInfo(specs[whole.name], order[whole.name], lo, lo + rows, count[whole.name], region)
        return shares, sorted(specs.values(), key=lambda s: order[s.name])

    def _outcome(self, failure: errors.SyncError | None, incoming: list[IncomingSync], assembler: Assembler) -> RankReport:
        """This receiver's word on the whole sync: the first thing that went wrong, if any."""
        problem = self._first_problem(failure, incoming, assembler)
        if problem is not None:
            return problem
        touched = assembler.touched
        names = assembler.leftover()
        if names:
            return RankReport(error=f"tensors {names[: errors.MAX_REPORTED]} never got all their shares", kind="peer", inconsistent=touched)
        return RankReport(inconsistent=touched)


def sending_order(sequences: list[list[str]]) -> list[str]:
    """One order of every name that keeps each sender's order (each sends its shares in the
    plan's order, so one exists): the assembler's notion of "behind" must agree with every
    sender's. Names in a cycle (senders that disagree) follow in first-seen order."""
    after: dict[str, list[str]] = {}
    waiting: dict[str, int] = {}
    seen: dict[str, None] = {}
    for sequence in sequences:
        for i, name in enumerate(sequence):
            seen.setdefault(name, None)
            waiting.setdefault(name, 0)
            if i:
                after.setdefault(sequence[i - 1], []).append(name)
                waiting[name] += 1
    ready = collections.deque(name for name in seen if waiting[name] == 0)
    order: list[str] = []
    while ready:
        name = ready.popleft()
        order.append(name)
        for nxt in after.get(name, ()):
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                ready.append(nxt)
    if len(order) < len(seen):
        placed = set(order)
        order += [name for name in seen if name not in placed]
    return order
