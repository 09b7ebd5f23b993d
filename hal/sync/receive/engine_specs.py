"""Engine-side spec readers: the tensors an engine accepts, from what the engine has.

A rollout worker's receiver needs the names, shapes and dtypes it accepts (`TensorSpec`s),
never the trainer's model: building the trainer model on a rollout worker costs its parameter
memory for nothing (verl PR 4914: dropping it let a 70B rollout fit on one 8-device
node). Where the specs come from, cheapest first:

* `specs_from_safetensors(path)`: the checkpoint the engine was started from; reads the
  JSON headers only, no tensor data.
* `specs_from_module(engine_model)`: the engine's own model (`named_parameters`), when
  its names are the names the trainer sends.
* `specs_from_config(config)`: a Hugging Face config instantiated on the meta device:
  shapes without a byte of parameter memory (imports transformers, so not for a worker
  that must stay free of it).

`allocate(specs)` makes device tensors for them; `copy_into(tensors)` (hal.sync.sink) is
the `Sink` that writes each received tensor into one of them (the receiver does the writing).

    specs = specs_from_safetensors("/ckpt/model.safetensors")
    weights = allocate(specs)                      # or the engine's own parameters
    receiver = Receiver(BroadcastTransport(group), specs)
    receiver.receive(copy_into(weights))
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Iterable

import torch

from hal.backends.interface import Backend
from hal.kernels import align_up, typed_view
from hal.sync.spec import TensorSpec
from hal.sync.sink import CopyInto, copy_into  # noqa: F401 - re-exported for callers of both

__all__ = [
    "SAFETENSORS_DTYPES",
    "specs_from_safetensors",
    "specs_from_module",
    "specs_from_config",
    "allocate",
    "copy_into",
    "CopyInto",
    "total_bytes",
]

# safetensors dtype codes (the "dtype" field of each header entry) -> torch dtypes.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

# A header larger than this is not a safetensors header (the format caps it at 100 MB).
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def _read_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: not a safetensors file (header length {n} bytes)")
        data = f.read(n)
    try:
        header = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a safetensors file (header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (header is not a JSON object)")
    return header


def _files(path: str | os.PathLike) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{p}: no *.safetensors file in this directory")
        return files
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such safetensors file or directory")
    return [p]


def specs_from_safetensors(path: str | os.PathLike) -> list[TensorSpec]:
    """The specs of every tensor in a safetensors file, or in every `*.safetensors` of a
    directory (a sharded checkpoint), read from the headers only.

    Order: file by file (sorted names), and inside a file by data offset, which is the
    order the tensors were saved in.
    """
    specs: list[TensorSpec] = []
    seen: dict[str, Path] = {}
    for file in _files(path):
        header = _read_header(file)
        entries = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
            except (TypeError, KeyError):
                raise ValueError(f"{file}: header entry {name!r} lacks dtype/shape/data_offsets") from None
            dtype = SAFETENSORS_DTYPES.get(code)
            if dtype is None:
                raise ValueError(f"{file}: tensor {name!r} has dtype {code!r}, which torch cannot hold here")
            if name in seen:
                raise ValueError(f"tensor {name!r} is in both {seen[name]} and {file}")
            seen[name] = file
            entries.append((offsets[0], TensorSpec(name, tuple(shape), dtype)))
        specs.extend(spec for _, spec in sorted(entries, key=lambda e: e[0]))
    return specs


def specs_from_module(module: torch.nn.Module, *, buffers: bool = False) -> list[TensorSpec]:
    """The specs of an engine model's parameters (and persistent buffers with `buffers`).

    Use this only when the engine's names are the names the trainer sends; vLLM models
    fuse projections (`qkv_proj`) and take the checkpoint's names through `load_weights`,
    so for them read the checkpoint with `specs_from_safetensors`.
    """
    specs = [TensorSpec(name, tuple(p.shape), p.dtype) for name, p in module.named_parameters()]
    if buffers:
        non_persistent = {
            f"{prefix}.{b}" if prefix else b
            for prefix, m in module.named_modules()
            for b in getattr(m, "_non_persistent_buffers_set", ())
        }
        specs += [TensorSpec(n, tuple(b.shape), b.dtype) for n, b in module.named_buffers() if n not in non_persistent]
    return specs


def specs_from_config(config: Any, *, dtype: torch.dtype | None = None, model_class: Any = None) -> list[TensorSpec]:
    """The parameter specs of the model a Hugging Face `config` describes, built on the meta
    device: shapes and names without parameter memory. Imports transformers.

    `model_class` defaults to `transformers.AutoModelForCausalLM`; `dtype` overrides the
    parameters' dtype (default: the config's `torch_dtype`, else float32).
    """
    if model_class is None:
        from transformers import AutoModelForCausalLM as model_class  # noqa: N813 - optional import
    if dtype is None:
        dtype = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = model_class.from_config(config, torch_dtype=dtype)
    specs = [TensorSpec(name, tuple(p.shape), p.dtype) for name, p in model.named_parameters()]
    del model
    return specs


def total_bytes(specs: Iterable[TensorSpec]) -> int:
    return sum(s.nbytes for s in specs)


def allocate(
    specs: Iterable[TensorSpec], *, backend: Backend | None = None, fill: float | None = None
) -> dict[str, torch.Tensor]:
    """One device tensor per spec, for an engine that holds its weights in a flat table: views
    of one allocation (`backend.empty`), in the specs' order, each at a multiple of
    `ALIGNMENT` as in a bucket, so that small tensors sent back to back land there with no
    copy (docs/design.md, "tight segments"). `fill` sets every floating-point tensor (NaN
    makes a missed sync visible)."""
    backend = backend or _current()
    specs = list(specs)
    offsets: dict[str, int] = {}
    end = 0
    for spec in specs:
        if spec.name in offsets:
            raise ValueError(f"parameter {spec.name!r} is listed twice")
        offsets[spec.name] = end
        end = align_up(end + spec.nbytes)
    flat = backend.empty(max(end, 1))
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        t = out[spec.name] = typed_view(flat, offsets[spec.name], spec.shape, spec.dtype)
        if fill is not None and spec.dtype.is_floating_point:
            t.fill_(fill)
    return out


def _current() -> Backend:
    import hal

    return hal.current()
