"""Which backend this process uses: `VERL_DEVICE`, resolved lazily and once.

`auto` (the default) takes the one usable accelerator, else the CPU; two usable
accelerators raise instead of guessing (vLLM does the same for two platform
plugins). Out-of-tree backends register a `Backend` subclass through the
`hal.backends` entry-point group.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Iterator

from hal import env
from hal.backends.interface import Backend
from hal.backends.types import BackendUnavailableError
from hal.backends import AUTO_CANDIDATES, BUILTIN_BACKENDS

ENTRY_POINT_GROUP = "hal.backends"


@dataclass(frozen=True, slots=True)
class Resolution:
    """The backend in use and why it was chosen (shown by `hal info`)."""

    backend: Backend
    requested: str
    reason: str


_lock = threading.RLock()
_resolved: Resolution | None = None


def _entry_point_specs() -> dict[str, str]:
    specs: dict[str, str] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in BUILTIN_BACKENDS:
            raise ValueError(
                f"entry point {ep.value!r} in group {ENTRY_POINT_GROUP!r} tries to replace the "
                f"built-in backend {ep.name!r}; register it under another name"
            )
        if ep.name in specs and specs[ep.name] != ep.value:
            raise ValueError(
                f"two packages register backend {ep.name!r} in group {ENTRY_POINT_GROUP!r}: "
                f"{specs[ep.name]!r} and {ep.value!r}"
            )
        specs[ep.name] = ep.value
    return specs


def backend_names() -> list[str]:
    """Every name VERL_DEVICE accepts besides `auto`."""
    return sorted({*BUILTIN_BACKENDS, *_entry_point_specs()})


def backend_class(name: str) -> type[Backend]:
    """The class registered under `name`; ValueError listing the valid names otherwise."""
    specs = {**_entry_point_specs(), **BUILTIN_BACKENDS}
    spec = specs.get(name)
    if spec is None:
        valid = ", ".join(["auto", *backend_names()])
        raise ValueError(f"unknown backend {name!r} (VERL_DEVICE); valid names: {valid}")
    module_name, _, attr = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        # A registered backend whose package is broken is known but unusable: say which.
        raise BackendUnavailableError(f"backend {name!r} ({spec}) cannot be loaded: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"backend {name!r} ({spec}) is not a hal.Backend subclass")
    return cls


def get_backend(name: str) -> Backend:
    """An instance of backend `name`, or BackendUnavailableError saying why it cannot be used."""
    cls = backend_class(name)
    reason = cls.unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} is not usable: {reason}")
    return cls()


def resolve(requested: str | None = None) -> Resolution:
    """Pick a backend for `requested` (default: the VERL_DEVICE variable) without caching it."""
    requested = (requested or env.device_name()).strip().lower()
    if requested != "auto":
        return Resolution(get_backend(requested), requested, f"{env.VERL_DEVICE}={requested}")
    usable, reasons = [], {}
    for name in AUTO_CANDIDATES:
        reason = backend_class(name).unavailable_reason()
        if reason is None:
            usable.append(name)
        else:
            reasons[name] = reason
    if len(usable) > 1:
        raise BackendUnavailableError(
            f"{env.VERL_DEVICE}=auto found several usable accelerators ({', '.join(usable)}); "
            f"set {env.VERL_DEVICE} to one of them"
        )
    if usable:
        return Resolution(get_backend(usable[0]), "auto", f"auto: {usable[0]} is the only usable accelerator")
    why = "; ".join(f"{n}: {r}" for n, r in reasons.items())
    return Resolution(get_backend("cpu"), "auto", f"auto: no accelerator usable ({why})")


def resolution() -> Resolution:
    """The process-wide resolution, made on first use."""
    global _resolved
    with _lock:
        if _resolved is None:
            _resolved = resolve()
        return _resolved


def current() -> Backend:
    """The backend this process uses (resolved from VERL_DEVICE on first call)."""
    return resolution().backend


@contextlib.contextmanager
def use(backend: str | Backend) -> Iterator[Backend]:
    """Make `backend` current inside the block, then restore what was there (for tests and tools)."""
    global _resolved
    instance = get_backend(backend) if isinstance(backend, str) else backend
    with _lock:
        saved = _resolved
        _resolved = Resolution(instance, instance.name, "set by hal.use()")
    try:
        yield instance
    finally:
        with _lock:
            _resolved = saved


def reset() -> None:
    """Forget the resolution so the next `current()` reads VERL_DEVICE again."""
    global _resolved
    with _lock:
        _resolved = None
