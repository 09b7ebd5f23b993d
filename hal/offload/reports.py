"""What an offload or onload reports, and the error it raises."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


class OffloadError(RuntimeError):
    """An offload or onload that cannot be done as asked; the message names the tensor."""


@dataclass(frozen=True, slots=True)
class MoveReport:
    """What one `offload` or `onload` call moved."""

    direction: Literal["offload", "onload"]
    """Which way the tensors went: device to host ("offload") or host to device ("onload")."""
    tensors: int
    """Tensors copied (parameters, gradients and optimizer-state tensors)."""
    bytes: int
    """Bytes copied."""
    host_bytes_allocated: int
    """Host (pinned where possible) bytes newly allocated by this call; 0 when every buffer was reused."""
    seconds: float | None
    """Wall time of the copies including the final wait; None when nothing was moved."""

    def as_dict(self) -> dict[str, Any]:
        return {
            f"{self.direction}_tensors": self.tensors,
            f"{self.direction}_bytes": self.bytes,
            f"{self.direction}_host_bytes_allocated": self.host_bytes_allocated,
            f"{self.direction}_s": self.seconds,
        }


@dataclass(slots=True)
class OnloadedReport:
    """What `onloaded` did: the onload on entry, and the offload on exit (None until then)."""

    onload: MoveReport
    """The onload done on entering the block (0 tensors, seconds None when nothing was offloaded)."""
    offload: MoveReport | None = None
    """The offload done on leaving the block; None while inside it."""

    def as_dict(self) -> dict[str, Any]:
        out = self.onload.as_dict()
        if self.offload is not None:
            out.update(self.offload.as_dict())
        return out
