"""What `hal bench --senders M --receivers K` runs (hal.tools.bench.senders) and the rows each
trainer rank holds, from the preset alone: shared by the parent and its ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hal.tools.bench.presets import Param, get_preset

METHODS = ("sharded", "one_sender", "plain_sender")


class ShareError(RuntimeError):
    """What a trainer rank sent is not its share of the model (or the shares are not the model)."""


@dataclass(kw_only=True, slots=True)
class SendersConfig:
    """What one `run_senders` call measures."""

    preset: str
    """A name from hal.tools.bench.presets.PRESETS."""
    senders: int = 2
    """Trainer ranks (M): ranks 0..M-1, the model sharded over them."""
    receivers: int = 2
    """Receiver processes (K): ranks M..M+K-1."""
    methods: tuple[str, ...] = METHODS
    """`sharded` (M senders), `one_sender` (1 sender, the same path) and `plain_sender`
    (1 sender, hal.sync's Sender / Receiver), in the order they set up."""
    repeats: int = 5
    warmup: int = 1
    bucket_bytes: int | None = None
    """SyncConfig.bucket_bytes of every sender (None: each picks its own, hal's default)."""
    timeout_s: float = 600.0
    """Deadline for the whole run; past it every process is killed."""
    collective_timeout_s: float = 60.0
    """Timeout of the gloo groups, of hal's SyncConfig and of the receivers."""
    verify: bool = True
    """Check every receiver's bytes after every sync (not timed)."""
    threads: int = 1
    """torch intra-op threads per process."""
    sync_backend: str = "cpu"
    """The backend hal's syncs run on (cpu or sim; the weights are in host memory either way)."""
    tp: int | None = None
    """None: the trainer ranks hold FSDP2's Shard(0) rows. T: a Megatron-shaped layout of
    T tensor-parallel ranks x M / T pipeline stages (hal.tools.bench.senders_megatron):
    row and column blocks under Hugging Face names, norms replicated over TP."""

    def __post_init__(self) -> None:
        for p in get_preset(self.preset).params():
            if not p.shape:
                raise ValueError(f"preset {self.preset!r}: parameter {p.name!r} is 0-d: nothing to shard by rows")
        if self.sync_backend not in ("cpu", "sim"):
            raise ValueError(f"sync_backend: {self.sync_backend!r} is not a host-memory backend; choose cpu or sim")
        if not isinstance(self.senders, int) or self.senders < 1:
            raise ValueError(f"senders must be at least 1, got {self.senders!r}")
        if not isinstance(self.receivers, int) or self.receivers < 1:
            raise ValueError(f"receivers must be at least 1, got {self.receivers!r}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods or len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods: {list(self.methods)}; choose distinct ones of {', '.join(METHODS)}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {self.repeats}")
        if self.warmup < 0:
            raise ValueError(f"warmup must not be negative, got {self.warmup}")
        if self.bucket_bytes is not None and self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if self.timeout_s <= 0 or self.collective_timeout_s <= 0:
            raise ValueError("timeout_s and collective_timeout_s must be positive")
        if self.tp is not None and (not isinstance(self.tp, int) or self.tp < 1 or self.senders % self.tp):
            raise ValueError(f"tp must divide senders (M = TP x PP): tp {self.tp!r}, senders {self.senders}")

    @property
    def pp(self) -> int:
        """Pipeline stages of the Megatron-shaped layout (1 without one)."""
        return self.senders // self.tp if self.tp else 1

    @property
    def world_size(self) -> int:
        return self.senders + self.receivers

    def participants(self, method: str) -> list[int]:
        """The ranks that take part in a sync of `method` (the others wait at the barriers)."""
        receivers = list(range(self.senders, self.world_size))
        return (list(range(self.senders)) if method == "sharded" else [0]) + receivers


# ---------------------------------------------------------------------------------------
# the rows each trainer rank holds, from the preset alone


_CHUNKS: dict[tuple[int, int], list[tuple[int, int]]] = {}


def chunk_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of each of `parts` ranks' rows of a `rows`-row tensor, as `torch.chunk`
    (FSDP2's Shard(0)) splits it: torch.chunk itself, on a meta tensor (it may return
    fewer than `parts` chunks: the last ranks then hold no rows)."""
    key = (rows, parts)
    if key not in _CHUNKS:
        sizes = [c.shape[0] for c in torch.empty(rows, device="meta").chunk(parts)]
        bounds, lo = [], 0
        for i in range(parts):
            hi = lo + (sizes[i] if i < len(sizes) else 0)
            bounds.append((lo, hi))
            lo = hi
        _CHUNKS[key] = bounds
    return _CHUNKS[key]


def row_nbytes(p: Param) -> int:
    return p.nbytes // p.shape[0] if p.shape[0] else 0
