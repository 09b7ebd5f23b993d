"""Every trainer rank sends: an M-to-N sync from a sharded trainer, with no gather.

Each trainer rank sends only the rows it holds (`hal.sync.plan.shards`: FSDP2 `Shard(0)`
shards as they are, replicated tensors split between the ranks that hold them), over a
sync group of its own with every engine worker; each engine worker receives from all M
senders at once and hands its engine whole tensors (`hal.sync.receive.assembly`):

    # every trainer rank r (FSDP2 over trainer_group), its own group with the engine workers
    sender = ShardedSender(BroadcastTransport(sync_groups[r], src=0), config=..., trainer_group=trainer_group)
    metrics = sender.sync(model, version=step)      # metrics.bytes == this rank's share

    # every engine worker: one transport per trainer rank, in trainer-rank order
    receiver = ShardedReceiver([BroadcastTransport(g, src=0) for g in sync_groups], engine_specs)
    receiver.receive(copy_into(engine_weights))

A sync of M senders is M syncs of the core (hal.sync.send.sender / receiver: headers, tokens,
versions, verify, delta against each sender's own baseline), run at once and bound
together by the receivers:

1. The trainer ranks agree on who sends which rows (`ShardedSender.agree_shares`, through
   `ShardPlanExchange`: a digest per sync).
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

from dataclasses import dataclass
from typing import Any, Iterator

import torch

import hal
from hal.backends.interface import Backend
from hal.sync import errors
from hal.sync.config import ALL, SyncConfig, wire_dtype_for
from hal.sync.errors import RankReport
from hal.sync.plan.shards import BLOCK, SHARD0, ShardPlan
from hal.sync.plan.declare import Block, ShardPlanExchange, declare
from hal.sync.metrics import SyncMetrics
from hal.sync.spec import TensorSpec
from hal.sync.wire.channel import trainer_channel
from hal.sync.send.sender import Sender
from hal.sync.source import ListedSource, LocalSource, ModuleSource, TensorSource, as_source
from hal.sync.plan.steady import KnownDeclaration
from hal.sync.transport.base import Transport

__all__ = ["ShareAgreement", "ShardedSender", "local_tensors", "share_tensors"]


def local_tensors(source: Any) -> list[tuple[str, torch.Tensor | Block]]:
    """A source's tensors as this rank holds them (no gather). A dict or list of pairs may
    hold `Block`s beside tensors (what a tensor-parallel rank holds of a larger tensor)."""
    pairs = _pairs_with_blocks(source)
    if pairs is not None:
        return [(n, t.detach() if isinstance(t, torch.Tensor) else t) for n, t in pairs]
    source = as_source(source)
    if not isinstance(source, LocalSource):
        raise TypeError(
            f"a sharded sync reads the tensors each rank holds: pass a module, a ModuleSource, a TensorSource, a dict or "
            f"a list of (name, tensor), not a {type(source).__name__}"
        )
    return source.local_tensors()


@dataclass(frozen=True, slots=True)
class AgreedShares:
    """The first phase of one M-to-N sync on one trainer rank (`ShardedSender.agree_shares`):
    the plan every trainer rank agreed on and this rank's tensors, or why the sync is
    refused (the same `SyncError` on every trainer rank)."""

    plan: ShardPlan | None
    tensors: dict[str, torch.Tensor]
    refused: errors.SyncError | None = None


def _listed(source: Any) -> ListedSource | None:
    """`source` as a source that lists its tensors for a steady state, if it is one whose
    local tensors are its listing's (not a subclass reading them otherwise; not pairs
    holding `Block`s, which `local_tensors` reads as they are)."""
    if _pairs_with_blocks(source) is not None:
        return None
    source = as_source(source)
    return source if type(source) in (ModuleSource, TensorSource) else None


def _pairs_with_blocks(source: Any) -> list | None:
    """The pairs of a dict or list of them that holds `Block`s beside tensors (what a
    tensor-parallel rank holds of a larger tensor), else None."""
    if isinstance(source, (dict, list, tuple)):
        pairs = list(source.items()) if isinstance(source, dict) else list(source)
        if any(isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], Block) for pair in pairs):
            return pairs
    return None


class _Shares:
    """One sync's source on one trainer rank: its shares of the plan, as wire tensors."""

    def __init__(self, plan: ShardPlan, rank: int, tensors: dict[str, torch.Tensor]) -> None:
        self.rank = rank
        self.shares = plan.shares[rank]
        self.kinds = dict(zip((s.name for s in plan.specs), plan.kinds))
        self.tensors = tensors

    def metadata(self) -> list[TensorSpec]:
        return [share.wire for share in self.shares]  # the plan's own objects: the plan cache knows them

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for share in self.shares:
            name = share.spec.name
            tensor = self.tensors[name]
            if isinstance(tensor, Block):
                tensor = tensor.tensor
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if local.requires_grad:  # a parameter as listed (hal.sync.plan.steady): read out of autograd
                local = local.detach()
            if share.spec.numel == 0:
                # no bytes to read, and the local shard's shape says nothing of the tensor's
                # (FSDP2 gives every rank (0, 0) of a (3, 0) parameter, distribute_tensor
                # (1, 0)): the share is an empty tensor of the declared global shape
                yield share.wire.name, local.new_empty(share.wire.shape)
            elif self.kinds[name] == SHARD0:
                if tuple(local.shape) != share.wire.shape:
                    raise ValueError(
                        f"parameter {name!r}: trainer rank {self.rank}'s shard has shape {tuple(local.shape)}, the Shard(0) layout "
                        f"gives it rows {share.lo}..{share.hi} ({share.wire.shape})"
                    )
                yield share.wire.name, local
            elif self.kinds[name] == BLOCK:
                index = share.local_index()
                if any(i.stop > n for i, n in zip(index, local.shape)) or local.dim() != len(index):
                    raise ValueError(
                        f"parameter {name!r}: trainer rank {self.rank}'s block has shape {tuple(local.shape)}, the layout gives "
                        f"it {share.wire.shape} at {share.offsets} (its block starts at {share.held})"
                    )
                whole = all(i.start == 0 and i.stop == n for i, n in zip(index, local.shape))
                yield share.wire.name, local if whole else local[index]
            elif local.dim() and (share.lo, share.hi) != (0, local.shape[0]):
                yield share.wire.name, local.narrow(0, share.lo, share.hi - share.lo)
            else:
                yield share.wire.name, local


def share_tensors(plan: ShardPlan, rank: int, tensors: dict[str, Any]) -> list[torch.Tensor]:
    """Trainer rank `rank`'s shares of `plan` as wire tensors (views of `tensors`, this rank's
    own: `local_tensors`), in the plan's order, as a sync of its shares reads them."""
    return [tensor for _, tensor in _Shares(plan, rank, tensors)]


class ShareAgreement:
    """The first phase of an M-to-N sync on one trainer rank (`ShardedSender`, and
    hal.sync.send.link_syncs' `EveryRankLinks`): what this rank holds of a source, declared
    from metadata, and the plan every trainer rank agrees on over `channel` (the trainer
    group's), built once per layout. `config`: its bounds."""

    def __init__(self, channel: Any, config: SyncConfig) -> None:
        self.channel, self.config = channel, config
        self.exchange = ShardPlanExchange(channel)
        self.known = KnownDeclaration()
        """The last sync's listing and declaration (hal.sync.plan.steady)."""

    @property
    def rank(self) -> int:
        return self.channel.rank

    def agree(self, source: Any) -> AgreedShares:
        """Declare what this rank holds of `source` (from metadata) and agree with every
        trainer rank on who sends which rows (the plan is built once per layout). A source
        some rank cannot declare, or declarations that do not fit, make `refused` the same
        `SpecMismatchError` on every trainer rank; nothing is sent yet. The same call on
        every trainer rank."""
        tensors: dict[str, Any] = {}
        declared: list | BaseException
        try:
            tensors, declared = self._declare(source)
        except (ValueError, TypeError) as exc:  # still take part in the exchange: the others hear of it at once
            declared = exc
        with self.channel.bounded(self.config.bounds.step_s):
            try:
                return AgreedShares(self.exchange.agree(declared), tensors)
            except errors.SyncError as exc:  # the same on every trainer rank (a broken group: PeerError)
                return AgreedShares(None, tensors, exc)

    def _declare(self, source: Any) -> tuple[dict[str, Any], list]:
        """This rank's tensors and what it declares of them: the last sync's declaration
        when the source lists the same tensors as they were (hal.sync.plan.steady)."""
        listed = _listed(source)
        listing = listed.listing(self.known.listing) if listed is not None else None
        if listing is None or not listing.as_yielded:  # (a listing of stand-ins: a split DTensor)
            self.known.forget()
            pairs = local_tensors(source)
            return dict(pairs), declare(pairs, self.rank, self.channel.world_size)
        declared = self.known.recall(listing)
        if declared is None:
            declared = declare(zip(listing.names, listing.tensors), self.rank, self.channel.world_size)
            self.known.remember(listing, declared)
        return self.known.tensors, declared


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
        self.channel = trainer_channel(trainer_group, self.backend)
        self.shares = ShareAgreement(self.channel, self.config)
        """The first phase of each sync: this rank's declaration, every rank's plan."""
        self.exchange, self.known = self.shares.exchange, self.shares.known
        self.sender.sender_count = self.channel.world_size  # buckets from free memory: a share of them each
        self.version: int | None = None
        self._model_bytes_of: tuple[ShardPlan | None, int] = (None, 0)

    @property
    def rank(self) -> int:
        return self.channel.rank

    @property
    def plan(self) -> ShardPlan | None:
        """The layout of the last sync."""
        return self.exchange.plan

    def sync(self, source: Any, *, version: int) -> SyncMetrics:
        """Send this rank's shares of `source` as `version`; the same call on every trainer
        rank. Returns this rank's metrics (`bytes`: what it sent; `model_bytes`: the whole
        model). Raises the `SyncError` every rank raises when the sync fails anywhere.
        Its two phases: `agree_shares`, then `send`."""
        return self.send(self.agree_shares(source), version=version)

    def agree_shares(self, source: Any) -> AgreedShares:
        """Declare what this rank holds of `source` and agree with every trainer rank on who
        sends which rows (`ShareAgreement.agree`). The same call on every trainer rank."""
        return self.shares.agree(source)

    def send(self, agreed: AgreedShares, *, version: int) -> SyncMetrics:
        """Send this rank's shares as `agreed` (`agree_shares`) as `version`; a refused
        agreement still goes through an (empty) sync, so the receivers hear why. Returns
        and raises as `sync`."""
        transport, bounds, plan, refused = self.sender.transport, self.config.bounds, agreed.plan, agreed.refused
        shares = _Shares(plan, self.rank, agreed.tensors) if refused is None else TensorSource([])
        outgoing = self.sender.offer(shares, version=version)
        outgoing.end_bound_s = bounds.behind_s  # the receivers first wait for every other sender
        metrics, own = None, None
        try:
            metrics = outgoing.send() if refused is None else outgoing.cancel(refused)
        except errors.PeerError:
            raise  # this group is broken: nobody here can agree on anything more
        except errors.SyncError as exc:
            own = exc
        report = RankReport(sender=True) if own is None else errors.report_exception(own, sender=True)
        with transport.bounded(bounds.behind_s):
            reports = transport.channel.agree(report, "every sender's status")
        if own is not None:
            raise own
        errors.raise_if_any(reports, transport.rank, f"sync of version {version}")
        self.version = version
        metrics.sending, metrics.senders = ALL, self.channel.world_size
        metrics.model_bytes = self._model_bytes(plan)
        return metrics

    def _model_bytes(self, plan: ShardPlan) -> int:
        """The whole model's bytes at the wire dtype, once per plan (not per tensor every sync)."""
        if self._model_bytes_of[0] is not plan:
            wire = self.config.wire_dtype
            nbytes = sum(s.numel * (wire_dtype_for(s.dtype, wire) if wire is not None else s.dtype).itemsize for s in plan.specs)
            self._model_bytes_of = (plan, nbytes)
        return self._model_bytes_of[1]

    def close(self) -> None:
        """Free this rank's transport's buffers (the groups are their owners')."""
        self.sender.close()
