"""An engine worker's pieces land straight in its layers: `LandingSink`, the protocol side
(issue 41; the engine's side for vLLM: hal.integrations.vllm.landing).

A worker that receives only its own pieces (hal.sync.receive.links) has no whole tensor to
hand its engine: each piece lands in the region of the worker's parameter its loader
would have written (`WorkerNeeds`: the recorded destination of each box), in the
checkpoint layout of the worker's shard. The engine gives those parameters one layer at a
time and processes a layer once all of it landed (`EngineLayers`, below):

- `open_layer`: the first time a piece of a layer arrives, the engine makes the layer's
  targets ready to land in (vLLM: `materialize_layer`, its reload's own staging). A
  target it has no such tensor for (vLLM 0.32 keeps `bias` live) is held by the sink,
  whole, until the layer completes;
- each piece is copied from the receive buffer into its region (one copy, a strided
  region for a column piece); the layer's landed elements are counted;
- a layer whose count reaches its recorded total goes to the caller's thread: the
  recorded fills are applied (a padded vocabulary's zero rows), then `close_layer`
  (vLLM: `_layerwise_process`, the fused-MoE repack);
- `finish` once every layer closed; `abort` when the sync failed: every layer opened and
  not closed goes back to its old bytes, every closed one holds new bytes. Old or new per
  layer, hence per tensor.

Every call into the engine is made on the thread that called `LinkReceiver.receive`, one
at a time: a receiving thread that needs a layer opened asks that thread and waits.

Memory: the layers open at once are bounded by `budget_bytes` (the bytes that land in
them): a receiving thread ahead of another waits before opening a new layer, never the
one furthest behind, so the wait always ends (the rule of hal.sync.receive.assembly).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch

import hal
from hal.backends.interface import Backend
from hal.sync import errors
from hal.sync.plan.link_specs import LinkSpecs
from hal.sync.plan.needs import Target, WorkerNeeds
from hal.sync.sink import Pairs, SinkPolicy

__all__ = ["EngineLayers", "Landing", "LandingSink"]


@runtime_checkable
class EngineLayers(Protocol):
    """What an engine worker gives a `LandingSink`. Every call is made on the thread that
    called `LinkReceiver.receive`, one at a time; a layer is a `Target.layer` of the
    worker's recorded needs (a module), opened at most once per sync."""

    def begin(self) -> None:
        """A sync starts landing (every rank agreed on its headers; nothing landed yet)."""

    def open_layer(self, layer: str, targets: Sequence[Target]) -> Sequence[torch.Tensor | None]:
        """Where `layer`'s targets land, one per target in order: a contiguous tensor of the
        target's shape (its checkpoint-layout parameter, staged: old bytes stay where the
        engine computes from until `close_layer`), or None for one the engine keeps live
        (the sink holds its bytes and hands them to `close_layer`)."""

    def close_layer(self, layer: str, held: Mapping[str, torch.Tensor]) -> None:
        """Every element of `layer` landed and its fills are applied: make it the engine's
        (process it into the kernel's tensors). `held`: the targets `open_layer` gave None
        for, by `Target.name`, whole."""

    def finish(self) -> None:
        """Every layer of this sync closed on this worker (before the ranks agree on the outcome)."""

    def abort(self) -> None:
        """The sync failed: put every layer opened and not closed back to its old bytes;
        closed ones keep their new bytes (after `finish`, none is left open)."""


class LandingSink:
    """Lands engine worker `needs.worker`'s pieces in its layers (see the module doc):
    `needs` its recorded needs (the plan's `needs[worker]`), `engine` its layers,
    `budget_bytes` the bytes of layers open at once beyond which a receiving thread that
    is ahead waits. Kept across syncs: what a sync needs of the record is derived once."""

    def __init__(self, needs: WorkerNeeds, engine: EngineLayers, *, budget_bytes: int = 256 << 20, backend: Backend | None = None) -> None:
        if not isinstance(engine, EngineLayers):
            raise TypeError(f"LandingSink engine must implement EngineLayers (begin, open_layer, close_layer, finish, abort), got {type(engine).__name__}")
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"LandingSink budget_bytes must be a non-negative int, got {budget_bytes!r}")
        self.needs, self.engine, self.budget_bytes = needs, engine, budget_bytes
        self.backend = backend or hal.current()
        self.streams: list[Any] = []  # one per receiving thread, kept across syncs
        names: dict[str, int] = {}
        self.target_layer = [names.setdefault(t.layer, len(names)) for t in needs.targets]
        self.layer_names = list(names)
        count = len(names)
        self.totals, self.nbytes, self.order = [0] * count, [0] * count, [len(needs.specs)] * count
        dtypes: list[torch.dtype | None] = [None] * len(needs.targets)
        for need in needs.needs:
            layer, spec = self.target_layer[need.target], needs.specs[need.tensor]
            self.totals[layer] += need.numel
            self.nbytes[layer] += need.numel * spec.dtype.itemsize
            self.order[layer] = min(self.order[layer], need.tensor)  # checkpoint order: alike on every worker
            dtypes[need.target] = dtypes[need.target] or spec.dtype
        self.layer_targets: list[list[int]] = [[] for _ in range(count)]
        for t, layer in enumerate(self.target_layer):
            self.layer_targets[layer].append(t)
        fallback = next((d for d in dtypes if d is not None), torch.float32)
        self.dtypes = [d or fallback for d in dtypes]  # of a held target: its pieces' wire dtype
        self.fills: list[list[Any]] = [[] for _ in range(count)]
        for fill in needs.fills:
            self.fills[self.target_layer[fill.target]].append(fill)
        self.landing_layers = [layer for layer in range(count) if self.totals[layer]]
        """The layers a sync lands in (those with needs)."""

    @property
    def worker(self) -> int:
        return self.needs.worker

    def landing(self, links: Sequence[LinkSpecs], timeout_s: float) -> "Landing":
        """One sync's landing from `links` (per trainer rank, its link to this worker)."""
        while len(self.streams) < len(links):
            self.streams.append(self.backend.new_stream())
        return Landing(self, list(links), timeout_s)


class _PartSink:
    """The sink of one trainer rank's `Receiver`: its pieces go to the landing."""

    policy = SinkPolicy(in_place=False, apply_unchanged=True, destinations="none")

    def __init__(self, landing: "Landing", sender: int) -> None:
        self.landing, self.sender = landing, sender

    def destination(self, name: str) -> torch.Tensor | None:
        return None

    def apply(self, pairs: Pairs) -> None:
        self.landing.take(self.sender, pairs)

    def abort(self) -> None:
        self.landing.abort()  # the engine hears it once, from whichever part settles first


class Landing:
    """One sync's landing on one worker (made by `LandingSink.landing`, driven by
    `LinkReceiver`): receiving threads `take` pieces, the caller's thread `drain`s."""

    def __init__(self, sink: LandingSink, links: list[LinkSpecs], timeout_s: float) -> None:
        self.sink, self.links, self.timeout_s = sink, links, timeout_s
        self.engine, self.backend = sink.engine, sink.backend
        self.error: BaseException | None = None  # the first failure of the engine's side
        self.discard = False  # the sync failed: take pieces, keep none
        self.touched = False  # a layer was handed to the engine's close_layer
        self.closed: list[str] = []
        self.apply_s = 0.0  # in the engine's close_layer and finish: its processing of what landed
        self._cond = threading.Condition()
        self._open: dict[int, dict[int, torch.Tensor]] = {}  # layer -> target -> where it lands
        self._held: dict[int, dict[str, torch.Tensor]] = {}  # layer -> targets the sink holds
        self._asked: set[int] = set()  # layers open, or asked to be, and not closed
        self._to_open: list[int] = []
        self._ready: list[int] = []
        self._landed = [0] * len(sink.totals)
        self._open_bytes = 0
        self._last = [-1] * len(links)  # per sender, the order of the layer it last landed in
        self._running = set(range(len(links)))
        self._begun = self._aborted = False

    def part(self, sender: int) -> _PartSink:
        return _PartSink(self, sender)

    def use_links(self, links: Sequence[LinkSpecs]) -> None:
        """The links pieces arrive on, once the headers are agreed (read from them:
        hal.sync.plan.link_specs.links_from_headers), before any piece arrives."""
        if len(links) != len(self.links):
            raise ValueError(f"Landing: {len(links)} links for {len(self.links)} trainer ranks")
        self.links = list(links)

    # ---- the receiving threads --------------------------------------------------------
    def take(self, sender: int, pairs: Pairs) -> None:
        """A segment's pieces from `sender`'s link, into their regions (one multi-tensor copy)."""
        sink, link, needs = self.sink, self.links[sender], self.sink.needs
        dsts, srcs, counts = [], [], {}
        for name, data in pairs:
            piece = link.pieces[link.position(name)]
            need = needs.needs[piece.need]
            layer = sink.target_layer[need.target]
            regions = self._layer(sender, layer)
            if regions is None:  # the sync failed: keep nothing
                return
            base = regions[need.target]
            offset, shape, strides = need.destination(piece.offsets, piece.sizes)
            dsts.append(base.as_strided(shape, strides, base.storage_offset() + offset))
            srcs.append(data)
            counts[layer] = counts.get(layer, 0) + piece.numel
        if dsts:
            stream = self.sink.streams[sender]
            if self.backend.supports_async_streams:  # the receiver's views are ready on the current stream
                stream.wait_stream(self.backend.current_stream())
            self.backend.copy_many_(dsts, srcs, stream=stream)
            stream.synchronize()  # landed before it is counted; the views are reused after this
        with self._cond:
            for layer, n in counts.items():
                self._landed[layer] += n
                if self._landed[layer] == sink.totals[layer]:
                    self._ready.append(layer)
            self._cond.notify_all()

    def _layer(self, sender: int, layer: int) -> dict[int, torch.Tensor] | None:
        """Where `layer` lands, opened by the caller's thread if it is not yet (waiting, if
        this thread is ahead of another and the open layers fill the budget); None once
        the sync failed."""
        sink, order = self.sink, self.sink.order[layer]
        deadline, behind = time.monotonic() + self.timeout_s, []
        with self._cond:
            self._last[sender] = max(self._last[sender], order)
            while True:
                if self.discard:
                    return None
                regions = self._open.get(layer)
                if regions is not None:
                    return regions
                if layer not in self._asked:
                    behind = [s for s in self._running if s != sender and self._last[s] < order]
                    if self._open_bytes + sink.nbytes[layer] <= sink.budget_bytes or not behind or not self._asked:
                        self._asked.add(layer)
                        self._open_bytes += sink.nbytes[layer]
                        self._to_open.append(layer)
                        self._cond.notify_all()
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = "to be opened" if layer in self._asked else f"for trainer rank(s) {sorted(behind)} to catch up"
                    raise errors.PeerError(
                        f"landing layer {sink.layer_names[layer]!r}: waited {self.timeout_s} s {waiting} ({self._open_bytes} bytes of layers open)"
                    )
                self._cond.wait(timeout=left)

    def expect(self, senders: set[int]) -> None:
        """Only these senders' threads deliver (the others' groups left the sync at its header)."""
        with self._cond:
            self._running = set(senders)
            self._cond.notify_all()

    def sender_done(self, sender: int) -> None:
        with self._cond:
            self._running.discard(sender)
            self._cond.notify_all()

    # ---- the caller's thread ------------------------------------------------------------
    def begin(self) -> None:
        """Every rank agreed on the headers: the engine starts landing."""
        self._begun = True
        try:
            self.engine.begin()
        except Exception as exc:  # noqa: BLE001 - reported at the agreement
            self._failed(exc)

    def drain(self) -> None:
        """Open the layers the receiving threads ask for and close those that landed whole,
        until every receiving thread ended."""
        while True:
            with self._cond:
                while not self._to_open and not self._ready and self._running:
                    self._cond.wait(timeout=0.5)
                to_open, self._to_open = self._to_open, []
                ready, self._ready = self._ready, []
                if not to_open and not ready and not self._running:
                    return
            for layer in to_open:  # first: receiving threads wait for them
                regions = None if self.discard else self._open_layer(layer)
                with self._cond:
                    if regions is not None:
                        self._open[layer] = regions
                    self._cond.notify_all()
            for layer in ready:
                if not self.discard:
                    self._close_layer(layer)
                with self._cond:
                    self._open_bytes -= self.sink.nbytes[layer]
                    self._open.pop(layer, None)
                    self._asked.discard(layer)
                    self._cond.notify_all()

    def _open_layer(self, layer: int) -> dict[int, torch.Tensor] | None:
        sink = self.sink
        name, indices = sink.layer_names[layer], sink.layer_targets[layer]
        targets = [sink.needs.targets[t] for t in indices]
        try:
            given = list(self.engine.open_layer(name, targets))
            if len(given) != len(targets):
                raise ValueError(f"layer {name!r}: the engine gave {len(given)} tensors for its {len(targets)} targets")
            regions, held = {}, {}
            for t, target, tensor in zip(indices, targets, given):
                if tensor is None:
                    tensor = held[target.name] = self.backend.empty(target.shape, sink.dtypes[t])
                elif tuple(tensor.shape) != target.shape or not tensor.is_contiguous():
                    raise ValueError(
                        f"parameter {target.describe()!r}: the engine opened a tensor of shape {tuple(tensor.shape)} "
                        f"(contiguous: {tensor.is_contiguous()}) to land in; its recorded shape is {target.shape}, contiguous"
                    )
                if target.padding:
                    tensor.zero_()  # what no loader writes (a padded vocabulary's rows)
                regions[t] = tensor
            self._held[layer] = held
            return regions
        except Exception as exc:  # noqa: BLE001 - reported at the agreement
            self._failed(exc)
            return None

    def _close_layer(self, layer: int) -> None:
        regions = self._open.get(layer)
        if regions is None:
            return
        name = self.sink.layer_names[layer]
        try:
            for fill in self.sink.fills[layer]:
                base = regions[fill.target]
                base.as_strided(fill.shape, fill.stride, base.storage_offset() + fill.offset).fill_(fill.value)
            self.touched = True  # the engine's weights change from here on
            start = time.perf_counter()
            self.engine.close_layer(name, self._held.pop(layer, {}))
            self.apply_s += time.perf_counter() - start
            self.closed.append(name)
        except Exception as exc:  # noqa: BLE001 - reported at the agreement
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        with self._cond:
            if self.error is None:
                self.error = exc
            self.discard = True
            self._cond.notify_all()

    def stop(self) -> None:
        """The sync failed: take what still arrives and keep none of it."""
        with self._cond:
            self.discard = True
            self._cond.notify_all()

    def leftover(self) -> list[str]:
        """Layers this sync lands in that did not close (after every thread ended)."""
        closed = set(self.closed)
        return [self.sink.layer_names[layer] for layer in self.sink.landing_layers if self.sink.layer_names[layer] not in closed]

    def finish(self) -> None:
        """Every layer closed and nothing failed here: the engine ends the landing."""
        start = time.perf_counter()
        self.engine.finish()
        self.apply_s += time.perf_counter() - start

    def abort(self) -> None:
        """The sync failed: the engine puts back what did not close, once (if it began)."""
        if self._begun and not self._aborted:
            self._aborted = True
            self.engine.abort()
