"""What a receiver delivers into: the one receiving contract.

A `Sink` is the engine side of a sync. The `Receiver` owns every copy and every
decision about where bytes land; the sink only says where it would like each tensor
(`destination`), takes tensors once they are complete and checked (`apply`), and hears
when a sync it took part of failed (`abort`):

    class MyEngine:
        def destination(self, name):       # a tensor the receiver may write, or None
            return self.weights.get(name)
        def apply(self, pairs):            # complete tensors, in sending order
            ...
        def abort(self):                   # the sync failed after some pairs were applied
            ...

`destination(name)` returning a tensor means: write this tensor's new bytes there (the
receiver lands them in place when they travel alone and the sender vouches that the
whole tensor follows, and copies them there otherwise, casting if the dtype differs),
and `apply` then receives that very tensor. Returning None means: hand me a view in
`apply`, valid only during the call (copy what you keep, as `load_weights` does). On a
device, a view is ready in the order of the receiver's current stream: torch ops on that
stream (the default) read it after the bytes landed; reading it on another stream or on
the host needs that stream synchronized first.

A tensor is written into a destination, or handed to `apply`, only once all of its
bytes are here and, with verification, checked: after a failed sync every destination
holds its old bytes or its new bytes, never a mix (the one exception, a connection that
breaks in the middle of an in-place transfer, is reported by name: `Receiver.torn`).

In a delta sync (`SyncConfig.delta`) `apply` gets only the tensors that changed since the
previous version; a sink that must see every tensor (one that re-processes whole layers)
sets `apply_unchanged = True`. When every tensor has an exact destination (wire dtype,
contiguous, this device) and the sync is not verified, the destinations are the delta's
base: changed words are scattered into them, so they must hold, between syncs, exactly
what the last sync delivered (a sink whose owner changes them sets `in_place = False`:
the receiver then keeps its own image of the sync, one model's worth of memory).

Set `in_place = False` on a sink whose destinations must never be received into
directly (every tensor then goes through the receiver's buffer and one copy, and not
even a broken connection can tear one). Set `whole_buckets = True` on a sink that pays for tensors of one group (a layer)
arriving in different calls: `apply` is then called once per bucket.

A plain callable `apply(pairs)` is accepted wherever a sink is (`as_sink`).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch

Pairs = list[tuple[str, torch.Tensor]]


@runtime_checkable
class Sink(Protocol):
    def destination(self, name: str) -> torch.Tensor | None: ...
    def apply(self, pairs: Pairs) -> None: ...
    def abort(self) -> None: ...


class CallableSink:
    """A sink around a plain `apply(pairs)` callable: no destinations, nothing to abort."""

    def __init__(self, fn: Callable[[Pairs], Any]) -> None:
        self.fn = fn

    def destination(self, name: str) -> torch.Tensor | None:
        return None

    def apply(self, pairs: Pairs) -> None:
        self.fn(pairs)

    def abort(self) -> None:
        pass


def as_sink(target: Any) -> Sink:
    """`target` as a `Sink`: a sink as is, a callable wrapped in `CallableSink`."""
    if isinstance(target, Sink):
        return target
    if callable(target):
        return CallableSink(target)
    raise TypeError(
        f"cannot receive into a {type(target).__name__}: pass a Sink (destination, apply, abort) or a callable apply(pairs)"
    )
