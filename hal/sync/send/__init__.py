"""The trainer side of a sync.

- `sender`: `Sender`, one process sends its model (`Sender.offer` -> `OutgoingSync`);
- `packing`: how a segment is packed from the source;
- `gather`: `TrainerSync`, a sharded trainer's ranks gather in lockstep and one sends;
- `sharded`: `ShardedSender`, every trainer rank sends its own rows (M-to-N);
- `links`: `LinkSender`, each engine worker only its own pieces (M x N links, issue 41);
- `link_syncs`: `OneRankLinks`, `EveryRankLinks`, the sending sides of "one" and "all" over links.

Which of them a trainer rank is: hal.sync.endpoints (`make_sender`); each is a `SyncSender`
(`sync(source, version=)`, `version`, `close`).
"""

from hal.sync.send.gather import TrainerSync
from hal.sync.send.link_syncs import EveryRankLinks, OneRankLinks
from hal.sync.send.links import LinkSender
from hal.sync.send.sender import Sender
from hal.sync.send.sharded import ShardedSender

__all__ = [
    "EveryRankLinks",
    "LinkSender",
    "OneRankLinks",
    "Sender",
    "ShardedSender",
    "TrainerSync",
]
