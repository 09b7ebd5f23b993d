"""A `peft.PeftModel` as a LoRA sync sends it (this module imports neither peft nor
transformers): its base, its adapter, or both merged, under the names the engine expects
(the adapters of hal.sync.adapters.peft: `PeftBase`, `PeftAdapter`, `PeftMerge`), and the
adapter's specs from engine-side information.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

from hal.sync.adapters.base import adapt
from hal.sync.adapters.peft import (  # noqa: F401 - the names users import from hal.sync.lora
    PEFT_PREFIX,
    PeftAdapter,
    PeftBase,
    PeftMerge,
    active_adapter,
    adapter_weight_name,
    base_weight_name,
)

if TYPE_CHECKING:  # pragma: no cover
    from hal.sync.spec import TensorSpec

def base_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The base weights of a peft model under the engine's names (views, no copies)."""
    return list(adapt(model.named_parameters(), PeftBase(), whole=torch.Tensor.detach))


def adapter_tensors(model: torch.nn.Module, adapter_name: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """The adapter's weights under the names vLLM expects (views, no copies).

    Raises ValueError when the model holds no parameter of that adapter.
    """
    adapter = active_adapter(model, adapter_name)
    out = list(adapt(model.named_parameters(), PeftAdapter(adapter), whole=torch.Tensor.detach))
    if not out:
        raise ValueError(f"{type(model).__name__} has no LoRA parameters of adapter {adapter!r}")
    return out


def merged_tensors(model: torch.nn.Module, adapter_name: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights with the adapter folded in, under the engine's base names (`PeftMerge`).

    The trainer's model is not changed: a LoRA layer's merged weight is a new tensor
    `base + delta` (delta from peft's `get_delta_weight`, as `merge_and_unload` adds it);
    every other weight is a view. Generated lazily, one merged tensor alive at a time when
    the consumer does not keep them.
    """
    return adapt(model.named_parameters(), PeftMerge(model, adapter_name), whole=torch.Tensor.detach, split=_detached)


def _detached(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach()


class MergedSource:
    """A sync source of `merged_tensors(model)`: `metadata()` and a fresh pass per `iter()`.
    Its adapter (`PeftMerge`) computes, so a sender reads it by iterating, every sync."""

    def __init__(self, model: torch.nn.Module, adapter_name: str | None = None) -> None:
        self.model = model
        self.adapter = PeftMerge(model, adapter_name)
        self.adapter_name = self.adapter.adapter_name

    def metadata(self) -> list["TensorSpec"]:
        from hal.sync.spec import TensorSpec

        # names, shapes and dtypes from the adapter's layout: no merge computed
        return [TensorSpec(name, tuple(p.shape), p.dtype) for name, p in adapt(self.model.named_parameters(), self.adapter, layout=True)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return adapt(self.model.named_parameters(), self.adapter, whole=torch.Tensor.detach, split=_detached)


def adapter_config(model: torch.nn.Module, adapter_name: str | None = None) -> dict[str, Any]:
    """The adapter's peft config as a JSON-able dict (what `adapter_config.json` holds).

    vLLM builds its LoRA request from this dict plus `adapter_tensors`.
    """
    adapter = active_adapter(model, adapter_name)
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
