"""The trainer side of a shard receive (issue 41): what `WeightSync(receive=...)` asks the
engines for, the engine workers' needs gathered at init, and the sending side over links.

    WeightSync(engines, receive="auto" | "shard" | "whole", ...)

- `asked_receive`: what every engine is asked for (`HalInitInfo.receive`), from the
  user's `receive`, who sends and over which transport: "auto" asks for whole tensors
  where a shard receive cannot help (an engine of one worker needs every tensor whole; over
  IPC on one node nothing travels either way) or is not built ("gather": the gathering rank
  would hold the whole model first; delta over links), and says why once; "shard" there is
  refused by `WeightSync` at construction.
- `gather_needs`: while the engines initialise, each trainer rank gathers every worker's
  word in its own sync group (hal.sync.plan.exchange), in a thread of its own: the workers
  tell it from inside their init, which returns only once every group has heard them.
- `choice_of`: every trainer rank decides as every worker does (`choose_receive`).
- `link_sender`: this rank's sending side over links (`OneRankLinks`, `EveryRankLinks`).
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Any

from hal.backends.interface import Backend
from hal.sync.config import ALL, GATHER, ONE
from hal.sync.plan.exchange import AUTO, SHARD, WHOLE_TENSORS, ReceiveChoice, choose_receive, exchange_needs, read_payloads
from hal.sync.plan.needs import WorkerNeeds
from hal.sync.send import EveryRankLinks, OneRankLinks
from hal.sync.wire import GroupChannel
from hal.threads import in_daemon_thread, result_within

logger = logging.getLogger("hal.integrations.vllm.weight_sync")


def shard_problem(*, sending: str, transport: str, delta: bool = False) -> str | None:
    """Why this trainer cannot send a shard receive, whatever the engines (None: it can)."""
    if delta:
        return "delta sync over point-to-point links is not built yet (SyncConfig.delta)"
    if sending == GATHER:
        return "senders='gather' sends whole tensors (a shard receive: senders 'one' or 'all')"
    if transport == "ipc":
        return "transport 'ipc' shares every bucket on one node: nothing travels, whole or in shards"
    return None


def asked_receive(receive: str, *, sending: str, transport: str, sizes: list[tuple[str, int]], delta: bool = False) -> str:
    """What the engines are asked for (`HalInitInfo.receive`): `receive` as given, but
    "auto" asks for "whole" where a shard receive cannot help or is not built (logged once)."""
    if receive != AUTO:
        return receive
    why = shard_problem(sending=sending, transport=transport, delta=delta)
    single = [name for name, workers in sizes if workers < 2]
    if why is None and single:
        why = f"engine(s) {single} have one worker, which needs every tensor whole"
    if why is not None:
        logger.info("hal weight sync: receive='auto' takes whole tensors: %s", why)
        return WHOLE_TENSORS
    return AUTO


def gather_needs(joining: "concurrent.futures.Future[Any]", settings: Any, *, backend: Backend, rank: int) -> "concurrent.futures.Future[list[bytes]] | None":
    """In a thread of its own: once trainer rank `rank`'s sync group is joined, every
    worker's word in it (`exchange_needs`; this rank, the group's rank 0, tells none).
    None when the engines are asked for whole tensors (`settings.asked`: they tell nothing)."""
    if settings.asked == WHOLE_TENSORS:
        return None
    timeout_s = settings.timeout_s

    def gather() -> list[bytes]:
        group = joining.result(timeout=timeout_s)
        channel = GroupChannel(group, control_device=backend.control_device())
        with channel.bounded(timeout_s):
            return exchange_needs(channel, b"")

    return in_daemon_thread(f"hal-trainer rank {rank}: engine workers' needs", gather)


def choice_of(gathering: "concurrent.futures.Future[list[bytes]] | None", receive: str, *, timeout_s: float) -> ReceiveChoice:
    """What every rank decided: shard receive with every worker's needs, or whole tensors."""
    if gathering is None:
        return ReceiveChoice(False, why=f"receive={receive!r}")
    payloads = result_within(gathering, "the engine workers' needs", timeout_s)
    choice = choose_receive(receive, read_payloads(payloads))
    if choice.shard:
        shard = sum(n.nbytes for n in choice.needs)
        logger.info(
            "hal weight sync: shard receive, %d engine workers take %.3f MiB a sync together (%.3f MiB of model each if whole)",
            len(choice.needs), shard / 2**20, sum(s.nbytes for s in choice.needs[0].specs) / 2**20,
        )
    elif receive == AUTO:
        logger.info("hal weight sync: receive='auto' takes whole tensors: %s", choice.why)
    return choice


def link_sender(sending: str, group: Any, needs: tuple[WorkerNeeds, ...], settings: Any, backend: Backend) -> OneRankLinks | EveryRankLinks:
    """This rank's sending side over links ("one" or "all"; `settings`: the driver's)."""
    if sending == ONE:
        return OneRankLinks(group, needs, config=settings.config, backend=backend, token=settings.token)
    if sending == ALL:
        return EveryRankLinks(group, needs, config=settings.config, trainer_group=settings.trainer_group, backend=backend, token=settings.token)
    raise ValueError(f"a shard receive is sent by senders 'one' or 'all', not {sending!r}")


__all__ = ["SHARD", "asked_receive", "choice_of", "gather_needs", "link_sender", "shard_problem"]
