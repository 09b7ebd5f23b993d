"""A `peft.PeftModel`'s tensors as the engine's checkpoints hold them, read by their names
and peft's own layer methods (this module imports neither peft nor transformers):

    base_model.model.<m>.base_layer.weight       -> <m>.weight               (base_weight_name, PeftBase)
    base_model.model.<m>.lora_A.<adapter>.weight -> base_model.model.<m>.lora_A.weight
                                                     (adapter_weight_name, PeftAdapter: the names
                                                      peft saves and vLLM's LoRA loader parses)
    a LoRA layer's base weight                   -> <m>.weight = base + delta (PeftMerge)
"""

from __future__ import annotations

from typing import Iterator

import torch

from hal.sync.adapters.base import Derived, NameAdapter, NameFunction, Renamed, Rule, StateDictAdapter
from hal.sync.adapters.names import unwrapped_name

PEFT_PREFIX = "base_model.model."
_LORA_MATRICES = ("lora_A", "lora_B")
_LORA_EMBEDDINGS = ("lora_embedding_A", "lora_embedding_B")


def _strip_prefix(name: str) -> str:
    return name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name


def base_weight_name(name: str) -> str | None:
    """The engine's name of a peft model's base parameter; None for adapter parameters.

    `base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` becomes
    `model.layers.0.self_attn.q_proj.weight`; unwrapped parameters only lose the
    `base_model.model.` prefix. Usable as `ModuleSource(peft_model, rename=base_weight_name)`.
    """
    parts = _strip_prefix(name).split(".")
    if any(p.startswith("lora_") for p in parts) or "modules_to_save" in parts:
        return None
    return ".".join(p for p in parts if p not in ("base_layer", "original_module"))


def adapter_weight_name(name: str, adapter_name: str = "default") -> str | None:
    """The name vLLM's LoRA loader expects for a peft adapter parameter; None for others.

    `base_model.model.<m>.lora_A.<adapter>.weight` becomes `base_model.model.<m>.lora_A.weight`
    and `...embed_tokens.lora_embedding_A.<adapter>` becomes `...embed_tokens.lora_embedding_A`
    (what `peft.get_peft_model_state_dict` saves). Parameters of other adapters give None.
    DoRA magnitudes and `modules_to_save` copies raise: vLLM cannot load them as an adapter.
    """
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p in _LORA_MATRICES and i + 1 < len(parts):
            if parts[i + 1] != adapter_name:
                return None
            return ".".join(parts[: i + 1] + parts[i + 2 :])
        if p in _LORA_EMBEDDINGS and i + 1 < len(parts):
            if parts[i + 1] != adapter_name:
                return None
            return ".".join(parts[: i + 1] + parts[i + 2 :])
        if p == "modules_to_save" or p.startswith("lora_magnitude"):
            if adapter_name in parts[i + 1 :]:
                raise NotImplementedError(
                    f"adapter parameter {name!r}: {p} is not supported by the LoRA sync "
                    f"(vLLM loads lora_A/lora_B only); merge the adapter instead (adapter_merged=True)"
                )
            return None
    return None


def active_adapter(model: torch.nn.Module, adapter_name: str | None) -> str:
    """`adapter_name`, or the model's one active adapter."""
    if adapter_name is not None:
        return adapter_name
    active = getattr(model, "active_adapter", None)
    if isinstance(active, (list, tuple)):
        if len(active) != 1:
            raise ValueError(f"model has {len(active)} active adapters {list(active)}; pass adapter_name")
        active = active[0]
    if not isinstance(active, str):
        raise ValueError(f"{type(model).__name__} is not a peft model with an active adapter; pass adapter_name")
    return active


class PeftBase(NameAdapter):
    """The base weights under the engine's names (`base_weight_name`); adapter tensors left out."""

    def name(self, name: str) -> str | None:
        return base_weight_name(name)

    def name_function(self) -> NameFunction:
        return base_weight_name

    def __eq__(self, other: object) -> bool:
        return type(other) is PeftBase

    def __hash__(self) -> int:
        return hash(PeftBase)

    def __repr__(self) -> str:
        return "PeftBase()"


class PeftAdapter(NameAdapter):
    """One adapter's LoRA matrices under the names vLLM's LoRA loader parses
    (`adapter_weight_name`); every other tensor left out."""

    def __init__(self, adapter_name: str = "default") -> None:
        self.adapter_name = adapter_name

    def name(self, name: str) -> str | None:
        return adapter_weight_name(name, self.adapter_name)

    def __eq__(self, other: object) -> bool:
        return type(other) is PeftAdapter and other.adapter_name == self.adapter_name

    def __hash__(self) -> int:
        return hash((PeftAdapter, self.adapter_name))

    def __repr__(self) -> str:
        return f"PeftAdapter({self.adapter_name!r})"


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """peft's LoRA layers of `model`, by module name."""
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer") and hasattr(module, "lora_A"):
            yield name, module


class PeftMerge(StateDictAdapter):
    """The weights with adapter `adapter_name` folded in, under the engine's base names: a
    LoRA layer's base weight is a new tensor `base + delta` (delta from peft's
    `get_delta_weight`, as `merge_and_unload` adds it), made every read; every other base
    weight is the parameter itself; adapter tensors are left out. The trainer's model is not
    changed. Whether a layer's delta applies (the adapter active, enabled, not already merged
    in place) is read at every read, as peft decides it at every forward."""

    views = False

    def __init__(self, model: torch.nn.Module, adapter_name: str | None = None) -> None:
        self.model = model
        self.adapter_name = active_adapter(model, adapter_name)

    def rules(self, names: list[str], tensors: list[torch.Tensor]) -> dict[str, Rule]:
        layers = {unwrapped_name(f"{name}.base_layer.weight"): module for name, module in lora_layers(self.model)}
        rules: dict[str, Rule] = {}
        for name in names:
            target = base_weight_name(name)
            module = layers.get(unwrapped_name(name))
            if module is not None and target is not None:
                rules[name] = Merged(module, self.adapter_name, name, target)
            elif target != name:
                rules[name] = Renamed(target)
        return rules

    def __eq__(self, other: object) -> bool:
        return type(other) is PeftMerge and other.model is self.model and other.adapter_name == self.adapter_name

    def __hash__(self) -> int:
        return hash((id(self.model), self.adapter_name))

    def __repr__(self) -> str:
        return f"PeftMerge({type(self.model).__name__}, {self.adapter_name!r})"


class Merged(Derived):
    """One LoRA layer's base weight with its delta added (see `PeftMerge`)."""

    __slots__ = ("module", "adapter", "name", "target")
    views = False

    def __init__(self, module: torch.nn.Module, adapter: str, name: str, target: str) -> None:
        self.module, self.adapter, self.name, self.target = module, adapter, name, target

    def apply(self, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if not _needs_delta(self.module, self.adapter, self.name):
            return [(self.target, tensor)]
        with torch.no_grad():
            delta = self.module.get_delta_weight(self.adapter)
            return [(self.target, (tensor + delta).to(tensor.dtype))]

    def layout(self, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(self.target, tensor)]  # the base's shape and dtype: nothing computed

    def __repr__(self) -> str:
        return f"Merged({self.name!r})"


def _needs_delta(module: torch.nn.Module, adapter: str, name: str) -> bool:
    if getattr(module, "disable_adapters", False):
        return False
    if adapter not in getattr(module, "active_adapters", [adapter]):
        return False
    if adapter in getattr(module, "merged_adapters", []):
        return False  # already folded into the base weight in place
    has = adapter in getattr(module, "lora_A", {}) or adapter in getattr(module, "lora_embedding_A", {})
    if not has:
        return False
    if getattr(module, "use_dora", {}).get(adapter, False):
        raise NotImplementedError(f"parameter {name!r}: DoRA layers cannot be merged by hal.sync.lora")
    if getattr(module, "lora_bias", {}).get(adapter, False):
        raise NotImplementedError(f"parameter {name!r}: lora_bias=True is not supported by hal.sync.lora")
    return True
