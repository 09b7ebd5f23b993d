"""Worker side of "hal-lora": the engine vLLM builds in each worker for `WeightTransferConfig(backend="hal-lora")`.

`HalLoraWeightTransferEngine`, a subclass of the "hal" engine: base tensors go through its
layerwise reload; the adapter's tensors are built into a vLLM `LoRAModel` while the sync
runs (checked as vLLM's own loader checks it), then published in peft's layout for vLLM's
LoRA loader once every rank completed the sync. hal.integrations.vllm.lora says why.

With `HalInitInfo.rendezvous` (every trainer rank sends its rows: `LoraWeightSync(...,
senders="all")`) the "hal" engine joins one group per trainer rank and receives base and
adapter from all of them (`hal.sync.make_receiver`): what this engine is handed are whole
tensors, as from one sender, so the adapter checks and the publishing are the same.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from hal.integrations.vllm import internals as vllm_internals
from hal.integrations.vllm.info import HalInitInfo, HalUpdateInfo, dtype_from_name
from hal.integrations.vllm.engine import HalWeightTransferEngine
from hal.sync import SpecMismatchError, TensorSpec
from hal.sync.lora import adapter_specs

logger = logging.getLogger(__name__)

BACKEND_NAME = "hal-lora"
DEFAULT_LORA_NAME = "hal-lora"
DEFAULT_LORA_ID = 1
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"

# peft config keys that change which modules or ranks an adapter has; adapter_specs
# cannot compute shapes for them, so they are refused at init instead of mis-synced.
_UNSUPPORTED_WHEN_SET = ("rank_pattern", "alpha_pattern", "layers_to_transform", "exclude_modules", "modules_to_save")


@dataclass(kw_only=True)
class HalLoraInitInfo(HalInitInfo):
    """The "hal" init info plus the adapter every sync may carry (fixed for the session)."""

    lora_config: dict[str, Any]
    """The adapter's peft config as `hal.sync.lora.peft.adapter_config` gives it (adapter_config.json)."""
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
                raise ValueError(f"HalLoraInitInfo.lora_config has no {key!r}: pass hal.sync.lora.peft.adapter_config(model)")
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
        if not vllm_internals.reloads_lora_models():
            raise RuntimeError(
                f"hal-lora weight transfer needs vLLM 0.28 or later; vLLM {vllm_internals.vllm_version()} cannot load "
                "base weights into a LoRA-enabled model after start-up (its loader does not reach the layers LoRA wraps), "
                "so a sync carrying the base would fail; merge the adapter and sync with backend 'hal' instead"
            )
        # The base engine joins the trainer's group first, then asks `accepted_specs`: a
        # refused adapter then fails the trainer's init with this worker's error at once,
        # instead of leaving it waiting for the rendezvous.
        super().init_transfer_engine(init_info)
        self._lora_info = init_info
        logger.info(
            "hal-lora weight transfer: adapter %r (id %d, r=%s) with %d tensors, from %d trainer rank(s)",
            init_info.lora_name, init_info.lora_int_id, init_info.lora_config["r"], len(self._adapter_names), self.sender_count,
        )

    def accepted_specs(self, init_info: HalLoraInitInfo, checkpoint: list[TensorSpec]) -> list[TensorSpec]:  # type: ignore[override]
        """The checkpoint's tensors and the adapter's, computed from the engine's own base
        shapes and the adapter config (never from the trainer's model), once the adapter is
        checked as vLLM's loader checks it."""
        dtype = dtype_from_name(init_info.wire_dtype) or self.model_config.dtype
        manager = self._lora_manager()
        # rank <= max_lora_rank, no bias, no unsupported peft features
        self._peft_helper(init_info.lora_config).validate_legal(self.vllm_config.lora_config)
        lora = adapter_specs(
            checkpoint, r=int(init_info.lora_config["r"]), target_modules=init_info.lora_config["target_modules"], dtype=dtype
        )
        self._check_supported(lora, manager)
        self._adapter_names = frozenset(s.name for s in lora)
        return checkpoint + lora

    def shard_word(self, specs: list[TensorSpec], worker: int) -> Any:
        """An adapter travels with the base through the engine's own loaders: whole tensors."""
        return "hal-lora: the adapter and the base travel as whole tensors (a shard receive lands base weights only)"

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
