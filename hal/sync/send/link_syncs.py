"""A trainer rank's sending side when each engine worker receives only its own pieces
(issue 41, `receive="shard"`): `OneRankLinks` ("one": this process sends the whole model)
and `EveryRankLinks` ("all": every trainer rank sends its own rows or blocks). Each is a
`SyncSender` (`sync(source, version=)`, `version`, `close`) over a `LinkSender`
(hal.sync.send.links) on this rank's sync group, with the two phases of `ShardedSender`:

    agreed = sender.agree_shares(source)     # what this rank holds, the M x N plan of it
    metrics = sender.send(agreed, version=v)  # each worker its link; metrics.bytes == plan.bytes_out[rank]

`agree_shares` builds this sync's M x N plan (hal.sync.plan.mxn) from what the trainer
ranks hold (one rank: every tensor whole; every rank: the plan they agree on, as
`ShardedSender` does) and the needs every worker told at init (hal.sync.plan.exchange),
kept while the layout is the same. A plan that cannot be built (a tensor of another
dtype, a box no rank sends) is `refused` on every trainer rank alike, before any engine
is asked to update: the caller raises it then (`WeightSync`'s drivers); `send` with a
refusal still tells the workers at the header (nothing moves).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import hal
from hal.backends.interface import Backend
from hal.sync import errors
from hal.sync.config import ALL, ONE, SyncConfig
from hal.sync.metrics import SyncMetrics
from hal.sync.plan.exchange import LinkPlans, whole_holdings
from hal.sync.plan.mxn import MxNPlan
from hal.sync.plan.needs import WorkerNeeds
from hal.sync.send.links import LinkSender
from hal.sync.send.sender import Sender
from hal.sync.send.sharded import ShareAgreement, local_tensors
from hal.sync.source import as_source
from hal.sync.spec import TensorSpec
from hal.sync.transport.peer import peer_links
from hal.sync.wire.channel import trainer_channel

__all__ = ["AgreedLinks", "EveryRankLinks", "OneRankLinks"]


@dataclass(frozen=True, slots=True)
class AgreedLinks:
    """The first phase of one sync on one trainer rank: the M x N plan and this rank's
    tensors, or why the sync is refused (the same `SyncError` on every trainer rank)."""

    plan: MxNPlan | None
    tensors: dict[str, Any]
    refused: errors.SyncError | None = None


class _Links:
    """What both sending sides share: the `LinkSender` over this rank's group and the plans."""

    sending = ONE

    def __init__(
        self, group: Any, needs: Sequence[WorkerNeeds], *, rank: int, config: SyncConfig | None, backend: Backend | None, token: str | None
    ) -> None:
        self.backend = backend or hal.current()
        transports = peer_links(group, control_device=self.backend.control_device(), dist_backend=self.backend.dist_backend)
        if len(transports) != len(needs):
            raise ValueError(f"{type(self).__name__}: the sync group has {len(transports)} engine workers, {len(needs)} told their needs")
        self.links = LinkSender(transports, rank=rank, config=config, backend=self.backend, token=token)
        self.config = self.links.config
        self.plans = LinkPlans(needs, self.config.wire_dtype)
        """This rank's M x N plans, the last kept while the layout is the same."""

    @property
    def sender(self) -> Sender:
        """The core `Sender` of the first worker's link (its config and token are every link's)."""
        return self.links.links[0]

    @property
    def version(self) -> int | None:
        return self.links.version

    @property
    def plan(self) -> MxNPlan | None:
        """The M x N plan of the last sync."""
        return self.plans.last

    def _planned(self, holdings: Any, tensors: dict[str, Any]) -> AgreedLinks:
        try:
            return AgreedLinks(self.plans.plan(holdings), tensors)
        except errors.SpecMismatchError as exc:  # built from the same inputs on every trainer rank: refused alike
            return AgreedLinks(None, tensors, exc)

    def sync(self, source: Any, *, version: int) -> SyncMetrics:
        """Both phases: `agree_shares`, then `send` (a refusal still told to the workers)."""
        return self.send(self.agree_shares(source), version=version)

    def agree_shares(self, source: Any) -> AgreedLinks:
        raise NotImplementedError

    def send(self, agreed: AgreedLinks, *, version: int) -> SyncMetrics:
        """Send each worker its link of `agreed.plan` as `version`; a refused plan is told
        to every worker at the header (nothing moves) and raised. Returns this rank's metrics
        (`bytes`: `plan.bytes_out[rank]`, `worker_bytes`: every worker's `bytes_in`)."""
        plan = agreed.plan if agreed.plan is not None else self.plan
        if plan is None:  # no plan was ever built: there is no link to announce the refusal on
            raise agreed.refused if agreed.refused is not None else ValueError("send: no plan")
        metrics = self.links.send(plan, agreed.tensors if agreed.refused is None else {}, version=version, refused=agreed.refused)
        metrics.sending, metrics.worker_bytes = self.sending, plan.bytes_in
        return metrics

    def close(self) -> None:
        self.links.close()


class OneRankLinks(_Links):
    """This process sends ("one"), each engine worker its own pieces: `group` is the sync
    group (this process its rank 0, the workers after it), `needs` every worker's record
    (index = the worker, its group rank - 1). `config` and `token` as for `Sender`."""

    sending = ONE

    def __init__(self, group: Any, needs: Sequence[WorkerNeeds], *, config: SyncConfig | None = None,
                 backend: Backend | None = None, token: str | None = None) -> None:
        super().__init__(group, needs, rank=0, config=config, backend=backend, token=token)

    def agree_shares(self, source: Any) -> AgreedLinks:
        """This process's tensors of `source` and the plan of them (every tensor whole from
        here); a plan that cannot be built is `refused`. Views where the source has them
        (a module's parameters, transformers' experts); a source that only yields computed
        tensors is read whole first."""
        try:
            pairs = local_tensors(source)
        except TypeError:  # a source of computed tensors (an adapter's own): read once, held for the sync
            pairs = list(as_source(source))
        tensors = dict(pairs)
        specs = [TensorSpec.of(name, tensor) for name, tensor in pairs]
        return self._planned(whole_holdings(specs), tensors)


class EveryRankLinks(_Links):
    """Every trainer rank sends ("all"), each engine worker its own pieces of this rank's
    rows or blocks: the same construction and calls on every rank of `trainer_group`, each
    with its own sync group `group` (this rank its rank 0, the workers after it) and every
    worker's `needs`. The ranks agree who sends what as `ShardedSender` does."""

    sending = ALL

    def __init__(self, group: Any, needs: Sequence[WorkerNeeds], *, config: SyncConfig | None = None,
                 trainer_group: Any = None, backend: Backend | None = None, token: str | None = None) -> None:
        backend = backend or hal.current()
        self.channel = trainer_channel(trainer_group, backend)
        super().__init__(group, needs, rank=self.channel.rank, config=config, backend=backend, token=token)
        self.shares = ShareAgreement(self.channel, self.config)
        """The trainer ranks' agreement on who sends which rows (hal.sync.send.sharded)."""

    @property
    def rank(self) -> int:
        return self.channel.rank

    def agree_shares(self, source: Any) -> AgreedLinks:
        """What this rank holds of `source`, the plan every trainer rank agrees on, and the
        M x N plan of it; a refusal of either the same on every trainer rank."""
        agreed = self.shares.agree(source)
        if agreed.refused is not None:
            return AgreedLinks(None, agreed.tensors, agreed.refused)
        return self._planned(agreed.plan, agreed.tensors)
