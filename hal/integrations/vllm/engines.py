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

import sys
from typing import Any, Protocol, runtime_checkable

from hal.integrations.vllm.engine_clients import ClientEngine, VLLMWeightSyncClient, WHAT_TO_PASS
from hal.integrations.vllm.engine_local import ExtensionEngine, OfflineEngine


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


# ---- what a sync accepts --------------------------------------------------------------------
def as_engine(engine_or_client: Any, *, num_workers: int = 1) -> Engine:
    """`engine_or_client` as the `Engine` a sync drives: an engine as it is, a vLLM weight-sync
    client as `ClientEngine(client, num_workers=num_workers)`. TypeError naming what to pass
    for anything else (a URL, a bare `LLM`, a Ray actor handle, ...)."""
    if isinstance(engine_or_client, (ClientEngine, OfflineEngine, ExtensionEngine)):
        return engine_or_client
    hint = _misuse(engine_or_client)
    if hint is not None:
        raise TypeError(f"{hint}; {WHAT_TO_PASS}")
    if isinstance(engine_or_client, Engine):
        return engine_or_client
    if isinstance(engine_or_client, VLLMWeightSyncClient):
        return ClientEngine(engine_or_client, num_workers=num_workers)
    # something with an engine's name or size is an incomplete engine, else an incomplete client
    members = _ENGINE_MEMBERS if hasattr(engine_or_client, "name") or hasattr(engine_or_client, "num_workers") else _CLIENT_METHODS
    missing = [m for m in members if not hasattr(engine_or_client, m)]
    raise TypeError(
        f"{type(engine_or_client).__name__} is neither a hal Engine nor a vLLM weight-sync client "
        f"(it has no {', '.join(missing)}); {WHAT_TO_PASS}"
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
