"""A `peft.PeftModel` read by its parameter names only (this module imports neither peft
nor transformers): which tensors are the base, the adapter, or both merged, under the
names the engine expects, and the adapter's specs from engine-side information.

    base_model.model.<m>.base_layer.weight       -> <m>.weight               (base_weight_name)
    base_model.model.<m>.lora_A.<adapter>.weight -> base_model.model.<m>.lora_A.weight
                                                     (adapter_weight_name: the names peft saves
                                                      and vLLM's LoRA loader parses)
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

if TYPE_CHECKING:  # pragma: no cover
    from hal.sync.spec import TensorSpec

# ---- peft names ----------------------------------------------------------------------------

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


def _active_adapter(model: torch.nn.Module, adapter_name: str | None) -> str:
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


def base_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The base weights of a peft model under the engine's names (views, no copies)."""
    out = []
    for name, p in model.named_parameters():
        engine_name = base_weight_name(name)
        if engine_name is not None:
            out.append((engine_name, p.detach()))
    return out


def adapter_tensors(model: torch.nn.Module, adapter_name: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """The adapter's weights under the names vLLM expects (views, no copies).

    Raises ValueError when the model holds no parameter of that adapter.
    """
    adapter = _active_adapter(model, adapter_name)
    out = []
    for name, p in model.named_parameters():
        engine_name = adapter_weight_name(name, adapter)
        if engine_name is not None:
            out.append((engine_name, p.detach()))
    if not out:
        raise ValueError(f"{type(model).__name__} has no LoRA parameters of adapter {adapter!r}")
    return out


def _lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer") and hasattr(module, "lora_A"):
            yield name, module


def merged_tensors(model: torch.nn.Module, adapter_name: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights with the adapter folded in, under the engine's base names.

    The trainer's model is not changed: a LoRA layer's merged weight is a new tensor
    `base + delta` (delta from peft's `get_delta_weight`, as `merge_and_unload` adds it);
    every other weight is a view. Generated lazily, one merged tensor alive at a time when
    the consumer does not keep them.
    """
    adapter = _active_adapter(model, adapter_name)
    lora_weights: dict[str, torch.nn.Module] = {}
    for mod_name, module in _lora_layers(model):
        lora_weights[f"{mod_name}.base_layer.weight"] = module
    for name, p in model.named_parameters():
        engine_name = base_weight_name(name)
        if engine_name is None:
            continue
        module = lora_weights.get(name)
        if module is None or not _needs_delta(module, adapter, name):
            yield engine_name, p.detach()
            continue
        with torch.no_grad():
            delta = module.get_delta_weight(adapter)
            yield engine_name, (p.detach() + delta).to(p.dtype)


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


class MergedSource:
    """A sync source of `merged_tensors(model)`: `metadata()` and a fresh pass per `iter()`."""

    def __init__(self, model: torch.nn.Module, adapter_name: str | None = None) -> None:
        self.model = model
        self.adapter_name = _active_adapter(model, adapter_name)

    def metadata(self) -> list["TensorSpec"]:
        from hal.sync.spec import TensorSpec

        specs = []
        for name, p in self.model.named_parameters():
            engine_name = base_weight_name(name)
            if engine_name is not None:
                specs.append(TensorSpec(engine_name, tuple(p.shape), p.dtype))
        return specs

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return merged_tensors(self.model, self.adapter_name)


def adapter_config(model: torch.nn.Module, adapter_name: str | None = None) -> dict[str, Any]:
    """The adapter's peft config as a JSON-able dict (what `adapter_config.json` holds).

    vLLM builds its LoRA request from this dict plus `adapter_tensors`.
    """
    adapter = _active_adapter(model, adapter_name)
    configs = getattr(model, "peft_config", None)
    if not configs or adapter not in configs:
        raise ValueError(f"{type(model).__name__} has no peft config for adapter {adapter!r}")
    raw = configs[adapter].to_dict()
    return {k: _jsonable(v) for k, v in raw.items()}


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if hasattr(value, "value") and not isinstance(value, (str, int, float, bool)):
        return value.value  # enums
    return value


# ---- adapter specs from engine-side information ------------------------------------------------


def _matches(module_name: str, target_modules: str | Iterable[str]) -> bool:
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, module_name) is not None
    return any(module_name == t or module_name.endswith("." + t) for t in target_modules)


def adapter_specs(
    base_specs: Iterable["TensorSpec"],
    *,
    r: int,
    target_modules: str | Iterable[str],
    dtype: torch.dtype | None = None,
    embedding_modules: Iterable[str] = ("embed_tokens",),
) -> list["TensorSpec"]:
    """The specs of a LoRA adapter, computed from the engine's base specs and the LoRA config.

    No trainer model needed: for a targeted linear weight of shape (out, in) the adapter has
    `lora_A` (r, in) and `lora_B` (out, r); for a targeted embedding (vocab, dim),
    `lora_embedding_A` (r, vocab) and `lora_embedding_B` (dim, r). Names are those
    `adapter_weight_name` gives. Matching follows peft: a list matches a module name or its
    last components, a string is a full regular expression. `rank_pattern` is not handled.
    """
    from hal.sync.spec import TensorSpec

    if not isinstance(r, int) or r <= 0:
        raise ValueError(f"adapter_specs: r must be a positive int, got {r!r}")
    if not isinstance(target_modules, str):
        target_modules = list(target_modules)
    embeddings = set(embedding_modules)
    out: list[TensorSpec] = []
    for spec in base_specs:
        if not spec.name.endswith(".weight"):
            continue
        module = spec.name[: -len(".weight")]
        if not _matches(module, target_modules):
            continue
        if len(spec.shape) != 2:
            raise ValueError(f"adapter_specs: targeted weight {spec.name!r} has shape {spec.shape}, expected 2 dimensions")
        rows, cols = spec.shape
        t = dtype or spec.dtype
        prefix = PEFT_PREFIX + module
        if module.rsplit(".", 1)[-1] in embeddings:
            out.append(TensorSpec(f"{prefix}.lora_embedding_A", (r, rows), t))
            out.append(TensorSpec(f"{prefix}.lora_embedding_B", (cols, r), t))
        else:
            out.append(TensorSpec(f"{prefix}.lora_A.weight", (r, cols), t))
            out.append(TensorSpec(f"{prefix}.lora_B.weight", (rows, r), t))
    if not out:
        raise ValueError(f"adapter_specs: no base weight matches target_modules={target_modules!r}")
    return out
