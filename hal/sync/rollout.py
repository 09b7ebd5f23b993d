"""The former name of hal.sync.engine_specs (the engine-side spec readers, `allocate`) and
of `copy_into` (hal.sync.sink), kept for code written against it (docs/sync.md once named
it): import from those modules instead."""

from hal.sync.engine_specs import (  # noqa: F401 - the former names
    SAFETENSORS_DTYPES,
    allocate,
    specs_from_config,
    specs_from_module,
    specs_from_safetensors,
    total_bytes,
)
from hal.sync.sink import CopyInto, copy_into  # noqa: F401

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
