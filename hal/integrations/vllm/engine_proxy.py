"""An engine reached from other processes of this machine: its calls served on a loopback
port, and the `Engine` those processes drive it through.

    # the process that holds the engine (an offline `LLM`, say)
    with serve_engine(OfflineEngine(llm), extra={"greedy": lambda: ...}) as address:
        spawn_ranks(trainer_rank, 2, args=(address,), ...)

    # trainer rank 0: every call goes to that process; the other ranks hold a proxy with
    # no address (`WeightSync(senders="all")` counts the workers on every rank, and only
    # rank 0 may call the engine)
    engine = RemoteEngine(address if rank == 0 else None, name="llm", num_workers=2)
    WeightSync([engine], trainer_group=group, senders="all")

One JSON request per connection (`{"m": name, "a": [args]}` and one line back:
`{"result": ...}` or `{"error": "Type: text"}`), one call at a time, as `WeightSync` makes
them. The server listens on 127.0.0.1 only (what it serves is for this machine's processes:
the engine's own token still guards its init), reads a request within `timeout_s` and at
most `MAX_REQUEST_BYTES`, and stops when its block ends, whatever calls are open: its
threads are daemons, and a connection's wait for a call is bounded too (`RemoteEngine`'s
`timeout_s`). `hal bench --engine vllm --senders M` and the test suite's multi-rank engine
tests use it.
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import threading
from typing import Any, Callable, Iterator

from hal.integrations.vllm.engines import Engine

# The `Engine` protocol's calls, read from it (one list), which `serve_engine` serves of the
# engine it is given.
ENGINE_CALLS = tuple(name for name, value in vars(Engine).items() if callable(value) and not name.startswith("_"))
MAX_REQUEST_BYTES = 1 << 20  # a request is a call's name and its JSON arguments: init info, update info
HOST = "127.0.0.1"


@contextlib.contextmanager
def serve_calls(calls: dict[str, Callable[..., Any]], *, timeout_s: float = 30.0) -> Iterator[tuple[str, int]]:
    """Serve `calls` (name -> callable) on a loopback port for the block: yields (host, port).
    A request for a name not in `calls` is answered with an error naming the ones served."""
    lock = threading.Lock()
    served = sorted(calls)

    class Handler(socketserver.StreamRequestHandler):
        def setup(self) -> None:
            self.request.settimeout(timeout_s)  # a client that connects and says nothing holds no thread for long
            super().setup()

        def handle(self) -> None:
            try:
                line = self.rfile.readline(MAX_REQUEST_BYTES + 1)
                if len(line) > MAX_REQUEST_BYTES:
                    raise ValueError(f"a request of over {MAX_REQUEST_BYTES} bytes")
                request = json.loads(line)
                name, args = request["m"], request["a"]
                if name not in calls:
                    raise KeyError(f"the engine serves no call {name!r} (served: {', '.join(served)})")
                with lock:
                    reply = {"result": calls[name](*args)}
            except Exception as exc:  # noqa: BLE001 - the caller raises it
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            with contextlib.suppress(OSError):  # a caller that gave up: nobody to tell
                self.wfile.write(json.dumps(reply).encode() + b"\n")

    server = socketserver.ThreadingTCPServer((HOST, 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="engine calls", daemon=True)
    thread.start()
    try:
        yield server.server_address[:2]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@contextlib.contextmanager
def serve_engine(engine: Any, *, extra: dict[str, Callable[..., Any]] | None = None, timeout_s: float = 30.0) -> Iterator[tuple[str, int]]:
    """Serve `engine`'s `Engine` calls, and the `extra` named calls beside them, on a
    loopback port for the block (`serve_calls`): what a `RemoteEngine` calls."""
    calls = {name: getattr(engine, name) for name in ENGINE_CALLS}
    clash = sorted(set(extra or {}) & set(calls))
    if clash:
        raise ValueError(f"extra calls {clash} would replace the engine's own")
    with serve_calls({**calls, **(extra or {})}, timeout_s=timeout_s) as address:
        yield address


class RemoteEngine:
    """The `Engine` of a process that holds it (`serve_engine`): each call goes there, on a
    connection of its own, and waits at most `timeout_s` for its answer (a sync's calls end
    within the sync's own timeout). With no `address` it only names and counts the engine
    (a trainer rank other than 0): a call then raises, naming it."""

    same_node = False  # its buckets travel over the group's links: the process that holds it is not this one

    def __init__(self, address: tuple[str, int] | list[Any] | None, *, name: str = "tp2", num_workers: int = 2, timeout_s: float = 300.0) -> None:
        self.address = None if address is None else (str(address[0]), int(address[1]))
        self.name, self.num_workers, self.timeout_s = name, num_workers, timeout_s

    def call(self, method: str, *args: Any) -> Any:
        if self.address is None:
            raise RuntimeError(f"engine {self.name!r}: {method} called on a trainer rank that holds no address (only rank 0 drives the engine)")
        with socket.create_connection(self.address, timeout=self.timeout_s) as conn:
            conn.sendall(json.dumps({"m": method, "a": list(args)}).encode() + b"\n")
            line = conn.makefile("rb").readline()
        if not line:
            raise ConnectionError(f"engine {self.name!r}: {method}: the serving process closed the connection without an answer")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["result"]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self.call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish_weight_update", weight_version)

    def update_weight_version(self, weight_version: str) -> None:
        self.call("update_weight_version", weight_version)

    def get_weight_version(self) -> str:
        return self.call("get_weight_version")

    def reset_prefix_cache(self) -> None:
        self.call("reset_prefix_cache")

    def shutdown_weight_transfer_engine(self) -> None:
        self.call("shutdown_weight_transfer_engine")

    def prompt_logprobs(self, prompts: list[list[int]]) -> list[list[float]]:
        """The canary's probe (hal.integrations.vllm.canary), where the serving process serves
        a `prompt_logprobs` call."""
        return self.call("prompt_logprobs", prompts)
