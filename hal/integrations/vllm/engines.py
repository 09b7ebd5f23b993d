"""The engines `WeightSync` drives: vLLM's own weight-sync clients, and hal's adapters where vLLM has none.

    WeightSync([HTTPVLLMWeightSyncClient("http://10.0.0.7:8000")])       # a `vllm serve`
    WeightSync([RayVLLMWeightSyncClient(llm_actor)])                      # an `LLM` in a Ray actor
    WeightSync([OfflineEngine(llm)])                                      # an `LLM` in this process
    WeightSync([ClientEngine(client, num_workers=2, name="tp2")])         # a client, with its size

vLLM ships the trainer's side of its weight-update API as clients with four methods
(`VLLMWeightSyncClient`: init, start, update, finish). A sync needs three things more:
reading the engine's weight version back, setting it without an update (an engine left
holding part of a failed sync reports `inconsistent:<version>`), and resetting the prefix
cache (KV computed with the old weights must not be served). `ClientEngine` adds them:
for vLLM's HTTP client through the same server's routes, for its Ray client through the
same actors' methods, for any other client through its own methods where it has them.

hal's own adapters remain only where vLLM has no client: `OfflineEngine` (an offline
`vllm.LLM` in this process) and `ExtensionEngine` (the same, through hal's worker
extension, for vLLM builds without the native API).
"""

from __future__ import annotations

import json
import logging
import sys
import urllib.error
import urllib.request
import weakref
from typing import Any, Protocol, runtime_checkable

from hal.integrations.vllm import internals as vllm_internals

# vLLM's trainer-side clients (0.26 on); before, the same protocol of four methods (a client of
# one's own still counts) and, for the HTTP and Ray clients, classes nothing is an instance of.
VLLMWeightSyncClient, HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient = vllm_internals.weight_sync_clients()

logger = logging.getLogger(__name__)

# What to pass instead, named in the error for an object that is neither an engine nor a client.
_WHAT_TO_PASS = (
    "pass vLLM's HTTPVLLMWeightSyncClient(base_url) for a `vllm serve`, RayVLLMWeightSyncClient(actor) for an "
    "LLM in a Ray actor (vllm.distributed.weight_transfer.clients), OfflineEngine(llm) for an LLM in this "
    "process, or ClientEngine(client, num_workers=...) for any client with vLLM's four weight-sync methods"
)


@runtime_checkable
class Engine(Protocol):
    """One vLLM engine as `WeightSync` drives it (`ClientEngine`, `OfflineEngine`, `ExtensionEngine`, or your own)."""

    name: str
    """Unique among the engines of one `WeightSync`; names the engine in errors and results."""
    num_workers: int
    """Its workers, each a rank of the sync group (tensor x pipeline x data parallel size)."""
    same_node: bool
    """Its workers run on the trainer's machine (the shared-memory transport is possible)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...
    def start_weight_update(self) -> None: ...
    def update_weights(self, update_info: dict[str, Any]) -> None: ...
    def finish_weight_update(self, weight_version: str | None = None) -> None: ...
    def update_weight_version(self, weight_version: str) -> None: ...
    def get_weight_version(self) -> str: ...
    def reset_prefix_cache(self) -> None: ...
    def shutdown_weight_transfer_engine(self) -> None: ...


# ---- vLLM's clients, completed --------------------------------------------------------------
class ServerRoutes:
    """What a sync needs of a `vllm serve` beyond `HTTPVLLMWeightSyncClient`, through the server's
    own routes (served with `VLLM_SERVER_DEV_MODE=1`): POST /update_weight_version and
    /reset_prefix_cache, GET /weight_info."""

    def __init__(self, base_url: str, *, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(
            f"{self.base_url}/{path}", data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise RuntimeError(f"vLLM server {self.base_url}: {method} /{path} returned {exc.code}: {detail}") from exc
        except urllib.error.URLError as exc:
            raise RuntimeError(f"vLLM server {self.base_url}: {method} /{path} failed: {exc.reason}") from exc
        return json.loads(body) if body else None

    def update_weight_version(self, weight_version: str) -> None:
        self._request("POST", "update_weight_version", {"new_version": weight_version})

    def get_weight_version(self) -> str:
        return self._request("GET", "weight_info")["weight_version"]

    def reset_prefix_cache(self) -> None:
        self._request("POST", "reset_prefix_cache")


class ActorMethods:
    """What a sync needs of an `LLM` Ray actor beyond `RayVLLMWeightSyncClient`: the actor's own
    `update_weight_version`, `get_weight_version` and `reset_prefix_cache` (an `LLM`'s methods)."""

    def __init__(self, actor: Any, *, timeout_s: float) -> None:
        self.actor = actor
        self.timeout_s = timeout_s

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args), timeout=self.timeout_s)

    def update_weight_version(self, weight_version: str) -> None:
        self._call("update_weight_version", weight_version)

    def get_weight_version(self) -> str:
        return str(self._call("get_weight_version"))

    def reset_prefix_cache(self) -> None:
        self._call("reset_prefix_cache")


class ClientEngine:
    """A vLLM `VLLMWeightSyncClient` as the `Engine` a sync drives.

    The four weight-update calls go to `client` as they are. Version read-back, version
    setting and the prefix-cache reset go, for `HTTPVLLMWeightSyncClient`, to the same
    server's routes (`ServerRoutes`); for `RayVLLMWeightSyncClient`, to the same actor
    (`ActorMethods`); for any other client, to its own methods of those names, where it has
    them (without `get_weight_version` the version reads ""; without `reset_prefix_cache`
    nothing is reset, which is logged once).

    `num_workers`: the engine's tensor x pipeline x data parallel size (vLLM's clients do not
    say). `name` (default: the server's URL for an HTTP client, the client's class name
    otherwise) must be unique among the engines of one `WeightSync`. `same_node`: the
    engine's workers run on the trainer's machine. `timeout_s` bounds each added call.
    `extras` is what answers the three additions (`ServerRoutes`, `ActorMethods`, the client).
    """

    def __init__(
        self, client: Any, *, num_workers: int = 1, name: str | None = None, same_node: bool = False, timeout_s: float | None = None
    ) -> None:
        if not isinstance(client, VLLMWeightSyncClient):
            raise TypeError(f"ClientEngine: {type(client).__name__} is not a vLLM weight-sync client; {_WHAT_TO_PASS}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"ClientEngine.num_workers must be an int >= 1, got {num_workers!r}")
        self.client = client
        self.num_workers = num_workers
        self.same_node = same_node
        if isinstance(client, HTTPVLLMWeightSyncClient):
            self.name = name or client.base_url
            self.extras: Any = ServerRoutes(client.base_url, timeout_s=float(timeout_s or client.timeout))
        elif isinstance(client, RayVLLMWeightSyncClient):
            if len(client.handles) != 1:
                # one init request for every actor would give each the same group ranks
                raise ValueError(
                    f"ClientEngine: this RayVLLMWeightSyncClient drives {len(client.handles)} actors with one init "
                    "request, so their workers would take the same ranks of the sync group; pass one client per actor: "
                    "[ClientEngine(RayVLLMWeightSyncClient(actor), name=...) for actor in actors]"
                )
            self.name = name or type(client).__name__
            self.extras = ActorMethods(client.handles[0], timeout_s=float(timeout_s or 300.0))
        else:
            self.name = name or type(client).__name__
            self.extras = client
        if not vllm_internals.keeps_weight_versions():  # vLLM 0.26: no version to set or read
            self.extras = RecordedVersion(self.extras)
        # resolved once: a client of vLLM's protocol alone may lack any of them
        self._update_version = _method(self.extras, "update_weight_version")
        self._get_version = _method(self.extras, "get_weight_version")
        self._reset_prefix_cache = _method(self.extras, "reset_prefix_cache")
        self._shutdown = _method(client, "shutdown_weight_transfer_engine")
        if self._reset_prefix_cache is None:
            logger.warning(
                "engine %s: %s has no reset_prefix_cache(); after a sync the engine may reuse KV cached with the old weights",
                self.name, type(client).__name__,
            )

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if vllm_internals.keeps_weight_versions():
            self.client.finish_weight_update(weight_version)
            return
        self.client.finish_weight_update()  # vLLM 0.26's takes no version: hal keeps it
        if weight_version is not None:
            self.update_weight_version(weight_version)

    def update_weight_version(self, weight_version: str) -> None:
        if self._update_version is not None:
            self._update_version(weight_version)

    def get_weight_version(self) -> str:
        return self._get_version() if self._get_version is not None else ""

    def reset_prefix_cache(self) -> None:
        if self._reset_prefix_cache is not None:
            self._reset_prefix_cache()

    def shutdown_weight_transfer_engine(self) -> None:
        if self._shutdown is not None:  # not one of the protocol's four (vLLM's own clients have it)
            self._shutdown()


class RecordedVersion:
    """Where vLLM keeps no weight version (before 0.27): the version the trainer's syncs
    established on an engine, kept on the trainer's side. `WeightSync` sets it after a sync
    every worker agreed had completed (hal's final status agreement), or to
    `inconsistent:<last version>` after one that left some worker holding part of it; each
    worker's hal engine keeps its own (`HalWorkerExtension.hal_state`). The prefix-cache reset
    goes to `inner` where it has one."""

    def __init__(self, inner: Any = None) -> None:
        self.version = ""
        reset = _method(inner, "reset_prefix_cache")
        if reset is not None:
            self.reset_prefix_cache = reset

    def update_weight_version(self, weight_version: str) -> None:
        self.version = weight_version

    def get_weight_version(self) -> str:
        return self.version


# The versions `OfflineEngine` kept for each offline LLM, where vLLM keeps none (before 0.27):
# shared by every adapter of one LLM, gone with it.
_LLM_VERSIONS: "weakref.WeakKeyDictionary[Any, RecordedVersion]" = weakref.WeakKeyDictionary()


def weight_version(llm: Any) -> str:
    """The weight version an offline `LLM` serves: vLLM's own (`llm.get_weight_version()`,
    0.27 on); before, the one hal's syncs established on it (`RecordedVersion`; "" before
    the first)."""
    if vllm_internals.keeps_weight_versions():
        return llm.get_weight_version()
    recorded = _LLM_VERSIONS.get(llm)
    return "" if recorded is None else recorded.get_weight_version()


def _method(obj: Any, name: str) -> Any:
    method = getattr(obj, name, None)
    return method if callable(method) else None


# ---- hal's adapters, where vLLM has no client -----------------------------------------------
class OfflineEngine:
    """An offline `vllm.LLM` in this process (its workers may run in child processes)."""

    same_node = True  # its workers run on this machine, so buckets can be shared in memory

    def __init__(self, llm: Any, *, name: str = "llm", num_workers: int | None = None) -> None:
        self.llm = llm
        self.name = name
        self._update_open = False
        if num_workers is None:
            pc = llm.llm_engine.vllm_config.parallel_config
            num_workers = pc.world_size * max(1, getattr(pc, "data_parallel_size_local", 1) or 1)
        self.num_workers = num_workers

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        if self._update_open:
            self._end_failed_update()
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            self.llm.update_weights({"update_info": update_info})
        except BaseException:
            # vLLM 0.23-0.24: the worker owns the update; vLLM's own workers end a failed one,
            # vllm-ascend 0.23's NPUWorker keeps it open until finish_weight_update
            self._update_open = not vllm_internals.worker_closes_failed_updates(self.llm)
            raise

    def _end_failed_update(self) -> None:
        """Close an update whose `update_weights` failed before the next one starts (hal's engine
        already put every layer back). Not for vLLM's own workers, which closed it themselves
        and would refuse (with an error and a traceback in the engine's log)."""
        self._update_open = False
        try:
            self.llm.finish_weight_update()
        except Exception as exc:  # noqa: BLE001 - a worker of another platform that closed it after all
            logger.debug("engine %s: closing the failed update: %s", self.name, exc)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if vllm_internals.keeps_weight_versions():
            self.llm.finish_weight_update(weight_version)
            return
        self.llm.finish_weight_update()  # vLLM 0.23-0.26: no version; hal keeps it (RecordedVersion)
        if weight_version is not None:
            self.update_weight_version(weight_version)

    def update_weight_version(self, weight_version: str) -> None:
        if vllm_internals.keeps_weight_versions():
            self.llm.update_weight_version(weight_version)
        else:
            _LLM_VERSIONS.setdefault(self.llm, RecordedVersion()).update_weight_version(weight_version)

    def get_weight_version(self) -> str:
        return weight_version(self.llm)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def shutdown_weight_transfer_engine(self) -> None:
        if vllm_internals.engines_can_be_shut_down():  # vLLM 0.29-0.31 have no such call: the engine stays until exit
            self.llm.shutdown_weight_transfer_engine()


class ExtensionEngine:
    """An offline `LLM` started with `worker_extension_cls="hal.integrations.vllm.HalWorkerExtension"`.

    For vLLM builds without the native weight-transfer API: the same engine and transport,
    reached through `collective_rpc`. The version is tracked by the hal receiver on each
    worker (and mirrored into vLLM's weight version where that API exists).
    """

    same_node = True

    def __init__(self, llm: Any, *, name: str = "llm-ext", num_workers: int | None = None) -> None:
        self.llm = llm
        self.name = name
        self.num_workers = OfflineEngine(llm).num_workers if num_workers is None else num_workers

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("hal_init", kwargs={"init_info": init_info})

    def start_weight_update(self) -> None:
        pass  # hal_update starts and finishes the layerwise reload itself

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("hal_update", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is not None:
            self.update_weight_version(weight_version)

    def update_weight_version(self, weight_version: str) -> None:
        setter = getattr(self.llm, "update_weight_version", None)  # absent in the builds this engine is for
        if callable(setter):
            setter(weight_version)

    def get_weight_version(self) -> str:
        versions = set(self.llm.collective_rpc("hal_version"))
        if len(versions) != 1:
            raise RuntimeError(f"engine {self.name}: workers hold different weight versions {sorted(map(str, versions))}")
        (version,) = versions
        return "" if version is None else str(version)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.collective_rpc("hal_shutdown")


# ---- what a sync accepts --------------------------------------------------------------------
def as_engine(engine_or_client: Any, *, num_workers: int = 1) -> Engine:
    """`engine_or_client` as the `Engine` a sync drives: an engine as it is, a vLLM weight-sync
    client as `ClientEngine(client, num_workers=num_workers)`. TypeError naming what to pass
    for anything else (a URL, a bare `LLM`, a Ray actor handle, ...)."""
    if isinstance(engine_or_client, (ClientEngine, OfflineEngine, ExtensionEngine)):
        return engine_or_client
    hint = _misuse(engine_or_client)
    if hint is not None:
        raise TypeError(f"{hint}; {_WHAT_TO_PASS}")
    if isinstance(engine_or_client, Engine):
        return engine_or_client
    if isinstance(engine_or_client, VLLMWeightSyncClient):
        return ClientEngine(engine_or_client, num_workers=num_workers)
    # something with an engine's name or size is an incomplete engine, else an incomplete client
    members = _ENGINE_MEMBERS if hasattr(engine_or_client, "name") or hasattr(engine_or_client, "num_workers") else _CLIENT_METHODS
    missing = [m for m in members if not hasattr(engine_or_client, m)]
    raise TypeError(
        f"{type(engine_or_client).__name__} is neither a hal Engine nor a vLLM weight-sync client "
        f"(it has no {', '.join(missing)}); {_WHAT_TO_PASS}"
    )


_CLIENT_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")
_ENGINE_MEMBERS = (
    "name", "num_workers", "same_node", *_CLIENT_METHODS, "update_weight_version", "get_weight_version",
    "reset_prefix_cache", "shutdown_weight_transfer_engine",
)


def _misuse(obj: Any) -> str | None:
    """What an object that looks like an engine, but is not one a sync can drive, is."""
    if isinstance(obj, str):
        return f"got the string {obj!r}: a server is reached through a client, HTTPVLLMWeightSyncClient({obj!r})"
    ray = sys.modules.get("ray")
    if ray is not None and isinstance(obj, ray.actor.ActorHandle):
        return "got a Ray actor handle: wrap it, RayVLLMWeightSyncClient(handle)"
    vllm = sys.modules.get("vllm.entrypoints.llm")
    if vllm is not None and isinstance(obj, vllm.LLM):
        # an LLM has the four methods, but takes {"init_info": ...} where a client takes the info
        return "got a vllm.LLM: wrap it, OfflineEngine(llm)"
    return None
