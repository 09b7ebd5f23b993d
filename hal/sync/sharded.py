"""Every trainer rank sends: an M-to-N sync from a sharded trainer, with no gather.

Each trainer rank sends only the rows it holds (`hal.sync.layout`: FSDP2 `Shard(0)`
shards as they are, replicated tensors split between the ranks that hold them), over a
sync group of its own with every engine worker; each engine worker receives from all M
senders at once and hands its engine whole tensors (`hal.sync.assembly`):

    # every trainer rank r (FSDP2 over trainer_group), its own group with the engine workers
    sender = ShardedSender(BroadcastTransport(sync_groups[r], src=0), config=..., trainer_group=trainer_group)
    metrics = sender.sync(model, version=step)      # metrics.bytes == this rank's share

    # every engine worker: one transport per trainer rank, in trainer-rank order
    receiver = ShardedReceiver([BroadcastTransport(g, src=0) for g in sync_groups], engine_specs)
    receiver.receive(copy_into(engine_weights))

A sync of M senders is M syncs of the core (hal.sync.sender / receiver: headers, tokens,
versions, verify, delta against each sender's own baseline), run at once and bound
together by the receivers:

1. The trainer ranks agree on the layout (`LayoutExchange`: a digest per sync).
2. Each sender offers its header; each receiver checks all M (and that the shares cover
   every row of every tensor exactly once) and answers in every group with the verdict
   on all of them, so a refusal anywhere fails every rank before any byte moves.
3. Each receiver receives the M syncs in M threads; tensors reach its sink whole.
4. Two agreements end it in every group: the first tells the receivers what each
   sender saw, the second tells every sender what any rank saw; so every rank raises
   the same failure, and a receiver's version advances only when all M syncs completed.

A sender that dies: its group's waits end within the timeout (`PeerError`), the other
groups end with that error, and no tensor it had a share of reaches any engine.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterable, Iterator, Sequence

import torch

import hal
from hal.backend import Backend
from hal.sync import errors
from hal.sync.assembly import Assembler, ShareInfo
from hal.sync.config import SyncConfig, wire_dtype_for
from hal.sync.errors import RankReport
from hal.sync.layout import SHARD0, LayoutExchange, ShardPlan, covering, declare, parse_shard_name
from hal.sync.metrics import SyncMetrics
from hal.sync.plan import TensorSpec
from hal.sync.protocol import GroupChannel
from hal.sync.receiver import IncomingSync, Receiver
from hal.sync.sender import Sender
from hal.sync.sink import Sink, as_sink
from hal.sync.source import TensorSource, as_source
from hal.sync.trainer import _control_device, _world
from hal.sync.transport import Transport

_MAX_REPORTED = 5


def local_tensors(source: Any) -> list[tuple[str, torch.Tensor]]:
    """A source's tensors as this rank holds them (no gather)."""
    source = as_source(source)
    local = getattr(source, "local_tensors", None)
    if not callable(local):
        raise TypeError(
            f"a sharded sync reads the tensors each rank holds: pass a module, a ModuleSource, a TensorSource, a dict or "
            f"a list of (name, tensor), not a {type(source).__name__}"
        )
    return local()


class _Shares:
    """One sync's source on one trainer rank: its shares of the plan, as wire tensors."""

    def __init__(self, plan: ShardPlan, rank: int, tensors: dict[str, torch.Tensor]) -> None:
        self.shares = plan.shares[rank]
        self.kinds = dict(zip((s.name for s in plan.specs), plan.kinds))
        self.tensors = tensors

    def metadata(self) -> list[TensorSpec]:
        return [share.wire for share in self.shares]  # the plan's own objects: the plan cache knows them

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for share in self.shares:
            name = share.spec.name
            tensor = self.tensors[name]
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if self.kinds[name] == SHARD0:
                if tuple(local.shape) != share.wire.shape:
                    raise ValueError(
                        f"parameter {name!r}: this rank's shard has shape {tuple(local.shape)}, the Shard(0) layout "
                        f"gives it rows {share.lo}..{share.hi} ({share.wire.shape})"
                    )
                yield share.wire.name, local
            elif local.dim() and (share.lo, share.hi) != (0, local.shape[0]):
                yield share.wire.name, local.narrow(0, share.lo, share.hi - share.lo)
            else:
                yield share.wire.name, local


class ShardedSender:
    """One per trainer rank: `sync(source, version=)` on every rank sends that rank's
    shares (see the module doc). `transport` is this rank's own group with every engine
    worker (this rank its sender); `trainer_group` the ranks that hold the model (default:
    the default group). `config` and `token` as for `Sender`."""

    def __init__(
        self,
        transport: Transport,
        *,
        config: SyncConfig | None = None,
        trainer_group: Any = None,
        backend: Backend | None = None,
        token: str | None = None,
    ) -> None:
        self.backend = backend or hal.current()
        self.sender = Sender(transport, config, backend=self.backend, token=token)
        self.config = self.sender.config
        group = trainer_group if trainer_group is not None else _world()
        self.channel = GroupChannel(group, control_device=_control_device(group, self.backend))
        self.channel.name = "trainer group"
        self.layout = LayoutExchange(self.channel)
        self.version: int | None = None

    @property
    def rank(self) -> int:
        return self.channel.rank

    @property
    def plan(self) -> ShardPlan | None:
        """The layout of the last sync."""
        return self.layout.plan

    def sync(self, source: Any, *, version: int) -> SyncMetrics:
        """Send this rank's shares of `source` as `version`; the same call on every trainer
        rank. Returns this rank's metrics (`bytes`: what it sent; `model_bytes`: the whole
        model). Raises the `SyncError` every rank raises when the sync fails anywhere."""
        tensors = local_tensors(source)
        transport, timeout = self.sender.transport, self.config.timeout_s
        with self.channel.bounded(timeout):
            try:
                plan, refused = self.layout.agree(declare(tensors, self.rank, self.channel.world_size)), None
            except (errors.SyncError, ValueError, TypeError) as exc:  # the same on every trainer rank
                plan, refused = None, exc if isinstance(exc, errors.SyncError) else errors.SpecMismatchError(str(exc))
        # a refused layout still goes through an (empty) sync, so the receivers hear why
        shares = _Shares(plan, self.rank, dict(tensors)) if plan is not None else TensorSource([])
        outgoing = self.sender.offer(shares, version=version)
        outgoing.end_bound_s = 2 * timeout  # the receivers first wait for every other sender
        metrics, own = None, None
        try:
            metrics = outgoing.send() if refused is None else outgoing.cancel(refused)
        except errors.PeerError:
            raise  # this group is broken: nobody here can agree on anything more
        except errors.SyncError as exc:
            own = exc
        report = RankReport(sender=True) if own is None else errors.report_exception(own, sender=True)
        with transport.bounded(2 * timeout):
            reports = transport.agree(report, "every sender's status")
        if own is not None:
            raise own
        errors.raise_if_any(reports, transport.rank, f"sync of version {version}")
        self.version = version
        metrics.senders = self.channel.world_size
        wire = self.config.wire_dtype
        metrics.model_bytes = sum(s.numel * (wire_dtype_for(s.dtype, wire) if wire is not None else s.dtype).itemsize for s in plan.specs)
        return metrics


class ShardedReceiver:
    """An engine worker receiving from every trainer rank at once (see the module doc).

    `transports`: one per trainer rank, in trainer-rank order (each that rank's group with
    the engine workers). `specs`, `timeout_s`, `token`, `validate` as for `Receiver`,
    about whole tensors. `budget_bytes` bounds the tensors being put together at once
    (`hal.sync.assembly`).
    """

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
    ) -> None:
        if not transports:
            raise ValueError("ShardedReceiver needs one transport per trainer rank, got none")
        self.backend = backend or hal.current()
        self.parts = [Receiver(t, None, timeout_s=timeout_s, token=token, backend=self.backend) for t in transports]
        self.timeout_s = float(timeout_s)
        self.validate = validate
        self.budget_bytes = int(budget_bytes)
        self.specs: dict[str, TensorSpec] | None = None if specs is None else {s.name: s for s in specs}
        self.version: int | None = None
        self.consistent = True

    @property
    def senders(self) -> int:
        return len(self.parts)

    def receive(self, sink: Any) -> SyncMetrics:
        sink = as_sink(sink)
        start, host_start = time.perf_counter(), time.thread_time()
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.transport.bounded(self.timeout_s))
            return self._receive(sink, start, host_start)

    def _receive(self, sink: Sink, start: float, host_start: float) -> SyncMetrics:
        assembler = Assembler(self.backend, self.senders, self.budget_bytes, self.timeout_s)
        incoming = [IncomingSync(part, assembler.part_sink(m)) for m, part in enumerate(self.parts)]
        live = set(range(self.senders))  # the groups still in the sync (header agreed, none broken)
        failure = self._headers(incoming, sink, assembler, live)
        if failure is not None:
            assembler.stop()
        assembler.expect(live)
        threads = [threading.Thread(target=self._deliver, args=(m, incoming[m], assembler, live), daemon=True) for m in sorted(live)]
        for thread in threads:
            thread.start()
        assembler.drain(sink)
        for thread in threads:
            thread.join()
        report = self._outcome(failure, incoming, assembler, live)
        version = next((i.header.version for i in incoming if i.header is not None), None)
        where = f"sync of version {version}" if version is not None else "sync"
        report = self._agree(incoming, live, report, "sync status")
        report = self._agree(incoming, live, report, "every sender's status")
        assembler.release()
        if report.error is not None:
            for part in self.parts:
                part.delta.lost()
            if assembler.touched:
                self.consistent = False
            with contextlib.suppress(Exception):
                sink.abort()
            errors.raise_if_any([report], 0, where)
        for part, inc in zip(self.parts, incoming):
            part.version, part.consistent = inc.header.version, True
            part.delta.completed(inc.header, inc.plan, inc.kept_in)
        self.version, self.consistent = version, True
        return SyncMetrics(
            version=version,
            bytes=sum(i.plan.total_bytes for i in incoming),
            buckets=sum(len(i.plan.buckets) for i in incoming),
            tensors=len({info.spec.name for info in assembler.shares.values()}),
            transfer_s=max((i.timer.get("transfer") or 0.0) for i in incoming),
            total_s=time.perf_counter() - start,
            host_s=time.thread_time() - host_start,
            senders=self.senders,
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
            while True:
                try:
                    inc.agree_header(report)
                    break
                except errors.SyncError as exc:
                    if inc.header is not None and inc.header.delta_base is not None and exc.only_delta_base:
                        report = inc.check()  # that sender sends the same sync whole at once
                        if report.error is None and shared is not None:
                            report = shared
                        continue
                    live.discard(m)  # its sender stops at its offer: nothing more happens in that group
                    failure = failure or exc
                    break
        if failure is None and len(live) < self.senders:
            failure = errors.PeerError(f"sender(s) {sorted(set(range(self.senders)) - live)} did not send a header")
        return failure

    def _index(self, incoming: list[IncomingSync], sink: Sink, assembler: Assembler) -> None:
        """Where each share goes; refuses shares that do not fit the engine's tensors or
        do not cover every row exactly once, and destinations of another shape."""
        problems: list[str] = []
        found: list[tuple[str, TensorSpec, int, int]] = []
        for m, inc in enumerate(incoming):
            for wire in inc.header.specs:
                try:
                    name, lo = parse_shard_name(wire.name)
                except ValueError as exc:
                    problems.append(f"sender {m}: {exc}")
                    continue
                whole = self.specs.get(name) if self.specs is not None else None
                if self.specs is not None and whole is None:
                    problems.append(f"parameter {name!r}: not a parameter this receiver accepts")
                    continue
                rows = wire.shape[0] if wire.shape else 1
                if whole is None:  # no specs of our own: every sender's shares say the shape
                    whole = TensorSpec(name, (0, *wire.shape[1:]) if wire.shape else (), wire.dtype)
                if whole.dtype != wire.dtype or whole.shape[1:] != wire.shape[1:] or len(whole.shape) != len(wire.shape):
                    problems.append(f"parameter {name!r}: sender {m} sends rows of {wire.shape} {wire.dtype}, the tensor is {whole.shape} {whole.dtype}")
                    continue
                found.append((wire.name, whole, lo, lo + rows if wire.shape else 1))
        if self.specs is None:  # the whole shapes from the shares: the furthest row sent
            ends: dict[str, int] = {}
            for _, whole, _, hi in found:
                ends[whole.name] = max(ends.get(whole.name, 0), hi)
            found = [(w, TensorSpec(s.name, (ends[s.name], *s.shape[1:]) if s.shape else (), s.dtype), lo, hi) for w, s, lo, hi in found]
        problems += covering((whole, lo, hi) for _, whole, lo, hi in found)
        order: dict[str, int] = {}
        count: dict[str, int] = {}
        for _, whole, _, _ in found:
            order.setdefault(whole.name, len(order))
            count[whole.name] = count.get(whole.name, 0) + 1
        specs = {whole.name: whole for _, whole, _, _ in found}
        for name, whole in specs.items():
            dest = sink.destination(name)
            if dest is None:
                continue
            if not isinstance(dest, torch.Tensor) or tuple(dest.shape) != whole.shape:
                got = tuple(dest.shape) if isinstance(dest, torch.Tensor) else type(dest).__name__
                problems.append(f"parameter {name!r}: the engine's destination has shape {got}, the sync carries {whole.shape}")
                continue
            assembler.destinations[name] = dest
        if problems:
            more = f" (+{len(problems) - _MAX_REPORTED} more)" if len(problems) > _MAX_REPORTED else ""
            raise errors.SpecMismatchError("; ".join(problems[:_MAX_REPORTED]) + more)
        if self.validate is not None:
            self.validate(sorted(specs.values(), key=lambda s: order[s.name]))
        for wire_name, whole, lo, hi in found:
            whole = specs[whole.name]
            assembler.shares[wire_name] = ShareInfo(whole, order[whole.name], lo, hi, count[whole.name])

    def _deliver(self, m: int, inc: IncomingSync, assembler: Assembler, live: set[int]) -> None:
        try:
            inc.deliver()
        except errors.PeerError as exc:
            live.discard(m)
            inc.lost = exc
        except Exception as exc:  # noqa: BLE001 - reported at the agreement
            inc.lost = exc
        finally:
            assembler.sender_done(m)

    def _outcome(self, failure: errors.SyncError | None, incoming: list[IncomingSync], assembler: Assembler, live: set[int]) -> RankReport:
        """This receiver's word on the whole sync: the first thing that went wrong, if any."""
        touched = assembler.touched
        if failure is not None:
            return errors.report_exception(failure, sender=False, inconsistent=touched)
        for m, inc in enumerate(incoming):
            if inc.lost is not None:
                return errors.report_exception(inc.lost, sender=False, inconsistent=touched)
            if inc.delivery is not None and inc.delivery.error is not None:
                return RankReport(error=inc.delivery.error.error, kind=inc.delivery.error.kind, inconsistent=touched)
        if assembler.error is not None:
            return errors.report_exception(assembler.error, sender=False, inconsistent=touched)
        if any(inc.delivery is not None and inc.delivery.sender_failed for inc in incoming):
            return RankReport(inconsistent=touched)  # the sender says why at the agreement
        if assembler.leftover():
            names = assembler.leftover()
            return RankReport(error=f"tensors {names[:_MAX_REPORTED]} never got all their shares", kind="peer", inconsistent=touched)
        return RankReport(inconsistent=touched)

    def _agree(self, incoming: list[IncomingSync], live: set[int], report: RankReport, what: str) -> RankReport:
        """Agree in every live group; returns this receiver's report with the first error any
        group's ranks told (so the next agreement tells it to every sender)."""
        for m in sorted(live):
            transport = incoming[m].receiver.transport
            try:
                with transport.bounded(2 * self.timeout_s):
                    reports = transport.agree(report, what)
            except errors.PeerError as exc:
                live.discard(m)
                reports = [errors.report_exception(exc, sender=False)]
            told = next((r for r in reports if r.error), None)
            if report.error is None and told is not None:
                report = RankReport(error=f"sender {m}'s group: {told.error}", kind=told.kind, inconsistent=report.inconsistent)
        return report
