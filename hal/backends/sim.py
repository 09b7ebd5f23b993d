"""The simulated accelerator: CPU memory, but streams that really run asynchronously.

Each stream owns a worker thread that runs the work launched on it in order,
sleeping `latency` seconds before each operation. Events are recorded by the
stream when it reaches them, and `wait_event` holds a stream until the event
completes. So code that reads a tensor written by device work without waiting
for the event reads the old bytes, as it would on a GPU, and a test sees it.

Host code (plain torch calls) is not ordered against streams, exactly as on CUDA:
only `Backend.launch` / `copy_` go through a stream.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any, Callable

from hal import env
from hal.backends.cpu import CpuBackend, elapsed_ms


class SimEvent:
    """An event that completes when the stream it was recorded on reaches it."""

    def __init__(self, timing: bool = False, current_stream: Callable[[], "SimStream"] | None = None) -> None:
        self.timing = timing
        self._current_stream = current_stream
        self.recorded_at: float | None = None
        """When the stream reached this event (`time.perf_counter()`), None before."""
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._done.set()  # like CUDA: an event never recorded counts as complete

    def record(self, stream: "SimStream | None" = None) -> None:
        stream = stream or self._default_stream()
        self._done = done = threading.Event()
        self._error = None
        stream._put(self._complete, (done, stream))

    def _complete(self, done: threading.Event, stream: "SimStream") -> None:
        # Work before this event failed: report it through the event, as cudaEventSynchronize
        # returns an earlier kernel's error (taken off the stream: reported once).
        self._error = stream._take_error()
        self.recorded_at = time.perf_counter()
        done.set()

    def wait(self, stream: "SimStream | None" = None) -> None:
        (stream or self._default_stream()).wait_event(self)

    def _default_stream(self) -> "SimStream":
        if self._current_stream is None:
            raise RuntimeError("SimEvent created outside a backend: pass the stream explicitly")
        return self._current_stream()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"work on simulated stream failed before this event: {error!r}") from error

    def elapsed_time(self, end_event: "SimEvent") -> float:
        self.synchronize()
        end_event.synchronize()
        return elapsed_ms(self, end_event)


# Streams with queued work or an unreported error. As on CUDA, dropping the last handle
# to a stream must neither cancel its work nor lose its error; a module-level set (not a
# self-reference, which the cycle collector would free) keeps such streams alive.
_RETAINED: "set[SimStream]" = set()


class SimStream:
    """A FIFO of device work run by one daemon thread."""

    def __init__(
        self, latency: float = 0.0, name: str = "sim-stream", current_stream: Callable[[], "SimStream"] | None = None
    ) -> None:
        self.latency = latency
        # The backend's current-stream lookup, so events from record_event() can wait() on it.
        self._current_stream = current_stream
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._error: BaseException | None = None
        # The thread holds only a weak reference, so an idle, unused stream can be collected.
        self._thread = threading.Thread(target=_run_stream, args=(weakref.ref(self), self._queue), name=name, daemon=True)
        self._thread.start()

    def __del__(self) -> None:
        self._queue.put(None)

    def _put(self, fn: Callable[..., Any], args: tuple, *, delayed: bool = False) -> None:
        with self._idle:
            self._pending += 1
            _RETAINED.add(self)
        self._queue.put((fn, args, delayed))

    def _task_done(self) -> None:
        with self._idle:
            self._pending -= 1
            if self._pending == 0:
                if self._error is None:
                    _RETAINED.discard(self)
                self._idle.notify_all()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on this stream after everything already queued (with latency)."""
        self._put(fn, args, delayed=True)

    def wait_event(self, event: SimEvent) -> None:
        done = event._done  # the recording in force now, as CUDA captures it at the call
        self._put(done.wait, ())

    def wait_stream(self, stream: "SimStream") -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = event or SimEvent(current_stream=self._current_stream)
        event.record(self)
        return event

    def synchronize(self) -> None:
        with self._idle:
            while self._pending:
                self._idle.wait()
        self._raise_pending_error()

    def query(self) -> bool:
        with self._idle:
            return self._pending == 0

    def _work_failed(self, error: BaseException) -> None:
        """Work on this stream raised `error` (by the stream's thread): kept for the host."""
        self._error = error

    def _take_error(self) -> BaseException | None:
        """The error of work queued so far, taken off the stream (reported once)."""
        with self._idle:
            error, self._error = self._error, None
        return error

    def _raise_pending_error(self) -> None:
        with self._idle:
            error, self._error = self._error, None
            if error is not None and self._pending == 0:
                _RETAINED.discard(self)
        if error is not None:
            raise RuntimeError(f"work on simulated stream failed: {error!r}") from error


def _run_stream(stream_ref: "weakref.ref[SimStream]", work: queue.SimpleQueue) -> None:
    while True:
        item = work.get()
        if item is None:
            return
        fn, args, delayed = item
        stream = stream_ref()
        if stream is None:
            return
        try:
            if delayed and stream.latency:
                time.sleep(stream.latency)
            fn(*args)
        except BaseException as exc:  # kept and re-raised on the host at the next synchronize
            stream._work_failed(exc)
        finally:
            stream._task_done()
            # drop the finished work's arguments now: waiting for the next item must not
            # keep its tensors alive
            del stream, item, fn, args


class SimBackend(CpuBackend):
    """CPU memory with asynchronous streams; the test bed for stream/event discipline."""

    name = "sim"
    supports_async_streams = True

    def __init__(self, latency: float | None = None) -> None:
        self.latency = env.sim_latency_seconds() if latency is None else float(latency)
        if self.latency < 0:
            raise ValueError(f"sim backend: latency must not be negative, got {self.latency}")
        self._streams: "weakref.WeakSet[SimStream]" = weakref.WeakSet()
        super().__init__()

    def _make_default_stream(self) -> SimStream:
        return self._new_stream()

    def _new_stream(self) -> SimStream:
        stream = SimStream(self.latency, current_stream=self._current_stream)
        self._streams.add(stream)
        return stream

    def _new_event(self, timing: bool) -> SimEvent:
        return SimEvent(timing, self._current_stream)

    def _launch(self, stream: Any, fn: Callable[..., Any], args: tuple) -> None:
        if stream is None:
            stream = self._current_stream()
        if not isinstance(stream, SimStream):
            raise TypeError(f"backend 'sim': expected a stream from this backend, got {type(stream).__name__}")
        stream.submit(fn, *args)

    def _synchronize(self) -> None:
        for stream in list(self._streams):
            stream.synchronize()
