"""The trainer side of a sync in which every trainer rank sends: `WeightSync(engines,
trainer_group=g, senders="all")`, made and called the same way on every rank of `g`.

Each trainer rank sends only the rows it holds (`hal.sync.ShardedSender`: FSDP2 shards as
they are) over a sync group of its own with every engine worker, and each worker puts
whole tensors together from all of them (`hal.sync.ShardedReceiver`, in
hal.integrations.vllm when `HalInitInfo.rendezvous` lists the ranks):

    init:  every rank picks a port on its own `master_address` and serves that group's
           rendezvous; the ranks exchange (address, port) over `g` (JSON through
           all-reduces, never pickled); rank 0 alone asks each engine to join, with a
           `HalInitInfo` listing every rank's rendezvous (the token's proof covers it);
           every rank joins its own group as its rank 0.
    sync:  the ranks agree on who sends which rows (a layout they disagree on is refused
           on every rank before any engine hears of it); rank 0 drives each engine's
           start / update_weights (in a thread) / finish / prefix-cache reset; every rank
           runs `ShardedSender.sync(source, version=)`; the ranks then agree on the
           outcome, so that every rank returns (with the engines' versions as rank 0 read
           them) or raises the same error, and resends the same way.

Each of those steps ends with an agreement over `g` (`hal.sync.errors.agree_failure`: every
rank's failure told with its class kept), bounded, so that a
failure on one rank (an engine refusing, a port taken, a rendezvous nobody came to) fails
every rank at once with the same error, instead of leaving the others waiting for their
timeout. Its group is joined through `hal.sync.TrainerSide`, as the other drivers' are.
`WeightSync` (hal.integrations.vllm.weight_sync) holds this driver (hal.integrations.vllm.drivers
has the others and their base, `Driver`).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from hal.backends.interface import Backend
from hal.integrations.vllm import shard_sync
from hal.integrations.vllm.drivers import Driver
from hal.integrations.vllm.engine_calls import fold_engine_errors
from hal.integrations.vllm.info import check_rendezvous
from hal.procs import free_port
from hal.sync import Sender, SyncError, SyncMetrics, TrainerSide
from hal.sync.config import ALL
from hal.sync.errors import PeerError, agree_failure
from hal.sync.wire import SyncGroupSpec, trainer_channel

# What each rank tells the others at init: its rendezvous and the engines it was given.
MAX_ENDPOINT_BYTES = 1 << 16


class EveryRankSends(Driver):
    """Every trainer rank sends its own rows ("all"; see the module doc). The same driver
    on every rank of the trainer group; trainer rank 0 alone calls the engines."""

    sending = ALL

    @property
    def core_sender(self) -> Sender | None:
        return None if self.sender is None else self.sender.sender

    # ---- init -----------------------------------------------------------------------------
    def join(self, backend: Backend) -> TrainerSide:
        """Every trainer rank: serve a rendezvous of its own, tell the others where (trainer
        rank 0 then asks the engines to join all of them), join it. After each step the
        ranks agree, so that all of them go on, or raise the same, together."""
        settings, engines = self.settings, self.engines
        settings.transport = "broadcast"
        channel = self.trainer_channel = trainer_channel(settings.trainer_group, backend)
        lead = channel.rank == 0
        port = settings.master_port or free_port(settings.master_address)
        mine = {"address": settings.master_address, "port": port, "engines": [[e.name, e.num_workers] for e in engines.engines]}
        try:
            with channel.bounded(settings.timeout_s):
                payloads = channel.all_gather_bytes(json.dumps(mine).encode(), "weight-sync endpoints", limit=MAX_ENDPOINT_BYTES)
            rendezvous, sizes = _rendezvous_of(payloads)  # the same on every rank, or the same error
        except BaseException:
            self.trainer_channel = None
            raise
        engines.place(sizes)  # on every rank: which group ranks are whose (`inconsistent`), and the world size
        settings.asked = shard_sync.asked_receive(settings.receive, sending=self.sending, transport=settings.transport,
                                                  sizes=engines.sizes, delta=settings.config.delta is not None)
        spec = SyncGroupSpec(address=settings.master_address, port=port, world_size=engines.world_size)
        side: TrainerSide | None = None
        try:
            side = TrainerSide(spec, backend=backend, timeout_s=settings.timeout_s)
            error = None
        except Exception as exc:  # noqa: BLE001 - told to every rank
            error = exc
        try:
            self._agree_init(error, "opening its rendezvous", settings.bounds.step_s)
        except BaseException:
            if side is not None:
                side.close()
            raise
        joining = side.join(f"hal-trainer rank {channel.rank}: join the weight-sync group")
        # the workers tell every group from inside their init: heard here while the engines initialise
        self.gathering = shard_sync.gather_needs(joining, settings, backend=backend, rank=channel.rank)
        try:
            error = None
            if lead:  # the engines are driven from here only
                try:
                    engines.join(joining, engines.ask_to_join(port, rendezvous), port)
                except Exception as exc:  # noqa: BLE001 - told to every rank
                    error = exc
            # the others wait here while the engines join (or refuse): their own joins end with it
            self._agree_init(error, "initialising the engines", settings.bounds.behind_s)
            if not lead:
                try:
                    side.group_within(f"trainer rank {channel.rank}: join the weight-sync group", settings.timeout_s)
                except Exception as exc:  # noqa: BLE001 - told to every rank
                    error = exc
            self._agree_init(error, "joining its weight-sync group", settings.bounds.behind_s)
        except BaseException:
            side.close()  # a join still waiting ends now, and the port is free
            self.group = side.group  # joined after all: released with the rest
            engines.shut_down()  # engines that joined let go of every trainer rank's group
            self.close()  # this rank of its own
            raise
        return side

    def _agree_init(self, error: BaseException | None, what: str, bound_s: float) -> None:
        """Every trainer rank's word on one step of init; raises the first rank's error on
        every rank (as its own class) when any rank failed."""
        channel = self.trainer_channel
        try:
            with channel.bounded(bound_s):
                failure = agree_failure(
                    channel, error, f"weight-sync init: {what}", lambda rank: f"WeightSync.init: trainer rank {rank}, {what}: ", my_rank=0
                )
        except BaseException:
            self.trainer_channel = None
            raise
        if failure is not None:
            self.trainer_channel = None  # init may be called again
            raise failure from error

    # ---- one sync --------------------------------------------------------------------------
    def attempt(self, source: Any, version: int, resend: Callable[[SyncError], bool]) -> tuple[SyncMetrics, dict[str, str]]:
        """One try on this rank: the shares agreed (refused on every rank before any engine
        hears of it), rank 0 drives the engines while every rank sends its rows, then every
        rank's outcome is agreed; (this rank's metrics, the engines' versions as rank 0 read
        them), or the same error on every rank."""
        agreed = self.sender.agree_shares(source)
        metrics, error, versions = None, agreed.refused, {}
        if agreed.refused is None:
            metrics, error, versions = self._send(agreed, version)
        # every rank's outcome: rank 0's error first (it holds the engines' messages), with the
        # reports of every rank's `SyncError` together, so every rank decides a resend alike;
        # the others wait here while rank 0 waits for the engines' calls and finishes them
        channel = self.trainer_channel
        with channel.bounded(self.settings.outcome_bound_s):
            failure = agree_failure(
                channel, error, f"outcome of the sync of version {version}",
                lambda rank: "" if rank == 0 else f"trainer rank {rank}: ", my_rank=0, together=True,
            )
        if failure is not None:
            raise failure from error
        return metrics, self._versions(versions, version)

    def _send(self, agreed: Any, version: int) -> tuple[SyncMetrics | None, BaseException | None, dict[str, str]]:
        engines, lead = self.engines, self.drives_engines
        problems: list[str] = []
        calls = engines.start(version, problems=problems) if lead else []  # a refusal fails the sync in every group
        metrics, error = None, None
        try:
            metrics = self.sender.send(agreed, version=version)  # every rank, its own rows
        except Exception as exc:  # noqa: BLE001 - told to every rank (a SyncError is already the same on all)
            error = exc
        versions: dict[str, str] = {}
        if not lead:
            return metrics, error, versions
        error = fold_engine_errors(error, problems + engines.wait(calls))
        if error is None:
            try:
                versions = engines.finish(version)
            except Exception as exc:  # noqa: BLE001 - told to every rank
                error = exc
        return metrics, error, versions

    def _versions(self, versions: dict[str, str], version: int) -> dict[str, str]:
        """The engines' versions as rank 0 read them, on every rank."""
        channel = self.trainer_channel
        mine = json.dumps(versions).encode() if self.drives_engines else b""
        with channel.bounded(self.settings.timeout_s):
            told = channel.all_gather_bytes(mine, f"engine versions after the sync of version {version}")[0]
        try:
            return {str(k): str(v) for k, v in dict(json.loads(told or b"{}")).items()}
        except (ValueError, TypeError, AttributeError) as exc:
            raise PeerError(f"sync of version {version}: trainer rank 0's engine versions are unreadable: {exc}") from None


def _rendezvous_of(payloads: list[bytes]) -> tuple[list[dict[str, Any]], list[tuple[str, int]]]:
    """Every trainer rank's rendezvous and rank 0's engines, from what each rank told
    (`EveryRankSends.init`); the same ValueError on every rank when an entry is bad,
    rank 0 has no engines, or another rank has other ones."""
    words = []
    for rank, payload in enumerate(payloads):
        try:
            word = json.loads(payload)
            if not isinstance(word, dict) or set(word) != {"address", "port", "engines"}:
                raise ValueError("not an object of address, port, engines")
            engines = [(str(name), int(workers)) for name, workers in word["engines"]]
        except (ValueError, TypeError) as exc:
            raise ValueError(f"WeightSync.init: trainer rank {rank}'s endpoint is unreadable: {exc}") from None
        words.append((word, engines))
    sizes = words[0][1]
    if not sizes:
        raise ValueError("WeightSync.init: trainer rank 0 has no engines; it drives them: pass them there")
    for rank, (_, engines) in enumerate(words[1:], start=1):
        if engines and engines != sizes:
            raise ValueError(
                f"WeightSync.init: trainer rank {rank} was given engines {engines} (name, workers), rank 0 {sizes}: "
                "pass the same engines on every trainer rank, or none but on rank 0"
            )
    rendezvous = [{"address": word["address"], "port": word["port"]} for word, _ in words]
    return check_rendezvous(rendezvous, words[0][0]["address"], words[0][0]["port"], "broadcast"), sizes
