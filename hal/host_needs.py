"""What hal relies on in a host package it may not be able to import (vLLM's CUDA builds,
torch_npu): one `Need` per name, call, message or base class, declared beside the code
that relies on it (`VLLM_NEEDS` in hal.integrations.vllm.needs, beside the fence;
`TORCH_NPU_NEEDS` in hal.backends.npu). tests/hosts/ reads the host's Python sources with `ast` (never
importing them) and checks every table; docs/ci.md ("Host sources read") says what is read.

A *target* names what is needed: `"pkg.module"` (a module), `"pkg.module:Name"` (a name
the module defines or imports) or `"pkg.module:Class.member"` (a member of a class: its
own or a base's, a method, a class attribute or an attribute its methods assign on
`self`).

Where the host moved something between the releases hal supports, one need per place says
in which releases (`since`, `before`) hal relies on it there.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Call", "Need"]


@dataclass(frozen=True, slots=True)
class Call:
    """How hal calls a function, method or class: `positional` arguments, then `keywords`."""

    positional: int = 0
    keywords: tuple[str, ...] = ()

    def __init__(self, positional: int = 0, *keywords: str) -> None:
        object.__setattr__(self, "positional", positional)
        object.__setattr__(self, "keywords", tuple(keywords))


@dataclass(frozen=True, slots=True, kw_only=True)
class Need:
    """One thing hal relies on in a host package's sources."""

    target: str
    """`"pkg.module"`, `"pkg.module:Name"` or `"pkg.module:Class.member"` (see the module doc)."""
    why: str
    """Where hal relies on it (a function of hal, in a few words)."""
    call: Call | None = None
    """hal calls the target so: it must accept these arguments and require no others."""
    text: str | None = None
    """A string literal the target module must contain (a log message hal filters on)."""
    sets: str | None = None
    """An attribute name the target function (or any method of the target class) assigns
    on some object (`layer.cpu_linear = ...`): hal reads that attribute."""
    implemented_by: str | None = None
    """`"hal.module:Class"`: every abstract method of the target class is defined there."""
    optional: bool = False
    """hal copes without it (looks it up with a fallback): its absence is reported, not a failure."""
    since: tuple[int, int] | None = None
    """The first host release, (major, minor), in which hal relies on it; None: every release."""
    before: tuple[int, int] | None = None
    """The first host release in which hal no longer relies on it (it moved); None: none."""

    def applies_to(self, release: tuple[int, int] | None) -> bool:
        """Whether hal relies on this in host release `release` (None: any release, every need)."""
        if release is None:
            return True
        return (self.since is None or release >= self.since) and (self.before is None or release < self.before)
