"""`hal bench --delta-kernels`: the delta kernels' speed on this backend, one segment at a time.

    VERL_DEVICE=cuda hal bench --delta-kernels --segment-mb 32 --json kernels.json

For one segment of random bytes on the current backend's device and each share of its
words changed (`fractions`): `kernels.delta_encode` (compare with the baseline, count,
build the payload), `delta_check` and `delta_apply` (into a copy of the old bytes),
each timed from a device synchronize to a device synchronize, the best of `repeats`;
and a plain copy of the segment for scale. Every apply is checked to rebuild the new
bytes exactly. What it answers: how many bytes per second this device compares and
patches, against the link a sync crosses. `DeltaConfig(choose="time")` measures the
same thing during syncs (docs/delta.md); this shows it without a sync, on any backend,
so a machine with an accelerator can be characterised in one command.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from hal import kernels

MIB = 1 << 20
ENCODINGS = {kernels.DENSE: "dense", kernels.INDICES: "indices", kernels.BITMASK: "bitmask"}


@dataclass(kw_only=True, slots=True)
class KernelBenchConfig:
    """What one `run_delta_kernels` call measures."""

    segment_bytes: int = 32 * MIB
    """Bytes of the segment (`SyncConfig.segment_bytes`, 32 MiB by default)."""
    fractions: tuple[float, ...] = (0.0, 0.01, 0.03, 0.1, 0.2, 0.5, 1.0)
    """Shares of the segment's words changed, one measurement each."""
    word: int = 2
    """Word size in bytes (2: bf16 or fp16 weights; 1: fp8)."""
    repeats: int = 7
    """Timed runs per kernel; the fastest is reported (after one untimed warm-up)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.word not in (1, 2, 4, 8):
            raise ValueError(f"word must be 1, 2, 4 or 8 bytes, got {self.word!r}")
        if not isinstance(self.segment_bytes, int) or self.segment_bytes < 64 * self.word:
            raise ValueError(f"segment_bytes must be an int of at least {64 * self.word}, got {self.segment_bytes!r}")
        if not self.fractions or any(not 0.0 <= f <= 1.0 for f in self.fractions):
            raise ValueError(f"fractions must be shares between 0 and 1, got {self.fractions!r}")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats must be an int of at least 1, got {self.repeats!r}")


def run_delta_kernels(config: KernelBenchConfig, backend: Any = None) -> dict[str, Any]:
    """Measure the kernels; returns {"mode", "backend", "device", "config", "copy_ms", "results"}."""
    import hal

    backend = backend or hal.current()
    words = config.segment_bytes // config.word
    nbytes = words * config.word
    gen = torch.Generator().manual_seed(config.seed)
    base = _on_device(backend, torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
    scratch = backend.empty(nbytes)
    copy_ms = _best(backend, config.repeats, lambda: backend.copy_(scratch, base))
    results = []
    for fraction in config.fractions:
        hit = torch.rand(words, generator=gen) < fraction
        flips = torch.zeros((words, config.word), dtype=torch.uint8)
        flips[hit, 0] = 1  # the word's first byte changes: the word differs
        new = base.clone()
        new ^= _on_device(backend, flips.view(-1))
        out: dict[str, Any] = {}

        def encode() -> None:
            out["result"] = kernels.delta_encode(new, base, config.word)

        encode_ms = _best(backend, config.repeats, encode)
        encoding, payload, changed = out["result"]
        row: dict[str, Any] = {
            "fraction": fraction,
            "changed_fraction": changed / words,
            "encoding": ENCODINGS[encoding],
            "payload_ratio": 1.0 if payload is None else payload.numel() / nbytes,
            "encode_ms": encode_ms,
            "encode_gb_per_s": nbytes / encode_ms / 1e6 if encode_ms > 0 else None,
            "check_ms": None,
            "apply_ms": None,
            "apply_gb_per_s": None,
        }
        if payload is not None:
            row["check_ms"] = _best(backend, config.repeats, lambda: kernels.delta_check(payload, encoding, words, config.word))
            targets = [base.clone() for _ in range(config.repeats + 1)]  # a fresh old copy per run, made untimed
            runs = iter(targets)
            row["apply_ms"] = _best(backend, config.repeats, lambda: kernels.delta_apply(next(runs), payload, encoding, config.word))
            row["apply_gb_per_s"] = nbytes / row["apply_ms"] / 1e6 if row["apply_ms"] > 0 else None
            if not all(torch.equal(t, new) for t in targets):
                raise RuntimeError(f"delta_apply did not rebuild the new bytes at {fraction:g} of the words changed")
        results.append(row)
    cfg = asdict(config)
    cfg["fractions"] = list(config.fractions)
    return {
        "mode": "delta-kernels",
        "backend": backend.name,
        "device": str(base.device),
        "device_model": backend.device_model(),
        "torch_threads": torch.get_num_threads(),
        "config": cfg,
        "segment_bytes": nbytes,
        "copy_ms": copy_ms,
        "copy_gb_per_s": nbytes / copy_ms / 1e6 if copy_ms > 0 else None,
        "timing": f"best of {config.repeats} after a warm-up, device-synchronized before and after each run",
        "results": results,
    }


def _on_device(backend: Any, host: torch.Tensor) -> torch.Tensor:
    out = backend.empty(host.numel())
    backend.copy_(out, host)
    backend.synchronize()
    return out


def _best(backend: Any, repeats: int, fn: Callable[[], Any]) -> float:
    """Milliseconds of the fastest of `repeats` runs of `fn`, after one untimed warm-up."""
    fn()
    backend.synchronize()
    best = float("inf")
    for _ in range(repeats):
        backend.synchronize()
        t0 = time.perf_counter()
        fn()
        backend.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def format_table(report: dict[str, Any]) -> str:
    def num(v: float | None, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        f"delta kernels on {report['backend']} ({report['device_model'] or report['device']}), one segment of "
        f"{report['segment_bytes'] / MIB:g} MiB, {report['config']['word']}-byte words, {report['torch_threads']} torch "
        f"thread(s); {report['timing']}",
        f"copy of the segment: {num(report['copy_ms'])} ms ({num(report['copy_gb_per_s'], '.1f')} GB/s)",
        f"{'changed':>8} {'encoding':>8} {'payload':>8} {'encode ms':>9} {'GB/s':>6} {'check ms':>8} {'apply ms':>8} {'GB/s':>6}",
    ]
    for r in report["results"]:
        lines.append(
            f"{r['changed_fraction']:>8.2%} {r['encoding']:>8} {r['payload_ratio']:>8.3f} {num(r['encode_ms']):>9} "
            f"{num(r['encode_gb_per_s'], '.1f'):>6} {num(r['check_ms']):>8} {num(r['apply_ms']):>8} {num(r['apply_gb_per_s'], '.1f'):>6}"
        )
    lines.append("(GB/s: segment bytes per second; payload: its bytes over the segment's; a dense segment has no check or apply)")
    return "\n".join(lines)
