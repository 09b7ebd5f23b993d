"""A vLLM engine behind one of vLLM's own weight-sync clients (an HTTP server's routes, a
Ray actor's methods), completed with what `WeightSync` needs of it (`ClientEngine`).
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from typing import Any

from hal.integrations.vllm import internals as vllm_internals

logger = logging.getLogger(__name__)

# vLLM's trainer-side clients (0.26 on); before, the same protocol of four methods (a client of
# one's own still counts) and, for the HTTP and Ray clients, classes nothing is an instance of.
VLLMWeightSyncClient, HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient = vllm_internals.weight_sync_clients()

# What to pass instead, named in the error for an object that is neither an engine nor a client.
WHAT_TO_PASS = (
    "pass vLLM's HTTPVLLMWeightSyncClient(base_url) for a `vllm serve`, RayVLLMWeightSyncClient(actor) for an "
    "LLM in a Ray actor (vllm.distributed.weight_transfer.clients), OfflineEngine(llm) for an LLM in this "
    "process, or ClientEngine(client, num_workers=...) for any client with vLLM's four weight-sync methods"
)


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
            raise TypeError(f"ClientEngine: {type(client).__name__} is not a vLLM weight-sync client; {WHAT_TO_PASS}")
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
        self._update_version = method_of(self.extras, "update_weight_version")
        self._get_version = method_of(self.extras, "get_weight_version")
        self._reset_prefix_cache = method_of(self.extras, "reset_prefix_cache")
        self._shutdown = method_of(client, "shutdown_weight_transfer_engine")
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
        reset = method_of(inner, "reset_prefix_cache")
        if reset is not None:
            self.reset_prefix_cache = reset

    def update_weight_version(self, weight_version: str) -> None:
        self.version = weight_version

    def get_weight_version(self) -> str:
        return self.version


def method_of(obj: Any, name: str) -> Any:
    method = getattr(obj, name, None)
    return method if callable(method) else None
