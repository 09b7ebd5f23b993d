"""The types of the backend contract (hal.backends.interface): stream and event protocols, memory info,
the error of a backend that cannot be used."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


class BackendUnavailableError(RuntimeError):
    """A known backend that cannot be used in this process; the message says why."""


@runtime_checkable
class Stream(Protocol):
    def wait_stream(self, stream: "Stream") -> None: ...
    def wait_event(self, event: "Event") -> None: ...
    def record_event(self, event: "Event | None" = None) -> "Event": ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...


@runtime_checkable
class Event(Protocol):
    def record(self, stream: Stream | None = None) -> None: ...
    def wait(self, stream: Stream | None = None) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end_event: "Event") -> float: ...


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """Device memory in bytes, as the backend's runtime reports it."""

    free: int
    total: int


@dataclass(frozen=True, slots=True, eq=False)
class PreparedCopies:
    """Copies made ready by `Backend.prepare_copies`, run by `Backend.copy_prepared_`."""

    backend: str  # the name of the backend that made them: only it can run them
    count: int  # pairs
    handle: Any  # what that backend keeps to run them (its own business)
