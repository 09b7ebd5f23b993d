"""The checkpoint tensors of a model `hal plan` plans: names, shapes, wire dtypes.

From the safetensors headers when the model's folder has them (a real checkpoint, a tiny
test model: `checkpoint_specs`, what a live engine reads), else from the `config.json`
alone: the model's Hugging Face class built on the meta device, its parameters and
persistent buffers (a tied `lm_head` once, under the embedding's name, as Hugging Face
saves it) put back into the checkpoint's layout by transformers' own reverse of its load
conversions (transformers 5 fuses the experts of a MoE layer on load; a checkpoint holds
one tensor per expert). That reverse runs once per distinct decoder layer (same names,
shapes and dtypes) and is renamed over the others: a 36,945-tensor checkpoint in well
under a second, rather than ~2 s.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from hal.sync.spec import TensorSpec

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
PRESETS_DIR = pathlib.Path(__file__).with_name("presets")


def presets() -> list[str]:
    """The presets shipped beside this module (hal/tools/plan/presets/README.md)."""
    return sorted(p.name for p in PRESETS_DIR.iterdir() if (p / "config.json").is_file())


def model_folder(model: str) -> pathlib.Path:
    """The folder of `model` (a preset's name, a folder, or a `config.json` in it);
    FileNotFoundError naming it."""
    if model in presets():
        return PRESETS_DIR / model
    path = pathlib.Path(model)
    folder = path.parent if path.name == "config.json" or path.suffix == ".json" else path
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"hal plan --model {model}: no config.json in {folder}")
    return folder


def read_config(folder: pathlib.Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def checkpoint_specs_of(folder: pathlib.Path, dtype: torch.dtype, layers: int | None = None) -> list[TensorSpec]:
    """The checkpoint's tensors, floating-point ones in `dtype` (what a trainer sends),
    in the order a layerwise reload completes layers; the first `layers` decoder layers
    only when given."""
    from hal.integrations.vllm.meta_engine import engine_checkpoint, in_engine_order

    specs = engine_checkpoint(str(folder), dtype)
    if specs is None:
        return in_engine_order(_from_config(folder, dtype, layers))
    return specs if layers is None else [s for s in specs if _index(s.name) is None or _index(s.name) < layers]


def _index(name: str) -> int | None:
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def _from_config(folder: pathlib.Path, dtype: torch.dtype, layers: int | None) -> list[TensorSpec]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hal.sync.spec import TensorSpec

    overrides = {} if layers is None else {"num_hidden_layers": layers}
    config = AutoConfig.from_pretrained(str(folder), **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:  # a tied lm_head is the embedding's tensor: saved once
            seen.add(id(tensor))
            tensors[name] = tensor
    groups: dict[int | None, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        groups.setdefault(_index(name), {})[name] = tensor
    templates: dict[tuple, tuple[int, list[tuple[str, tuple[int, ...], torch.dtype]]]] = {}
    out: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for index, group in groups.items():
        if index is None:
            out += _reverted(model, group)
            continue
        signature = tuple((_relative(n, index), tuple(t.shape), t.dtype) for n, t in group.items())
        if signature not in templates:
            templates[signature] = (index, _reverted(model, group))
        template, reverted = templates[signature]
        out += [(_renamed(n, template, index), shape, dt) for n, shape, dt in reverted]
    return [TensorSpec(n, shape, dtype if dt.is_floating_point else dt) for n, shape, dt in out]


def _reverted(model: Any, tensors: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """`tensors` (of `model`) as the checkpoint holds them: transformers' reverse of its load
    conversions (none before transformers 5: the model's names are the checkpoint's)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    return [(n, tuple(t.shape), t.dtype) for n, t in revert_weight_conversion(model, dict(tensors)).items()]


def _relative(name: str, index: int) -> str:
    return name.replace(f"layers.{index}.", "layers.#.", 1)


def _renamed(name: str, template: int, index: int) -> str:
    return name if template == index else name.replace(f"layers.{template}.", f"layers.{index}.", 1)
