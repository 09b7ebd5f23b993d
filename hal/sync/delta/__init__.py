"""Delta sync: after a whole sync, send per segment only the words that changed (docs/delta.md).

The sender and the receiver call one per-segment interface whether delta is on or off:

- sender (`encode`): per sync, `segments = DeltaSender.begin(...)`, or `WHOLE` without
  delta; per segment `pack_target`, `clear_gaps`, `checksum_base`, `encode` -> (the bytes
  to send, their encoding, the event they are ready at). The pacer (`pacer`) decides, by
  time or bytes, whether deltas pay.
- receiver (`apply`): `DeltaReceiver` keeps what a delta lands on and checks a header's
  delta base against it; per sync it hands the receiver an applier (image or scatter)
  that answers `land`, `complete` and `image` per segment as the receiver's plain path does.
"""

from hal.sync.delta.apply import DeltaReceiver, scatter_key
from hal.sync.delta.encode import WHOLE, DeltaSender

__all__ = ["WHOLE", "DeltaReceiver", "DeltaSender", "scatter_key"]
