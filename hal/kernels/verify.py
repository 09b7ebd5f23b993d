"""Checksums of byte ranges in flat buckets (a verified sync's): each piece's, all of a
bucket's at once.

A checksum is the sum, wrapping on overflow, of a range's 64-bit words (the last one
zero-padded), each weighted by its 4 KiB block's index plus one. It catches stale,
zeroed and shifted data and blocks out of order; it is not a cryptographic hash.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

_WORDS_PER_BLOCK = 512  # 4 KiB
# A check's temporary: one int64 per group of words of a window, at most this many bytes
# (for ranges on 8-byte boundaries only: a group is one word, the window this size).
_WINDOW_BYTES = 32 << 20


def checksum(data: torch.Tensor) -> torch.Tensor:
    """A cheap order-sensitive checksum of a flat uint8 tensor: a 0-d int64 tensor on its device.

    The sum, wrapping on overflow, of the tensor's 64-bit words (the last one zero-padded
    when the length is not a multiple of 8), each weighted by its 4 KiB block's index
    plus one: one read of memory, no full-size temporary. It catches stale, zeroed and
    shifted data and blocks out of order; it is not a cryptographic hash.
    """
    _check_flat_bytes("checksum", data)
    return _checksum_from(data, 0)


def checksums(data: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """`checksum(data[o : o + n])` for every `(o, n)` in `ranges`, as an int64 tensor on
    `data`'s device, in a fixed number of tensor operations per window of the data however
    many ranges there are. Offsets must be multiples of 8 (a plan's pieces start on
    ALIGNMENT boundaries). A sync checksums the same ranges every time: it keeps a
    `RangeChecksums` instead, which does the index work once."""
    _check_flat_bytes("checksums", data)
    return RangeChecksums(ranges, data.device).compute(data)


class RangeChecksums:
    """The checksums of fixed byte ranges of a flat bucket, planned once for a device.

    A range of words [s, e) in J blocks has the checksum `J * P[e] - sum(P[s + 512 j] for
    j < J)`, where P is the prefix sum of the bucket's 64-bit words: the per-block weights
    telescope. P is only needed where blocks start, which are multiples of the words all
    ranges start on (256 B in a plan), so it is taken over sums of such groups of words:
    one read of the bucket (a window at a time, so the temporary is small) and a short
    prefix sum, then two gathers. Every index they need is computed here once and kept
    on the device (16 bytes per 4 KiB block): a steady sync's check is a few launches per
    window and no host work per range. A range's end between groups adds its last words
    one by one; a partial last word is zero-padded, as `checksum` does.

    `newer_at`: the bytes from there on are read from a second tensor (`into`'s `newer`,
    which starts there); a multiple of 8.
    """

    def __init__(
        self, ranges: Sequence[tuple[int, int]], device: torch.device | str, newer_at: int | None = None, window_bytes: int = _WINDOW_BYTES
    ) -> None:
        self.device = torch.device(device)
        self.count = len(ranges)
        self.newer_at = newer_at
        spans = torch.tensor(list(ranges), dtype=torch.int64).reshape(-1, 2)
        offsets, sizes = spans[:, 0], spans[:, 1]
        if self.count and (bool((offsets % 8).any()) or bool((offsets < 0).any()) or bool((sizes < 0).any())):
            raise ValueError(f"checksums: ranges must start on 8-byte boundaries, got {list(ranges)[:5]}")
        if window_bytes <= 0 or window_bytes % 8:
            raise ValueError(f"checksums: window_bytes must be a positive multiple of 8, got {window_bytes}")
        if newer_at is not None and (newer_at < 0 or newer_at % 8):
            raise ValueError(f"checksums: newer_at must be a non-negative multiple of 8, got {newer_at}")
        self.end = int((offsets + sizes).max()) if self.count else 0
        cut = self.end if newer_at is None else min(newer_at, self.end)
        self.needs = (cut, self.end - cut)  # the bytes each source must hold: the data's, the newer ones'
        self._cut_word = cut // 8
        first, words = offsets // 8, sizes // 8
        stop = first + words
        blocks = (words + _WORDS_PER_BLOCK - 1) // _WORDS_PER_BLOCK
        has = blocks > 0
        last_word = int(stop[has].max()) if bool(has.any()) else 0
        # the group: words every block start and the cut fall on a multiple of
        group = math.gcd(_WORDS_PER_BLOCK, *first[has].tolist(), *([self._cut_word] if self.needs[1] else [])) if last_word else 1
        self.group = group
        # windows of whole groups (the last may end in a part of one), none across the cut;
        # the temporary is a window's group sums, so a window spans `group` times the bytes
        span = window_bytes // 8 * group
        self.windows: list[tuple[int, int]] = []
        for lo, hi in ((0, min(self._cut_word, last_word)), (self._cut_word, last_word)):
            self.windows += [(w, min(w + span, hi)) for w in range(lo, hi, span)]
        self.prefix_len = max(((hi - lo) // group for lo, hi in self.windows), default=0) + 1
        starts_at = torch.tensor([lo for lo, _ in self.windows], dtype=torch.int64)
        rows, block = _runs(torch.arange(self.count), blocks)
        ranges_with = torch.arange(self.count)[has]
        end_group = stop[has] // group * group
        # every block's start (P there, subtracted) and every range's end (J times P there)
        self._starts = self._by_window(first[rows] + block * _WORDS_PER_BLOCK, rows, None, starts_at)
        self._ends = self._by_window(end_group, ranges_with, blocks[has], starts_at)
        # the words of a range's end past its last whole group, J times each
        self._loose = []
        loose = stop[has] - end_group
        if bool((loose > 0).any()):
            row, step = _runs(ranges_with, loose)
            word = torch.repeat_interleave(end_group, loose) + step
            times = torch.repeat_interleave(blocks[has], loose)
            for newer in (False, True):
                pick = (word >= self._cut_word) if newer else (word < self._cut_word)
                if bool(pick.any()):
                    moved = (word[pick] - (self._cut_word if newer else 0), row[pick], times[pick])
                    self._loose.append((newer, *(t.to(self.device) for t in moved)))
        # a partial last word's bytes, gathered into zeroed words, weighed by its block
        self._tails = []
        tails = torch.nonzero(sizes % 8).flatten()
        if tails.numel():
            at = stop[tails] * 8
            for newer in (False, True):
                pick = (at >= cut) if newer else (at < cut)
                if not bool(pick.any()):
                    continue
                which = tails[pick]
                lanes = torch.arange(8)
                keep = lanes < (sizes[which] % 8)[:, None]
                source = (at[pick][:, None] + lanes)[keep] - (cut if newer else 0)
                slot = (torch.arange(which.numel())[:, None] * 8 + lanes)[keep]
                weight = words[which] // _WORDS_PER_BLOCK + 1
                self._tails.append((newer, which.numel(), *(t.to(self.device) for t in (source, slot, which, weight))))

    def _by_window(
        self, word_at: torch.Tensor, rows: torch.Tensor, times: torch.Tensor | None, starts_at: torch.Tensor
    ) -> list[tuple[torch.Tensor, ...] | None]:
        """Per window, the (index into its group prefix sum, row[, multiplier]) of the
        positions in it; a position on a window's end is read from the next (the last
        one's: from it)."""
        out: list[tuple[torch.Tensor, ...] | None] = [None] * len(self.windows)
        if not self.windows or not word_at.numel():
            return out
        window = torch.searchsorted(starts_at, word_at, right=True) - 1
        order = torch.argsort(window, stable=True)
        window = window[order]
        moved = [(word_at[order] - starts_at[window]) // self.group, rows[order]] + ([] if times is None else [times[order]])
        # int64, the index type every backend's gathers take (int32 would halve the memory,
        # but out-of-tree devices have lagged in accepting it)
        moved = [t.to(self.device) for t in moved]
        ids, counts = torch.unique_consecutive(window, return_counts=True)
        at = 0
        for i, n in zip(ids.tolist(), counts.tolist()):
            out[i] = tuple(t[at : at + n] for t in moved)
            at += n
        return out

    def compute(self, data: torch.Tensor, newer: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(self.count, dtype=torch.int64, device=self.device)
        self.into(out, data, newer)
        return out

    def into(self, out: torch.Tensor, data: torch.Tensor, newer: torch.Tensor | None = None) -> None:
        """Write the ranges' checksums into `out` (int64, one per range, on the plan's device)."""
        _check_flat_bytes("checksums", data)
        if (newer is None) != (self.newer_at is None or self.needs[1] == 0):
            raise ValueError(f"checksums: planned with newer_at={self.newer_at}, called with{'out' if newer is None else ''} newer bytes")
        if newer is not None:
            _check_flat_bytes("checksums", newer)
        for what, tensor, need in (("data", data, self.needs[0]), ("newer bytes", newer, self.needs[1])):
            if tensor is not None and tensor.numel() < need:
                raise ValueError(f"checksums: ranges must lie inside the {tensor.numel()} bytes of the {what}, which they exceed (up to byte {need})")
        out.zero_()
        sources = (_words(data[: self.needs[0] // 8 * 8]), None if newer is None else _words(newer[: self.needs[1] // 8 * 8]))
        if self.windows:
            prefix = torch.empty(self.prefix_len, dtype=torch.int64, device=self.device)
            carry = torch.zeros((), dtype=torch.int64, device=self.device)
            for (lo, hi), starts, ends in zip(self.windows, self._starts, self._ends):
                in_newer = lo >= self._cut_word and newer is not None
                base = self._cut_word if in_newer else 0
                n = (hi - lo) // self.group
                sums = prefix[: n + 1]
                sums[0] = 0
                grouped = sources[in_newer][lo - base : lo - base + n * self.group]
                grouped = grouped if self.group == 1 else grouped.view(n, self.group).sum(dim=1)
                torch.cumsum(grouped, 0, out=sums[1:])  # wraps on overflow, as the checksum's sums do
                if starts is not None:
                    at, rows = starts
                    out.index_add_(0, rows, sums.index_select(0, at) + carry, alpha=-1)
                if ends is not None:
                    at, rows, times = ends
                    out.index_add_(0, rows, (sums.index_select(0, at) + carry) * times)
                carry = carry + sums[n]
        for in_newer, word, rows, times in self._loose:
            out.index_add_(0, rows, sources[in_newer].index_select(0, word) * times)
        for in_newer, count, at, slot, rows, weight in self._tails:
            tail = torch.zeros(count * 8, dtype=torch.uint8, device=self.device)
            tail.index_copy_(0, slot, (newer if in_newer else data).index_select(0, at))
            out.index_add_(0, rows, tail.view(torch.int64) * weight)


def _runs(owners: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each owner repeated `counts` times, and each repeat's place in its run (0, 1, ...)."""
    owner = torch.repeat_interleave(owners, counts)
    return owner, torch.arange(owner.numel()) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)


def checksum_parts(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """`checksum(torch.cat([first, second]))` without the copy, on `first`'s device. The
    parts may be on different devices. When `first` is not a whole number of words, the
    rest is put together in a temporary (never so in a sync: its seams are on ALIGNMENT)."""
    _check_flat_bytes("checksum_parts", first)
    _check_flat_bytes("checksum_parts", second)
    if first.numel() % 8:
        cut = first.numel() // 8 * 8
        rest = torch.cat([first[cut:], second.to(first.device)])
        return _checksum_from(first[:cut], 0) + _checksum_from(rest, cut // 8)
    return _checksum_from(first, 0) + _checksum_from(second, first.numel() // 8).to(first.device)


def _check_flat_bytes(what: str, data: torch.Tensor) -> None:
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"{what}: expected a flat uint8 tensor, got {data.dtype} of shape {tuple(data.shape)}")


def _words(data: torch.Tensor) -> torch.Tensor:
    """`data` (a whole number of words) as int64 words, copied only when it does not start
    on an 8-byte boundary (a view of int64 must)."""
    if data.storage_offset() % 8:
        data = data.clone()
    return data.view(torch.int64)


def _checksum_from(data: torch.Tensor, word0: int) -> torch.Tensor:
    """The checksum's terms for `data`, whose first word is word `word0` of the checksummed
    range: word w weighs (w // 512) + 1; a partial word at its end is zero-padded."""
    full = data.numel() // 8 * 8
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    if full:
        words = _words(data[:full])
        count = words.numel()
        head = min(count, -word0 % _WORDS_PER_BLOCK)  # the rest of word0's block
        if head:
            total = total + words[:head].sum() * (word0 // _WORDS_PER_BLOCK + 1)
        blocks = (count - head) // _WORDS_PER_BLOCK
        if blocks:
            sums = words[head : head + blocks * _WORDS_PER_BLOCK].view(blocks, _WORDS_PER_BLOCK).sum(dim=1)
            first = (word0 + head) // _WORDS_PER_BLOCK + 1
            total = total + (sums * torch.arange(first, first + blocks, device=data.device, dtype=torch.int64)).sum()
        done = head + blocks * _WORDS_PER_BLOCK
        if done < count:
            total = total + words[done:].sum() * ((word0 + done) // _WORDS_PER_BLOCK + 1)
    if full != data.numel():
        tail = torch.zeros(8, dtype=torch.uint8, device=data.device)
        tail[: data.numel() - full] = data[full:]
        total = total + tail.view(torch.int64)[0] * ((word0 + full // 8) // _WORDS_PER_BLOCK + 1)
    return total


def checksums_into(
    out: torch.Tensor, bucket: torch.Tensor, ranges: Sequence[tuple[int, int]], newer: torch.Tensor | None = None, newer_at: int = 0
) -> None:
    """Write the checksum of each `(offset, nbytes)` range of `bucket` into `out[i]` (int64),
    with `bucket`'s bytes from `newer_at` on taken from `newer` instead when given (a delta
    sync's sender: the bucket's new bytes are in its baseline up to the segment being packed,
    and in the pack's target from there)."""
    plan = RangeChecksums(ranges, out.device, None if newer is None else newer_at)
    plan.into(out, bucket, newer if plan.needs[1] else None)
