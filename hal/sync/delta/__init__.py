"""Delta sync: after a whole sync, send per segment only the words that changed (docs/delta.md).

The sender and the receiver call one per-segment interface whether delta is on or off:

- sender (`encode`): per sync, `segments = DeltaSender.begin(...)`, or `NO_DELTA` without
  delta; per segment `pack_target`, `clear_gaps`, `checksum_base`, `encode` -> (the bytes
  to send, their encoding, the event they are ready at). The pacer (`pacer`) decides, by
  time or bytes, whether deltas pay.
- receiver (`apply`): `DeltaReceiver` keeps what a delta lands on and checks a header's
  delta base against it; per sync it hands the receiver an applier (image or scatter)
  that answers `land`, `complete` and `image` per segment as the receiver's plain path does.
- both: a delta a receiver refuses for its base is sent again whole at once
  (`agree_or_go_whole`, the one loop of that exchange on either side).
"""

from __future__ import annotations

from typing import Callable

from hal.sync import errors
from hal.sync.delta.apply import DeltaReceiver, scatter_key
from hal.sync.delta.encode import NO_DELTA, DeltaSender

__all__ = ["NO_DELTA", "DeltaReceiver", "DeltaSender", "agree_or_go_whole", "scatter_key"]


def agree_or_go_whole(agree: Callable[[], None], offered_delta: Callable[[], bool], go_whole: Callable[[], None]) -> None:
    """Run one header's agreement (`agree`) until it passes. A refusal only of a delta's
    base (`SyncError.only_delta_base`: the same answer on every rank) while the header
    offered a delta (`offered_delta()`) means the sender sends the same sync whole at once:
    `go_whole` readies this side for that next header (the sender makes it, a receiver
    takes and checks it) and the agreement runs again. Any other refusal is raised."""
    while True:
        try:
            agree()
            return
        except errors.SyncError as exc:
            if not (offered_delta() and exc.only_delta_base):
                raise
            go_whole()
