"""Choosing by time (`DeltaConfig.choose == "time"`): whether delta syncs pay, from the
sender's own measurements (docs/delta.md, "Choosing by time")."""

from __future__ import annotations

from collections import deque


class Pacer:
    """`DeltaConfig.choose == "time"`: whether delta syncs pay for their time, from the
    sender's own measurements (docs/delta.md, "Choosing by time"), in seconds per byte of
    the segments. A whole sync's time ends with its receivers' statuses, so it includes
    their apply; the encode's comes from the last delta sync or from samples: a whole sync
    before a decision encodes the start of a few segments only to time it."""

    FIRST_PAUSE = 2
    LONGEST_PAUSE = 64
    WHOLE_KEPT = 4
    SAMPLE_SEGMENTS = 4
    SAMPLE_BYTES = 4 << 20

    def __init__(self) -> None:
        self.whole: deque[float] = deque(maxlen=self.WHOLE_KEPT)  # recent whole syncs that allocated nothing
        self.encode_rate: float | None = None
        # what a delta sync cost beyond its encode (pack, wire, the receivers' apply), from
        # the last complete one: the samples time the encode alone
        self.delta_rest = 0.0
        self.pause_next = self.FIRST_PAUSE
        self.pausing = 0  # whole syncs left before the next decision

    def whole_s_per_byte(self) -> float | None:
        """The fastest recent whole sync: the minimum, so that noise makes deltas look worse, not better."""
        return min(self.whole) if self.whole else None

    def choose(self) -> tuple[str, bool]:
        """For a sync that could carry deltas: "delta" or "paused", and whether it samples
        (the last sync of a pause does, for the decision after it)."""
        if self.pausing:
            self.pausing -= 1
            return "paused", self.pausing == 0
        best = self.whole_s_per_byte()
        if best is None or self.encode_rate is None:
            return "paused", True  # nothing to judge by yet: measure both
        if self.encode_rate + self.delta_rest > best:  # a delta sync would cost more than a whole one
            self._lost()
            return self.choose()
        return "delta", False

    def _lost(self) -> None:
        self.pausing = self.pause_next  # twice as long each time in a row
        self.pause_next = min(2 * self.pause_next, self.LONGEST_PAUSE)

    def record(self, choice: str, seconds: float, nbytes: int, *, warm: bool, encode_rate: float | None) -> None:
        if encode_rate is not None:
            self.encode_rate = encode_rate
        if not nbytes:
            return
        rate = seconds / nbytes
        best = self.whole_s_per_byte()
        if choice in ("anchor", "paused"):
            if warm:  # (a sync that allocated the baseline or built a plan is slower than the next)
                self.whole.append(rate)
        else:
            if choice == "delta" and encode_rate is not None:
                self.delta_rest = max(0.0, rate - encode_rate)
            if choice == "stopped" or (best is not None and rate > best):
                self._lost()
            else:
                self.pause_next = self.FIRST_PAUSE
