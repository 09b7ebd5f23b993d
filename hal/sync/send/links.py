"""A trainer rank sends each engine worker only the pieces that worker needs: N links under
one header exchange and one agreement (issue 41).

Trainer rank r keeps its sync group of today (`{r} ∪ workers`, r its sender), with its
challenge, token, versions and agreements. What changes is what travels: the M x N plan
(hal.sync.plan.mxn) cuts r's shares by each worker's recorded needs, and r sends worker w
only the link r -> w, as a sync of the core (`OutgoingSync`) whose tensors are that link's
pieces (hal.sync.plan.link_specs), point to point (hal.sync.transport.peer):

    links = peer_links(sync_groups[r])                            # one PeerTransport per worker
    sender = LinkSender(links, rank=r, config=SyncConfig(...))
    metrics = sender.send(plan, tensors, version=step)            # metrics.bytes == plan.bytes_out[r]

One sync of N links, on rank r:

1. every rank of the group draws one challenge; r plans each link (its own `BucketPlan`)
   and sends each worker the header of its link alone, with the token's proof over that
   challenge; every rank agrees on every verdict (one agreement);
2. the links' segments go in rounds over the workers (w0's segment 0, w1's segment 0, ...,
   w0's segment 1, ...), each after its status on its own link, so every link progresses
   and a failure of the source or a pack is announced on the link it struck;
3. two agreements end it, as for `ShardedSender`: the first tells the workers what r saw,
   the second tells r what any worker saw in any group, so that every rank raises the
   same error class, and a worker's version advances only when its M links completed.

Memory: each link's buckets are 1/N of the bucket size (`SyncConfig.bucket_bytes`, or one
derived from free memory for M x N links), with two buffers per link: r's buffers add up
to the two buckets of today's sender. A transport failure (a worker lost: `PeerError`)
ends the sync at once on r; the workers' waits end within their timeout.

One thread sends every link and waits for one link's buffers at a time (gloo's sends are
asynchronous, so the links' segments are in flight together): a worker that holds its
link back (its landing's open-layer budget, hal.sync.receive.landing) slows this rank's
other links too; every such wait ends within the timeout. On NCCL/HCCL the same thread
issues the sends in turn, each enqueued after its pack (the library's traits); batching a
round into one coalesced launch (`batch_isend_irecv`) is not done yet (not measured: this
machine has no two devices).

Delta sync over links is not supported yet (refused at construction).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator, Mapping, Sequence

import torch

import hal
from hal.backends.interface import Backend
from hal.sync import errors
from hal.sync.config import ALL, SyncConfig
from hal.sync.errors import RankReport
from hal.sync.metrics import SyncMetrics
from hal.sync.plan.link_specs import LinkSpecs, link_specs
from hal.sync.plan.mxn import MxNPlan
from hal.sync.plan.shards import ShardPlan
from hal.sync.send.sender import OutgoingSync, Sender
from hal.sync.send.sharded import share_tensors
from hal.sync.spec import TensorSpec
from hal.sync.transport.peer import PeerTransport
from hal.sync.wire.header_json import MIN_BUCKET_BYTES

__all__ = ["LinkSender"]


class _ShareTensors:
    """This rank's shares as wire tensors, read once per sync, when a link first needs one."""

    def __init__(self, holdings: ShardPlan, rank: int, tensors: Mapping[str, Any]) -> None:
        self.holdings, self.rank, self.tensors = holdings, rank, dict(tensors)
        self._shares: list[torch.Tensor] | None = None

    def __getitem__(self, j: int) -> torch.Tensor:
        if self._shares is None:
            self._shares = share_tensors(self.holdings, self.rank, self.tensors)
        return self._shares[j]


class _LinkSource:
    """One link's pieces as a source of the core: each piece a view of its share."""

    def __init__(self, wire: LinkSpecs, sources: list[tuple[int, tuple[slice, ...]]], shares: _ShareTensors) -> None:
        self.wire, self.sources, self.shares = wire, sources, shares

    def metadata(self) -> list[TensorSpec]:
        return list(self.wire.specs)  # the same spec objects every sync: the link's bucket plan is kept

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        shares = self.shares
        for spec, (j, index) in zip(self.wire.specs, self.sources):
            yield spec.name, shares[j][index]


class LinkSender:
    """Trainer rank `rank`'s sync into every engine worker, each only its pieces (see the
    module doc). `transports`: its sync group's links, one per worker in worker order
    (`peer_links(group)`, sharing one channel). `config` and `token` as for `Sender`."""

    def __init__(
        self,
        transports: Sequence[PeerTransport],
        *,
        rank: int,
        config: SyncConfig | None = None,
        backend: Backend | None = None,
        token: str | None = None,
    ) -> None:
        if not transports:
            raise ValueError("LinkSender needs one link per engine worker, got none")
        channel = transports[0].channel
        if any(not isinstance(t, PeerTransport) or t.channel is not channel for t in transports):
            raise ValueError("LinkSender: the links must be PeerTransports of one group sharing its channel (peer_links(group))")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"LinkSender rank must be this trainer rank's index (an int >= 0), got {rank!r}")
        self.config = config if config is not None else SyncConfig()
        if not isinstance(self.config, SyncConfig):
            raise TypeError(f"LinkSender config must be a SyncConfig, got {type(self.config).__name__}")
        if self.config.delta is not None:
            raise ValueError("LinkSender: delta sync over point-to-point links is not supported yet (SyncConfig.delta must be None)")
        self.backend = backend or hal.current()
        self.rank = rank
        self.channel = channel
        bucket = self.config.bucket_bytes
        per_link = dataclasses.replace(self.config, bucket_bytes=None if bucket is None else max(MIN_BUCKET_BYTES, bucket // len(transports)))
        self.links = [Sender(t, per_link, backend=self.backend, token=token) for t in transports]
        """One core `Sender` per worker's link: its bucket plan, packer, buffers and version."""
        self.version: int | None = None
        self._kept: tuple[MxNPlan | None, list[tuple[LinkSpecs, list]]] = (None, [])

    @property
    def workers(self) -> int:
        return len(self.links)

    def _wires(self, plan: MxNPlan) -> list[tuple[LinkSpecs, list]]:
        """Per link, its wire tensors and where each piece is in this rank's shares (once per plan)."""
        if self._kept[0] is not plan:
            if len(plan.needs) != self.workers:
                raise ValueError(f"LinkSender: the plan has {len(plan.needs)} engine workers, this rank has {self.workers} links")
            if self.rank >= len(plan.holdings.shares):
                raise ValueError(f"LinkSender: rank {self.rank} is not one of the plan's {len(plan.holdings.shares)} trainer ranks")
            wires = []
            for w in range(self.workers):
                wire = link_specs(plan, self.rank, w)
                wires.append((wire, [(p.share, plan.source(self.rank, p)[1]) for p in wire.pieces]))
            self._kept = (plan, wires)
        return self._kept[1]

    def send(self, plan: MxNPlan, tensors: Mapping[str, Any], *, version: int, refused: errors.SyncError | None = None) -> SyncMetrics:
        """Send every worker its link of `plan` as `version`: `tensors` are this rank's own
        (`local_tensors`: a tensor, an FSDP2 shard or a `Block` per name, as `plan.holdings`
        declares them). The same call on every trainer rank, and `LinkReceiver.receive` on
        every worker. `refused`: the trainer ranks' agreement on their shares failed, told
        to every worker at the header (nothing moves). Returns this rank's metrics
        (`bytes`: `plan.bytes_out[rank]`); raises the `SyncError` every rank raises."""
        errors.check_version(version)
        start, host_start = time.perf_counter(), time.thread_time()
        where = f"sync of version {version}"
        shares = _ShareTensors(plan.holdings, self.rank, tensors)
        outgoing: list[OutgoingSync] = []
        for sender, (wire, sources) in zip(self.links, self._wires(plan)):
            sender.sender_count = len(plan.holdings.shares) * self.workers  # buckets from free memory: 1/(M N) each
            outgoing.append(OutgoingSync(sender, _LinkSource(wire, sources, shares), version))
        channel, bounds = self.channel, self.config.bounds
        with channel.bounded(bounds.step_s):
            self._offer(outgoing, refused, where)
            for out in outgoing:
                out.agreed()
            self._rounds(outgoing)
        failed = next((out for out in outgoing if out.failure is not None), None)
        report = failed.report() if failed is not None else RankReport(sender=True)
        with channel.bounded(bounds.behind_s):  # the workers first wait for every other sender's bytes
            channel.agree(report, "sync status")
            reports = channel.agree(report, "every sender's status")
        if failed is not None:
            raise failed.failure
        errors.raise_if_any(reports, channel.rank, where)
        per_link = [out.completed() for out in outgoing]
        self.version = version
        return self._metrics(plan, per_link, version, start, host_start)

    def _offer(self, outgoing: list[OutgoingSync], refused: errors.SyncError | None, where: str) -> None:
        """One challenge, each worker its link's header, one agreement on every verdict."""
        channel = self.channel
        report = RankReport(sender=True) if refused is None else errors.report_exception(refused, sender=True)
        try:
            challenge = channel.challenge()
        except errors.AuthError as exc:  # forged by a member: prove nothing over it, refuse in step
            challenge = None
            report = report if report.error else errors.report_exception(exc, sender=True)
        payloads = {}
        for w, (sender, out) in enumerate(zip(self.links, outgoing)):
            peer = sender.transport.peer
            try:
                payloads[peer] = out.announce(challenge).encode()
            except Exception as exc:  # noqa: BLE001 - told to every rank at the agreement
                payloads[peer] = b""  # its worker refuses an empty header (HeaderError) as this rank does
                failure = errors.HeaderError(f"the header of the link to engine worker {w}: {type(exc).__name__}: {exc}")
                report = report if report.error else errors.report_exception(failure, sender=True)
        channel.send_headers(payloads)
        errors.raise_if_any(channel.agree(report, "header check"), channel.rank, where)

    def _rounds(self, outgoing: list[OutgoingSync]) -> None:
        """Every link's segments, one link's segment after another's: w0's first, w1's
        first, ..., w0's second, ... (a link that failed or ended drops out)."""
        steps = [out.steps() for out in outgoing]
        while steps:
            for step in list(steps):
                try:
                    next(step)
                except StopIteration:
                    steps.remove(step)

    def _metrics(self, plan: MxNPlan, per_link: list[SyncMetrics], version: int, start: float, host_start: float) -> SyncMetrics:
        def total(field: str) -> float | None:
            values = [getattr(m, field) for m in per_link if getattr(m, field) is not None]
            return sum(values) if values else None

        return SyncMetrics(
            version=version,
            bytes=sum(m.bytes for m in per_link),
            buckets=sum(m.buckets for m in per_link),
            tensors=sum(m.tensors for m in per_link),
            gather_s=total("gather_s"),
            pack_s=total("pack_s"),
            transfer_s=total("transfer_s"),
            total_s=time.perf_counter() - start,
            host_s=time.thread_time() - host_start,
            plan_reused=all(m.plan_reused for m in per_link),
            sending=ALL,
            senders=len(plan.holdings.shares),
            model_bytes=plan.model_bytes,
            links=self.workers,
            largest_link_bytes=max(m.bytes for m in per_link),
        )

    def close(self) -> None:
        """Free every link's buffers (the group is its owner's)."""
        for sender in self.links:
            sender.close()

