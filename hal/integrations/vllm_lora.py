"""LoRA-only weight sync into a live vLLM engine: `WeightTransferConfig(backend="hal-lora")`.

The engine keeps its base weights; a sync sends the adapter's tensors through hal and the
engine serves the new adapter under one fixed LoRA id:

    from hal.integrations import vllm_lora
    vllm_lora.register()      # in every process that builds the engine (see "Registration")
    llm = LLM(model=base_dir, enable_lora=True, max_lora_rank=r,
              weight_transfer_config=WeightTransferConfig(backend="hal-lora"))
    sync = vllm_lora.LoraWeightSync([OfflineEngine(llm)], adapter_config(peft_model),
                                    sleep_level=1, free_cache_engine=True)
    sync.init()
    result = sync.sync(peft_model, version=step)   # result.decision.parts: ("base", "adapter") first,
                                                   # then ("adapter",) while the engine keeps its base
    llm.generate(prompts, params, lora_request=sync.lora_request())
    sync.engine_lost_weights()                     # when the engine reports it freed its weights

What travels is decided by `hal.sync.lora.decide_lora_sync` (through `BaseWeightTracker`):
base and adapter on the first sync and after the engine lost its weights (sleep level 2
with `free_cache_engine`), the adapter alone otherwise.

Worker side (`HalLoraWeightTransferEngine`, a subclass of the "hal" engine): the receiver
accepts the engine's checkpoint specs plus the adapter specs computed from the engine's
own base shapes and the adapter config (`hal.sync.lora.adapter_specs`), never from the
trainer's model, and refuses a sync that carries only part of the adapter before anything
is applied. Base tensors go through the "hal" engine's layerwise reload. Adapter tensors
are copied out of the receive buckets and built into a vLLM `LoRAModel`
(`LoRAModel.from_lora_tensors` with a `PEFTHelper` from the adapter config, checked
against the engine's LoRA config) while the sync is in progress, so an adapter vLLM would
refuse fails the sync on every rank.

How the engine then serves it follows from vLLM 0.32 itself: when a weight update
finishes, the worker drops every loaded adapter (`finish_weight_update` calls
`reset_lora_state`: adapters are treated as invalid once the base changed), and a request
naming an adapter that is not loaded makes the worker load it from the request's path.
So after a completed sync each worker publishes the adapter in peft's layout
(`adapter_model.safetensors`, `adapter_config.json`, each file replaced atomically) in
`adapter_dir`, a directory on the engine's node, and `LoRARequest(lora_name, lora_int_id,
adapter_dir)` makes the next request load it with vLLM's own loader and checks. A
refused sync publishes nothing: the engine keeps serving the previous adapter. The
adapter bytes cross the trainer->engine link once through hal; the directory is the
engine-local hand-over (on a tmpfs such as /dev/shm, a memory copy).

Compare verl, which ships the tensors inside a `LoRARequest` subclass through a remote
call and patches the worker's `_load_adapter`; here the tensors come through hal's
receiver (any transport, any backend) and nothing in vLLM is patched.

Registration: an installed verl-hal declares the `vllm.general_plugins` entry point
`hal_lora_weight_transfer = "hal.integrations.vllm_lora:register"` (pyproject.toml), and
vLLM runs general plugins in every process it starts (API server, engine core, workers),
so every process knows "hal-lora" without user code. Importing this module also registers
it (`register()`, idempotent; an import-time side effect on purpose, for a checkout that is
not installed). `worker_extension_cls="hal.integrations.vllm_lora.HalLoraWorkerExtension"`
adds the worker-side queries (`hal_lora_loaded_adapter_ids`, `hal_lora_adapter_version`)
reachable through `collective_rpc`; importing it in a worker process registers the
backend there too.

Nothing here is specific to a device: the group and synchronisation come from
`hal.current()`, as in the "hal" engine.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from hal.integrations import vllm_internals
from hal.integrations.vllm import (
    HalInitInfo,
    HalUpdateInfo,
    HalWeightTransferEngine,
    dtype_from_name,
    register_engine,
)
from hal.sync import Receiver, SpecMismatchError, SyncConfig, TensorSource, TensorSpec
from hal.sync.lora import (
    BaseWeightTracker,
    LoraSyncDecision,
    MergedSource,
    adapter_specs,
    adapter_tensors,
    base_tensors,
)

logger = logging.getLogger(__name__)

BACKEND_NAME = "hal-lora"
DEFAULT_LORA_NAME = "hal-lora"
DEFAULT_LORA_ID = 1
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"

# peft config keys that change which modules or ranks an adapter has; adapter_specs
# cannot compute shapes for them, so they are refused at init instead of mis-synced.
_UNSUPPORTED_WHEN_SET = ("rank_pattern", "alpha_pattern", "layers_to_transform", "exclude_modules", "modules_to_save")


def default_adapter_dir(lora_name: str = DEFAULT_LORA_NAME) -> str:
    """Where the engine publishes the adapter unless told otherwise: unique per trainer process."""
    return os.path.join(tempfile.gettempdir(), f"hal-lora-{os.getpid()}-{lora_name}")


def lora_request(adapter_dir: str, lora_name: str = DEFAULT_LORA_NAME, lora_int_id: int = DEFAULT_LORA_ID) -> Any:
    """The `LoRARequest` that makes a request use the synced adapter."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name, lora_int_id, adapter_dir)


# ---- worker side ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class HalLoraInitInfo(HalInitInfo):
    """The "hal" init info plus the adapter every sync may carry (fixed for the session)."""

    lora_config: dict[str, Any]
    """The adapter's peft config as `hal.sync.lora.adapter_config` gives it (adapter_config.json)."""
    adapter_dir: str
    """Absolute directory on the engine's node where each worker publishes the adapter it
    received; the LoRA request names it and vLLM reloads the adapter from it."""
    lora_name: str = DEFAULT_LORA_NAME
    lora_int_id: int = DEFAULT_LORA_ID

    def __post_init__(self) -> None:
        super().__post_init__()
        if not os.path.isabs(self.adapter_dir):
            raise ValueError(f"HalLoraInitInfo.adapter_dir must be an absolute path, got {self.adapter_dir!r}")
        if not isinstance(self.lora_config, dict):
            raise TypeError(f"HalLoraInitInfo.lora_config must be a dict (adapter_config.json), got {type(self.lora_config).__name__}")
        for key in ("r", "lora_alpha", "target_modules"):
            if key not in self.lora_config:
                raise ValueError(f"HalLoraInitInfo.lora_config has no {key!r}: pass hal.sync.lora.adapter_config(model)")
        for key in _UNSUPPORTED_WHEN_SET:
            if self.lora_config.get(key):
                raise NotImplementedError(
                    f"HalLoraInitInfo.lora_config sets {key}={self.lora_config[key]!r}: the hal-lora engine "
                    "syncs plain lora_A/lora_B adapters only (merge the adapter instead)"
                )
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"HalLoraInitInfo.lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("HalLoraInitInfo.lora_name must not be empty")


class HalLoraWeightTransferEngine(HalWeightTransferEngine):
    """Worker side of "hal-lora": base tensors by layerwise reload; the adapter checked, then published for vLLM's LoRA loader."""

    init_info_cls = HalLoraInitInfo
    update_info_cls = HalUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._lora_info: HalLoraInitInfo | None = None
        self._adapter_names: frozenset[str] = frozenset()
        self._pending: dict[str, torch.Tensor] = {}
        self._built: Any = None  # the LoRAModel of the sync in progress (validated, not installed)
        self.adapter_version: int | None = None
        """The weight version of the adapter this worker serves (None before the first adapter sync)."""

    # ---- init ---------------------------------------------------------------------
    def _lora_manager(self) -> Any:
        manager = vllm_internals.lora_manager(self)
        if manager is None:
            raise RuntimeError(
                "hal-lora weight transfer: the engine has no LoRA manager; start vLLM with enable_lora=True "
                "(and max_lora_rank >= the adapter's r)"
            )
        return manager

    def init_transfer_engine(self, init_info: HalLoraInitInfo) -> None:  # type: ignore[override]
        # Join the trainer's group first: a refused adapter then fails the trainer's init
        # with this worker's error at once, instead of leaving it waiting for the rendezvous.
        super().init_transfer_engine(init_info)
        if self._receiver is None:
            raise RuntimeError("hal-lora weight transfer: the base engine did not initialise its receiver")
        base = list(self._receiver.specs.values())
        dtype = dtype_from_name(init_info.wire_dtype) or self.model_config.dtype
        try:
            manager = self._lora_manager()
            # rank <= max_lora_rank, no bias, no unsupported peft features
            self._peft_helper(init_info.lora_config).validate_legal(self.vllm_config.lora_config)
            lora = adapter_specs(
                base, r=int(init_info.lora_config["r"]), target_modules=init_info.lora_config["target_modules"], dtype=dtype
            )
            self._check_supported(lora, manager)
        except BaseException:
            self.shutdown()  # leave no half-initialised group behind
            raise
        self._adapter_names = frozenset(s.name for s in lora)
        self._receiver = Receiver(
            self._receiver.transport, base + lora, timeout_s=init_info.timeout_s, token=self._token, validate=self.validate
        )
        self._lora_info = init_info
        logger.info(
            "hal-lora weight transfer: adapter %r (id %d, r=%s) with %d tensors, %d base tensors",
            init_info.lora_name, init_info.lora_int_id, init_info.lora_config["r"], len(lora), len(base),
        )

    def validate(self, specs: list[TensorSpec]) -> None:
        """As the base engine (whole layers), and refuse a sync carrying part of the adapter."""
        super().validate(specs)
        sent = {spec.name for spec in specs} & self._adapter_names
        if sent and sent != self._adapter_names:
            missing = sorted(self._adapter_names - sent)
            more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
            raise SpecMismatchError(
                f"the sync carries {len(sent)} of the adapter's {len(self._adapter_names)} tensors; missing {missing[:3]}{more}"
            )

    def _peft_helper(self, lora_config: dict[str, Any]) -> Any:
        text_config = self.model_config.hf_config.get_text_config()
        config = dict(lora_config)
        config["vllm_max_position_embeddings"] = getattr(text_config, "max_position_embeddings", None)
        return vllm_internals.peft_helper(config)

    @staticmethod
    def _check_supported(specs: list[TensorSpec], manager: Any) -> None:
        """Every targeted module must be one vLLM applies LoRA to (its loader checks the same on disk)."""
        expected = vllm_internals.lora_target_modules(manager)
        unsupported = sorted({s.name.split(".lora_")[0] for s in specs if s.name.split(".lora_")[0].rsplit(".", 1)[-1] not in expected})
        if unsupported:
            raise ValueError(
                f"hal-lora weight transfer: vLLM applies LoRA to {sorted(expected)} in this model, "
                f"but the adapter targets {unsupported[:3]}{' ...' if len(unsupported) > 3 else ''}"
            )

    # ---- one update ---------------------------------------------------------------
    def receive_weights(self, update_info: HalUpdateInfo) -> None:
        if self._lora_info is None:
            raise RuntimeError("hal-lora weight transfer: not initialized; call init_weight_transfer_engine first")
        self._pending, self._built = {}, None
        try:
            super().receive_weights(update_info)
            built = self._built
            tensors = self._pending
        finally:
            self._pending, self._built = {}, None
        if built is not None:
            # Only after every rank completed the sync: a refused sync leaves the served adapter as it was.
            self._publish(tensors)
            self.adapter_version = self.version

    def apply(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        base = []
        for name, tensor in pairs:
            if name in self._adapter_names:
                self._pending[name] = tensor.clone()  # views into the receive slot: keep a copy
            else:
                base.append((name, tensor))
        if base:
            super().apply(base)
        if self._pending and len(self._pending) == len(self._adapter_names):
            # Build it as vLLM will: a bad adapter fails this sync on every rank, before it is published.
            self._built = self._build(self._pending)

    def _build(self, tensors: dict[str, torch.Tensor]) -> Any:
        info = self._lora_info
        if info is None:
            raise RuntimeError("hal-lora weight transfer: not initialized; call init_weight_transfer_engine first")
        manager = self._lora_manager()
        lora = vllm_internals.build_lora_model(
            manager,
            lora_id=info.lora_int_id,
            tensors=dict(tensors),
            peft_helper=self._peft_helper(info.lora_config),
            dtype=self.vllm_config.lora_config.lora_dtype,
            vocab_size=self.model_config.get_vocab_size(),
        )
        vllm_internals.validate_lora_model(manager, lora)
        return lora

    def _publish(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write the adapter where the LoRA request points (peft's layout), file by file atomically.

        vLLM drops every loaded adapter when a weight update finishes (`reset_lora_state`:
        adapters are invalidated with the base) and reloads an adapter from its request's
        path on the next request that names it, so this directory is what it serves from.
        """
        import json
        import os

        from safetensors.torch import save_file

        info = self._lora_info
        if info is None:
            raise RuntimeError("hal-lora weight transfer: not initialized; call init_weight_transfer_engine first")
        directory = info.adapter_dir
        os.makedirs(directory, exist_ok=True)
        tag = f".{os.getpid()}.{self.group_rank(info)}.tmp"  # workers of one engine may share the directory
        weights, config = os.path.join(directory, ADAPTER_WEIGHTS), os.path.join(directory, ADAPTER_CONFIG)
        save_file({n: t.contiguous() for n, t in tensors.items()}, weights + tag, metadata={"format": "pt"})
        with open(config + tag, "w") as f:
            json.dump(info.lora_config, f)
        os.replace(weights + tag, weights)
        os.replace(config + tag, config)

    def shutdown(self) -> None:
        self._lora_info, self._adapter_names = None, frozenset()
        super().shutdown()

    def loaded_adapter_ids(self) -> list[int]:
        """The LoRA ids vLLM's manager holds on this worker (loaded on first use after each update)."""
        return vllm_internals.loaded_lora_ids(self._lora_manager())


# ---- trainer side --------------------------------------------------------------------------


class LoraEngine:
    """Wraps an `Engine` of `hal.integrations.vllm_client` (offline LLM, HTTP server): its
    init info also carries the adapter's config, name and id for a "hal-lora" engine."""

    def __init__(self, inner: Any, lora_config: dict[str, Any], *, adapter_dir: str, lora_name: str, lora_int_id: int) -> None:
        self.inner = inner
        self.lora_config = dict(lora_config)
        self.adapter_dir = adapter_dir
        self.lora_name = lora_name
        self.lora_int_id = lora_int_id

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def num_workers(self) -> int:
        return self.inner.num_workers

    @property
    def same_node(self) -> bool:
        return bool(getattr(self.inner, "same_node", False))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        payload = {
            **init_info,
            "lora_config": self.lora_config,
            "adapter_dir": self.adapter_dir,
            "lora_name": self.lora_name,
            "lora_int_id": self.lora_int_id,
        }
        HalLoraInitInfo(**payload)  # refuse a bad adapter config here, not in the engine
        self.inner.init_weight_transfer_engine(payload)

    def start_weight_update(self) -> None:
        self.inner.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.inner.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.inner.finish_weight_update(weight_version)

    def get_weight_version(self) -> str:
        return self.inner.get_weight_version()

    def reset_prefix_cache(self) -> None:
        self.inner.reset_prefix_cache()

    def shutdown_weight_transfer_engine(self) -> None:
        self.inner.shutdown_weight_transfer_engine()


@dataclass(slots=True)
class LoraSyncResult:
    """One LoRA sync: what was decided, and the sync's own result."""

    decision: LoraSyncDecision
    result: Any
    """`hal.integrations.vllm_client.SyncResult` (metrics.bytes: the bytes that travelled)."""
    part_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of each part sent ("base", "adapter", "merged")."""

    @property
    def metrics(self) -> Any:
        return self.result.metrics


class LoraWeightSync:
    """Drives LoRA syncs from a peft trainer into "hal-lora" engines, sending what
    `decide_lora_sync` says (adapter only while the engines keep their base weights).

    `sleep_level` and `free_cache_engine` describe how the engines are put to sleep between
    rollouts (as verl's rollout config); `engine_lost_weights()` records an engine's report
    that it freed its weights, so that the next sync resends the base.
    """

    def __init__(
        self,
        engines: Sequence[Any],
        lora_config: dict[str, Any],
        *,
        sleep_level: int,
        free_cache_engine: bool,
        adapter_merged: bool = False,
        adapter_name: str | None = None,
        lora_name: str = DEFAULT_LORA_NAME,
        lora_int_id: int = DEFAULT_LORA_ID,
        adapter_dir: str | None = None,
        config: SyncConfig | None = None,
        timeout_s: float = 120.0,
        transport: str = "auto",
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
    ) -> None:
        from hal.integrations.vllm_client import WeightSync

        self.lora_name = lora_name
        self.lora_int_id = lora_int_id
        self.adapter_dir = os.path.abspath(adapter_dir or default_adapter_dir(lora_name))
        """Where the engines publish the adapter (a directory on each engine's node)."""
        self.adapter_name = adapter_name
        self.tracker = BaseWeightTracker(
            has_adapter=True, sleep_level=sleep_level, free_cache_engine=free_cache_engine, adapter_merged=adapter_merged
        )
        self.tracker.decide()  # validates sleep_level and the flags now
        wrapped = [
            LoraEngine(e, lora_config, adapter_dir=self.adapter_dir, lora_name=lora_name, lora_int_id=lora_int_id)
            for e in engines
        ]
        self.weight_sync = WeightSync(
            wrapped, config=config, timeout_s=timeout_s, transport=transport,
            master_address=master_address, master_port=master_port,
        )

    def init(self) -> None:
        self.weight_sync.init()

    def decide(self) -> LoraSyncDecision:
        return self.tracker.decide()

    def sources(self, model: torch.nn.Module, decision: LoraSyncDecision) -> tuple[TensorSource, dict[str, int]]:
        """The pairs of every part `decision` sends, in sending order, and each part's bytes."""
        pairs: list[tuple[str, torch.Tensor]] = []
        sizes: dict[str, int] = {}
        for part in decision.parts:
            if part == "base":
                got = base_tensors(model)
            elif part == "adapter":
                got = adapter_tensors(model, self.adapter_name)
            else:
                got = list(MergedSource(model, self.adapter_name))
            sizes[part] = sum(t.numel() * t.element_size() for _, t in got)
            pairs.extend(got)
        return TensorSource(pairs), sizes

    def sync(self, model: torch.nn.Module, version: int) -> LoraSyncResult:
        """One sync of the peft `model` as `version`; the engines serve the new adapter when it returns."""
        decision = self.tracker.decide()
        source, sizes = self.sources(model, decision)
        start = time.perf_counter()
        result = self.weight_sync.sync(source, version)
        self.tracker.sent(decision)
        logger.info(
            "hal-lora sync v%d: %s (%s) in %.3f s", version, "+".join(decision.parts), decision.reason, time.perf_counter() - start
        )
        return LoraSyncResult(decision=decision, result=result, part_bytes=sizes)

    def engine_lost_weights(self) -> None:
        """An engine reported it freed its weights (e.g. woke from sleep level 2): resend the base next time."""
        self.tracker.engine_lost_weights()

    def lora_request(self) -> Any:
        """The `LoRARequest` for generation with the synced adapter."""
        return lora_request(self.adapter_dir, self.lora_name, self.lora_int_id)

    def close(self) -> None:
        self.weight_sync.close()

    def __enter__(self) -> "LoraWeightSync":
        self.init()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class HalLoraWorkerExtension:
    """`worker_extension_cls="hal.integrations.vllm_lora.HalLoraWorkerExtension"`: makes
    "hal-lora" known in every worker process without the plugin entry point (vLLM imports
    this module in each worker before it builds the weight-transfer engine, and importing
    it registers the backend), and answers queries through `collective_rpc` by name.
    """

    def hal_lora_loaded_adapter_ids(self) -> list[int]:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, HalLoraWeightTransferEngine):
            raise RuntimeError(
                f"hal-lora: this worker's weight-transfer engine is {type(engine).__name__}; "
                f"start vLLM with WeightTransferConfig(backend={BACKEND_NAME!r})"
            )
        return engine.loaded_adapter_ids()

    def hal_lora_adapter_version(self) -> int | None:
        engine = getattr(self, "weight_transfer_engine", None)
        return engine.adapter_version if isinstance(engine, HalLoraWeightTransferEngine) else None


def register() -> None:
    """Make `backend="hal-lora"` known to vLLM's engine factory (idempotent; any process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    register_engine(WeightTransferEngineFactory, BACKEND_NAME, "hal.integrations.vllm_lora", "HalLoraWeightTransferEngine")


# Importing this module is how a worker learns the backend when the engine names
# `HalLoraWorkerExtension` (see its docstring); registering is idempotent.
register()
