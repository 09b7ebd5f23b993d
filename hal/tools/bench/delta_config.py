"""`hal bench --delta`'s vocabulary: its method names, the wire dtypes it takes, and
`DeltaBenchConfig` (what one `run_delta` call measures; hal.tools.bench.delta describes the run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hal.tools.bench.common import MIB
from hal.tools.bench.presets import get_preset

METHODS = ("floor", "hal_bucketed", "hal_delta_bytes", "hal_delta_time")
DELTA_METHODS = {"hal_delta_bytes": "bytes", "hal_delta_time": "time"}
"""The two delta methods and their `DeltaConfig.choose`."""
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(kw_only=True, slots=True)
class DeltaBenchConfig:
    """What one `run_delta` call measures."""

    preset: str = "qwen2.5-0.5b"
    """A name from hal.tools.bench.presets.PRESETS: the shapes of the fp32 master weights."""
    lrs: tuple[float, ...] = (1e-6, 1e-5)
    """Adam learning rates; each runs from the same initial weights with fresh objects."""
    syncs: int = 8
    """Syncs per learning rate after the first (the anchor), each after one Adam step."""
    wire_dtype: torch.dtype = torch.bfloat16
    """`SyncConfig.wire_dtype`: the fp32 master weights travel cast to it."""
    bucket_bytes: int = 256 * MIB
    """`SyncConfig.bucket_bytes` of both hal methods."""
    anchor_every: int = 16
    """`DeltaConfig.anchor_every`: a sync that lands on it is whole and is counted as an anchor."""
    baseline: str = "device"
    """`DeltaConfig.baseline`."""
    link_gb_per_s: float | None = None
    """Emulate a link of this many GB/s for every method (`_Link` in hal.tools.bench.delta_rank); None: the transport as it is."""
    init_std: float = 0.02
    """Standard deviation of the initial matrices and biases (Qwen2's initializer_range)."""
    grad_std: float = 1.0
    """Standard deviation of the random gradients (Adam is invariant to it, up to its eps)."""
    seed: int = 0
    threads: int = 1
    """torch intra-op threads per process during the syncs (as hal.tools.bench.transfer)."""
    update_threads: int = 2
    """torch threads of the sender's (untimed) Adam step; the receiver waits meanwhile."""
    timeout_s: float = 1800.0
    """Deadline for the whole run; past it every process is killed."""
    collective_timeout_s: float = 300.0
    """Timeout of the gloo group and of hal's SyncConfig (a barrier spans an Adam step)."""
    verify: bool = True
    """Check the hal methods' bytes against the floor's after every sync (not timed)."""

    def __post_init__(self) -> None:
        get_preset(self.preset)
        if not self.lrs or any(not (isinstance(lr, float) and lr > 0) for lr in self.lrs):
            raise ValueError(f"lrs must be positive floats, got {self.lrs!r}")
        if not isinstance(self.syncs, int) or self.syncs < 1:
            raise ValueError(f"syncs must be an int of at least 1, got {self.syncs!r}")
        if self.wire_dtype not in WIRE_DTYPES.values():
            raise ValueError(f"wire_dtype must be one of {list(WIRE_DTYPES.values())}, got {self.wire_dtype!r}")
        if self.bucket_bytes < 4096:
            raise ValueError(f"bucket_bytes must be at least 4096, got {self.bucket_bytes}")
        if self.threads < 1 or self.update_threads < 1:
            raise ValueError("threads and update_threads must be at least 1")
        if not (self.init_std > 0 and self.grad_std > 0):
            raise ValueError("init_std and grad_std must be positive")
        if self.timeout_s <= 0 or self.collective_timeout_s <= 0:
            raise ValueError("timeout_s and collective_timeout_s must be positive")
        if self.link_gb_per_s is not None and not self.link_gb_per_s > 0:
            raise ValueError(f"link_gb_per_s must be positive or None, got {self.link_gb_per_s!r}")
