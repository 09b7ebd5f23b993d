"""What the engine expects to receive, read from the engine's own checkpoint.

The receiver validates every sync against specs that come from the engine, never from
the trainer: names, shapes and dtypes of the checkpoint the engine was started from
(safetensors headers only, no tensor data is read), with floating-point tensors in the
dtype the engine runs in. A trainer that sends a wrong shape is refused before anything
is applied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from hal.sync import TensorSpec
from hal.sync.receive import specs_from_safetensors


def resolve_model_dir(model: str, revision: str | None = None) -> Path:
    """A local directory for `model`: the path itself, or its snapshot in the Hugging Face cache."""
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, allow_patterns=["*.safetensors", "*.json"]))
    except Exception as exc:  # noqa: BLE001 - any hub failure means: no local checkpoint
        raise FileNotFoundError(f"model {model!r}: not a local directory and not resolvable from the hub: {exc}") from exc


def checkpoint_specs(model_dir: str | Path, dtype: torch.dtype | None = None) -> list[TensorSpec]:
    """Specs of every tensor in the safetensors files of `model_dir`, in checkpoint order.

    Floating-point tensors take `dtype` (the engine's compute dtype) when given: the
    engine casts on load, so that is what the trainer must send; fp8 tensors (a quantized
    checkpoint) keep their dtype.
    """
    model_dir = Path(model_dir)
    if not any(model_dir.glob("*.safetensors")):
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}: the hal engine needs the checkpoint's layout")
    specs = specs_from_safetensors(model_dir)
    if dtype is not None:
        # fp8 weights of a quantized checkpoint stay fp8: the engine keeps them as they are
        specs = [TensorSpec(s.name, s.shape, dtype) if s.dtype.is_floating_point and s.dtype.itemsize > 1 else s for s in specs]
    return order_like_model(specs)


def _sort_key(name: str) -> tuple:
    # numbers compare as numbers: layers.2 before layers.10
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def order_like_model(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """Group by decoder layer in numeric order (safetensors headers sort names as strings).

    Embeddings first, then layer 0, 1, ..., then everything without a layer index: the
    order a layerwise reload completes layers in, so each layer is processed as soon as
    its last tensor arrives.
    """
    specs = list(specs)

    def key(spec: TensorSpec) -> tuple:
        parts = spec.name.split(".")
        index = next((int(p) for p in parts if p.isdigit()), None)
        if index is None:
            block = 0 if "embed" in spec.name else 2
            return (block, 0, _sort_key(spec.name))
        return (1, index, _sort_key(spec.name))

    return sorted(specs, key=key)


def layer_groups(names: list[str]) -> dict[str, frozenset[str]]:
    """For each name, every name of the decoder layer (or, without a layer index, the module) it belongs to.

    A layerwise reload keeps the tensors of a layer until the layer's last tensor
    arrives; a receiver that hands out views valid for one bucket must copy every tensor
    whose layer is not complete by the end of that bucket, whatever order the sender used.
    """
    members: dict[object, set[str]] = {}
    keys: dict[str, object] = {}
    for name in names:
        parts = name.split(".")
        idx = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        key: object = (".".join(parts[:idx]), int(parts[idx])) if idx is not None else name.rpartition(".")[0]
        keys[name] = key
        members.setdefault(key, set()).add(name)
    frozen = {key: frozenset(group) for key, group in members.items()}
    return {name: frozen[keys[name]] for name in names}
