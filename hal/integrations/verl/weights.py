"""The weights of one verl update as they flow through hal: verl's weight generator as a hal source
(trainer side, `GeneratorSource`), and hal's push-style receive as verl's async generator
(rollout side, `HandoffSink`). Imports no verl.
"""

from __future__ import annotations

import asyncio
import collections.abc
import threading
from typing import Any, AsyncIterator, Iterator

import torch

from hal.backends.interface import Backend
from hal.sync import SinkPolicy, TensorSpec


# ---- the trainer side: verl's generator as a hal source ---------------------------------------
class SpecsChanged(ValueError):
    """verl's generator yielded other tensors than the specs this engine learned."""


class GeneratorSource:
    """verl's `(name, tensor)` generator (sync or async) as a hal `WeightSource`.

    `specs`: the tensors of the previous sync, or None to learn them now: `metadata()`
    then iterates the generator in full (every trainer rank's gathers run there, in
    lockstep) and, with `keep` (the sending rank), keeps each tensor in host memory for the
    sync to send; a rank without `keep` then iterates nothing more. With specs, iteration
    streams and checks every tensor against them. Iterated in a worker thread: an
    async generator is stepped on `loop`.
    """

    def __init__(self, weights: Any, specs: list[TensorSpec] | None, loop: asyncio.AbstractEventLoop, *, keep: bool = True) -> None:
        self._keep = keep
        self._loop = loop
        self._async = isinstance(weights, collections.abc.AsyncIterable)
        self._iterator = weights.__aiter__() if self._async else iter(weights)
        self.specs = specs
        self.learned = specs is None
        self.changed = False
        self._kept: list[tuple[str, torch.Tensor]] | None = None

    def _next(self) -> tuple[str, torch.Tensor] | None:
        if not self._async:
            return next(self._iterator, None)
        future = asyncio.run_coroutine_threadsafe(self._iterator.__anext__(), self._loop)
        try:
            return future.result()
        except StopAsyncIteration:
            return None

    def _pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        while (pair := self._next()) is not None:
            name, tensor = pair
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"verl's weight generator yielded a {type(tensor).__name__} for {name!r}, not a tensor")
            yield name, tensor

    def metadata(self) -> list[TensorSpec]:
        if self.specs is None:
            specs, kept = [], []
            for name, tensor in self._pairs():
                specs.append(TensorSpec.of(name, tensor))
                if self._keep:
                    kept.append((name, tensor.detach().to("cpu")))
            self.specs, self._kept = specs, kept
        return self.specs

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        specs = self.metadata()
        if self._kept is not None:
            kept, self._kept = self._kept, None
            kept.reverse()
            while kept:  # hand each one over and forget it: host memory goes as the sync goes
                yield kept.pop()
            return
        count = 0
        for name, tensor in self._pairs():
            if count >= len(specs):
                self.changed = True
                raise SpecsChanged(f"verl's generator yielded {name!r} after the {len(specs)} tensors of the learned specs")
            spec = specs[count]
            if (name, tuple(tensor.shape), tensor.dtype) != (spec.name, spec.shape, spec.dtype):
                self.changed = True
                raise SpecsChanged(
                    f"tensor {count} of verl's generator is {name!r} {tuple(tensor.shape)} {tensor.dtype}; "
                    f"the learned specs have {spec.name!r} {spec.shape} {spec.dtype}"
                )
            count += 1
            yield name, tensor
        if count != len(specs):
            self.changed = True
            raise SpecsChanged(f"verl's generator ended after {count} of the {len(specs)} tensors of the learned specs")


# ---- the rollout side: hal's push-style receive as verl's async generator ---------------------
_END = object()  # what `finish` puts in the queue after the last batch


class HandoffSink:
    """A `Sink` that hands each complete tensor to the event loop and waits until the consumer
    is done with it (asks for the next one), so the receiver may reuse its buffer after.

    The receiver runs in a worker thread and calls `apply`; the loop reads `batches()`;
    `finish` (the receive's done callback) ends them, `close` releases a receiver still
    waiting when the consumer stopped early."""

    # with delta syncs too: every tensor, every update (see the module doc)
    policy = SinkPolicy(in_place=False, apply_unchanged=True, destinations="none")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float, backend: Backend) -> None:
        self.loop = loop
        self.timeout_s = timeout_s
        self.backend = backend
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self._released = threading.Event()
        self._consumer_done: Any = None  # an event recorded on the consumer's stream

    def destination(self, name: str) -> None:
        return None

    def apply(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        if self.closed:
            raise RuntimeError("the rollout's consumer of receive_weights stopped before the sync ended")
        self._released.clear()
        self.loop.call_soon_threadsafe(self.queue.put_nowait, list(pairs))
        if not self._released.wait(self.timeout_s):
            raise TimeoutError(f"the rollout's consumer took more than {self.timeout_s:g} s over {len(pairs)} tensor(s)")
        if self.closed:
            raise RuntimeError("the rollout's consumer of receive_weights stopped before the sync ended")
        done, self._consumer_done = self._consumer_done, None
        if done is not None:
            done.synchronize()  # copies the consumer queued on its stream read these views

    def abort(self) -> None:
        pass

    async def batches(self) -> AsyncIterator[list[tuple[str, torch.Tensor]]]:
        """On the loop: each batch `apply` handed over, until `finish`; a batch's tensors are
        released when the consumer asks for the next batch."""
        while True:
            batch = await self.queue.get()
            if batch is _END:
                return
            yield batch
            self.release()

    def release(self) -> None:
        """On the loop: the consumer asked for more, so the tensors handed out are free."""
        self._consumer_done = self.backend.current_stream().record_event()
        self._released.set()

    def finish(self, _result: Any = None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, _END)

    def close(self) -> None:
        self.closed = True
        self._released.set()
