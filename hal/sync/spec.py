"""What a sync knows of one tensor before its bytes: `TensorSpec` (name, shape, dtype).

Every layer of a sync speaks of tensors through it (the plan, the header, sources, sinks,
the engines' spec readers), so it is the bottom of hal.sync; nothing here imports the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a receiver needs to know of one tensor: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    # derived once: a sync reads them for every tensor, often several times
    numel: int = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TensorSpec.name must be a non-empty string, got {self.name!r}")
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"TensorSpec {self.name!r}: negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"TensorSpec {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        self._derive()

    def _derive(self) -> None:
        numel = math.prod(self.shape)
        object.__setattr__(self, "numel", numel)
        object.__setattr__(self, "nbytes", numel * self.dtype.itemsize)

    @classmethod
    def trusted(cls, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> "TensorSpec":
        """The spec, without the constructor's checks: only for values that passed them
        already (a real tensor's, `of`; a decoded header's, hal.sync.wire.header_json, which
        checks more), where they cost more than building the spec."""
        spec = object.__new__(cls)
        object.__setattr__(spec, "name", name)
        object.__setattr__(spec, "shape", shape)
        object.__setattr__(spec, "dtype", dtype)
        spec._derive()
        return spec

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorSpec":
        """The spec of a tensor (a DTensor's global shape). Sources call this for every
        tensor of every sync, so the spec a name had last time is handed out again when the
        tensor's shape and dtype still match it (`_LAST_SPECS`): nothing per tensor is
        built, and a plan cache recognises the same layout by identity. A spec is an
        immutable value checked against the tensor each time, never per-sync state."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"TensorSpec.name must be a non-empty string, got {name!r}")
        last = _LAST_SPECS.get(name)
        if last is not None and last.dtype is tensor.dtype and last.shape == tensor.shape:
            return last
        spec = cls.trusted(name, tuple(tensor.shape), tensor.dtype)  # a real tensor's shape and dtype pass the checks
        if len(_LAST_SPECS) >= _MAX_LAST_SPECS:  # many models in one process: start over
            _LAST_SPECS.clear()
        _LAST_SPECS[name] = spec
        return spec


# The last spec handed out per name by `TensorSpec.of` (see there). Bounded: a process that
# syncs models of more names than this only loses the reuse, never correctness.
_LAST_SPECS: dict[str, TensorSpec] = {}
_MAX_LAST_SPECS = 1 << 20
