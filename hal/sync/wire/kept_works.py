"""Collectives' work objects, held so that the collective library's threads never let go of one last.

A gloo worker thread marks a collective complete, and only then (after re-taking its queue's
lock) drops its own reference to the work. Under load that lags by milliseconds. If Python
has let go of the work and its tensors by then, the thread's drop is the last: it frees a
tensor Python created, which needs the GIL. While the interpreter shuts down that ends the
thread inside a C++ destructor, and the process aborts ("terminate called without an active
exception", issue 18; a fresh clone's `make test` under load, 2026-11-27 and 2026-11-29).

So a channel keeps its last collectives' works (`KeptWorks.keep`): always the last few,
and as many more as stay small (the control collectives of a sync's end are tiny and come
in runs); and at exit every kept work gets a reference nothing gives back, then the
threads get a moment, GIL free, to drop what they still hold of older works.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import time
import weakref
from typing import Any

import torch

KEEP_LAST = 4  # works kept whatever their size
KEEP_WORKS = 256  # at most this many kept in all...
KEEP_BYTES = 64 << 20  # ...while their tensors come to no more than this (staged host copies can be large)
SETTLE_S = 0.05  # at exit, the GIL-free pause the library's threads get, when a collective ran lately
RECENT_S = 1.0  # "lately"


class KeptWorks:
    """The last collectives' work objects of one channel, oldest first (see the module)."""

    def __init__(self) -> None:
        self._works: collections.deque[tuple[Any, int]] = collections.deque()
        self._bytes = 0
        self.last_kept_at = float("-inf")  # time.monotonic() of the last `keep`
        _EVERY.add(self)

    def keep(self, work: Any, tensor: torch.Tensor) -> Any:
        """Hold `work`, the collective on `tensor` just posted; returns it."""
        nbytes = tensor.numel() * tensor.element_size()
        self._works.append((work, nbytes))
        self._bytes += nbytes
        self.last_kept_at = time.monotonic()
        while len(self._works) > KEEP_LAST and (len(self._works) > KEEP_WORKS or self._bytes > KEEP_BYTES):
            self._bytes -= self._works.popleft()[1]
        return work

    def works(self) -> list[Any]:
        return [work for work, _ in self._works]

    @property
    def nbytes(self) -> int:
        """The bytes of the kept works' tensors."""
        return self._bytes


_EVERY: "weakref.WeakSet[KeptWorks]" = weakref.WeakSet()


@atexit.register
def hold_past_exit() -> None:
    """Run at exit, before the interpreter tears down (the process's memory goes with it
    anyway): a reference nothing gives back to every kept work, so no library thread's
    late drop of one is the last; then, if a collective ran lately, a GIL-free pause in which
    a lagging thread drops what it still holds of older works while Python can still free
    them."""
    lately = False
    for kept in list(_EVERY):
        for work in kept.works():
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))
        lately = lately or time.monotonic() - kept.last_kept_at < RECENT_S
    if lately:
        time.sleep(SETTLE_S)
