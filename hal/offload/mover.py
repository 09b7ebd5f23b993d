"""How tensors move: each one's reused host buffer (`Slot`), and one direction's copies run together
on a copy stream with one wait at the end (`Mover`).

Everything goes through the Backend contract: host buffers from `backend.empty_pinned`,
copies by `backend.copy_` on a stream of the backend's, waited for through an event, so the
same code is correct on the `sim` backend, whose copies really are asynchronous.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from torch.utils.weak import WeakIdKeyDictionary

from hal.backends.interface import Backend
from hal.offload.reports import MoveReport, OffloadError


@dataclass(slots=True)
class Slot:
    """One tensor that can live on the device or in its host buffer."""

    label: str
    """Names the tensor in errors: "parameter 'layer.weight'"."""
    host: torch.Tensor | None = None
    """The host buffer, kept and reused by every later offload."""
    on_host: bool = False


# One copy stream per backend instance, created on its first copy.
_copy_streams: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def copy_stream(backend: Backend) -> Any:
    stream = _copy_streams.get(backend)
    if stream is None:
        stream = _copy_streams[backend] = backend.new_stream()
    return stream


def check_on_device(backend: Backend, label: str, tensor: torch.Tensor) -> None:
    expected = backend.device()
    if tensor.device != expected:
        raise OffloadError(
            f"{label} is on {tensor.device}, expected {expected} (backend {backend.name!r}); "
            f"offload moves tensors from the backend's device only"
        )


class Mover:
    """Collects copies of one direction, runs them on a copy stream, waits once; then runs
    the host-side steps (`then`) that point the tensors at their new memory."""

    def __init__(self, backend: Backend, direction: Literal["offload", "onload"]) -> None:
        self.backend = backend
        self.direction = direction
        self.tensors = 0
        self.bytes = 0
        self.host_bytes_allocated = 0
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._after: list[Callable[[], None]] = []

    def host_buffer(self, slot: Slot, like: torch.Tensor) -> torch.Tensor:
        """The slot's host buffer, allocated only when missing or of another shape/dtype."""
        host = slot.host
        if host is None or host.shape != like.shape or host.dtype != like.dtype:
            host = self.backend.empty_pinned(tuple(like.shape), like.dtype)
            slot.host = host
            self.host_bytes_allocated += host.numel() * host.element_size()
        return host

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._copies.append((dst, src))
        self.tensors += 1
        self.bytes += src.numel() * src.element_size()

    def then(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the host after every copy has completed."""
        self._after.append(fn)

    def run(self) -> MoveReport:
        seconds: float | None = None
        if self._copies:
            backend = self.backend
            stream = copy_stream(backend)
            start = time.perf_counter()
            # The tensors may still be written by work queued on the current stream.
            stream.wait_stream(backend.current_stream())
            for dst, src in self._copies:
                backend.copy_(dst, src, stream=stream)
            done = stream.record_event()
            done.synchronize()
            seconds = time.perf_counter() - start
        for fn in self._after:
            fn()
        self._copies.clear()
        return MoveReport(
            direction=self.direction,
            tensors=self.tensors,
            bytes=self.bytes,
            host_bytes_allocated=self.host_bytes_allocated,
            seconds=seconds,
        )
