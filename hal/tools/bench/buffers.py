"""Synthetic weights in one flat byte buffer: where each tensor sits, its views, and the
deterministic byte pattern a sender fills it with and a receiver checks it against.

Used by hal.tools.bench.transfer, hal.tools.bench.delta and hal.tools.bench.device_transfer.
"""

from __future__ import annotations

from typing import Any

import torch

from hal.tools.bench.presets import Param

PATTERN_PERIOD = 1_048_573  # a prime number of bytes: a tensor at a wrong offset does not match by accident


def flat_layout(params: list[Param]) -> tuple[list[int], int]:
    """Byte offset of each parameter in a flat buffer (each aligned to its dtype), and the total."""
    offsets, cursor = [], 0
    for p in params:
        align = p.dtype.itemsize
        cursor = (cursor + align - 1) // align * align
        offsets.append(cursor)
        cursor += p.nbytes
    return offsets, cursor


def flat_views(flat: torch.Tensor, params: list[Param], offsets: list[int]) -> list[torch.Tensor]:
    """One view into `flat` per parameter, at its offset, with its dtype and shape."""
    return [flat[o : o + p.nbytes].view(p.dtype).view(p.shape) for p, o in zip(params, offsets)]


def fill_pattern(flat: torch.Tensor, seed: int = 0) -> None:
    """Deterministic pseudo-random bytes at memcpy speed: a random block of a prime length, tiled.

    Byte i is `block[i % period]`, so `matches_pattern` can check a buffer without a
    second copy of the weights, and a tensor landing at a wrong offset shows.
    """
    n = flat.numel()
    period = min(PATTERN_PERIOD, n)
    flat[:period] = pattern_block(period, seed)
    filled = period
    while filled < n:
        step = min(filled, n - filled)
        flat[filled : filled + step].copy_(flat[:step])
        filled += step


def pattern_block(period: int, seed: int) -> torch.Tensor:
    """The pattern's first `period` bytes (the block `fill_pattern` tiles)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (period,), dtype=torch.uint8, generator=gen)


def matches_pattern(flat: torch.Tensor, seed: int = 0) -> bool:
    """Whether `flat` holds exactly what `fill_pattern` writes: the first block, then every
    byte equal to the one a period earlier (memcmp speed; torch.equal is 20x slower here)."""
    n = flat.numel()
    period = min(PATTERN_PERIOD, n)
    block = pattern_block(period, seed)
    return bytes_equal(flat[:period], block) and (n == period or bytes_equal(flat[period:], flat[: n - period]))


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality of two contiguous uint8 CPU tensors of the same length, via libc memcmp."""
    global _memcmp
    if a.numel() != b.numel():
        return False
    if _memcmp is None:
        import ctypes

        fn = ctypes.CDLL(None).memcmp
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        _memcmp = fn
    return a.numel() == 0 or _memcmp(a.data_ptr(), b.data_ptr(), a.numel()) == 0


_memcmp: Any = None


def first_mismatch(flat: torch.Tensor, params: list[Param], offsets: list[int], seed: int = 0) -> str:
    """The name of the first parameter whose bytes differ from the pattern (for the error message)."""
    n = flat.numel()
    period = min(PATTERN_PERIOD, n)
    block = pattern_block(period, seed)
    for p, o in zip(params, offsets):
        for start in range(o, o + p.nbytes, period):
            stop = min(start + period, o + p.nbytes)
            phase = start % period
            want = torch.cat([block[phase:], block[:phase]])[: stop - start]
            if not torch.equal(flat[start:stop], want):
                return p.name
    return "(none)"
