"""Checksums of byte ranges in flat buckets (a verified sync's): each piece's, all of a
bucket's at once.

A checksum is the sum, wrapping on overflow, of a range's 64-bit words (the last one
zero-padded), each weighted by its 4 KiB block's index plus one. It catches stale,
zeroed and shifted data and blocks out of order; it is not a cryptographic hash.
"""

from __future__ import annotations

from typing import Sequence

import torch


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
    `data`'s device, in a fixed number of tensor operations however many ranges there are
    (a bucket of thousands of small tensors costs what one of a few large ones does).
    Offsets must be multiples of 8 (a plan's pieces start on ALIGNMENT boundaries)."""
    _check_flat_bytes("checksums", data)
    out = torch.zeros(len(ranges), dtype=torch.int64, device=data.device)
    if not ranges:
        return out
    spans = torch.tensor(ranges, dtype=torch.int64).reshape(-1, 2)
    offsets, sizes = spans[:, 0], spans[:, 1]
    if bool((offsets % 8).any()) or bool((offsets < 0).any()) or bool((sizes < 0).any()) or int((offsets + sizes).max()) > data.numel():
        raise ValueError(f"checksums: ranges must start on 8-byte boundaries inside the {data.numel()} bytes, got {list(ranges)[:5]}")
    large = sizes > _SMALL_RANGE_BYTES
    for i in torch.nonzero(large).flatten().tolist():  # few, since each is large: one at a time, no temporary
        o, n = ranges[i]
        out[i] = _checksum_from(data[o : o + n], 0)
    small = torch.nonzero(~large).flatten()
    if small.numel():
        # in groups of the ranges starting in one _BATCH_SPAN_BYTES window, so the one
        # temporary spans at most that plus one small range (found at once, not range by range)
        order = small[torch.argsort(offsets[small], stable=True)]
        window = (offsets[order] - offsets[order[0]]) // _BATCH_SPAN_BYTES
        _, counts = torch.unique_consecutive(window, return_counts=True)
        for rows in torch.split(order, counts.tolist()):
            out.index_copy_(0, rows.to(data.device), _small_checksums(data, offsets[rows], sizes[rows]))
    return out


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


def _small_checksums(data: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """The checksums of ranges (host int64 `offsets`, `sizes`; sorted, none overlapping)
    that lie within `_BATCH_SPAN_BYTES` of each other, from one prefix sum of their words:
    a block's sum is the difference of two prefix sums, so every block of every range
    costs two lookups, whatever its offset."""
    device = data.device
    count = offsets.numel()
    out = torch.zeros(count, dtype=torch.int64, device=device)
    words = sizes // 8
    lo = int(offsets[0])
    hi = int((offsets + words * 8).max())
    if hi > lo:
        prefix = torch.zeros((hi - lo) // 8 + 1, dtype=torch.int64, device=device)
        torch.cumsum(_words(data[lo:hi]), 0, out=prefix[1:])  # wraps on overflow, as the sums do
        blocks = (words + _WORDS_PER_BLOCK - 1) // _WORDS_PER_BLOCK
        row = torch.repeat_interleave(torch.arange(count), blocks)
        block = torch.arange(row.numel()) - torch.repeat_interleave(torch.cumsum(blocks, 0) - blocks, blocks)
        base = (offsets - lo) // 8
        start = base[row] + block * _WORDS_PER_BLOCK
        end = torch.minimum(start + _WORDS_PER_BLOCK, base[row] + words[row])
        sums = prefix[end.to(device)] - prefix[start.to(device)]
        out.index_add_(0, row.to(device), sums * (block + 1).to(device))
    tails = torch.nonzero(sizes % 8).flatten()
    if tails.numel():
        at = offsets[tails] + words[tails] * 8
        lanes = torch.arange(8)
        index = (at[:, None] + lanes).clamp(max=data.numel() - 1)
        keep = lanes < (sizes[tails] % 8)[:, None]
        tail = (data[index.to(device)] * keep.to(device)).contiguous().view(torch.int64).flatten()
        out.index_add_(0, tails.to(device), tail * (words[tails] // _WORDS_PER_BLOCK + 1).to(device))
    return out


def checksums_into(
    out: torch.Tensor, bucket: torch.Tensor, ranges: Sequence[tuple[int, int]], newer: torch.Tensor | None = None, newer_at: int = 0
) -> None:
    """Write the checksum of each `(offset, nbytes)` range of `bucket` into `out[i]` (int64),
    with `bucket`'s bytes from `newer_at` on taken from `newer` instead when given (a delta
    sync's sender: the bucket's new bytes are in its baseline up to the segment being packed,
    and in the pack's target from there). A fixed number of tensor operations: the ranges
    before `newer_at` at once, those after at once, and the one across it, if any."""
    if newer is None:
        out.copy_(checksums(bucket, ranges))
        return
    before = [i for i, (o, n) in enumerate(ranges) if o + n <= newer_at]
    after = [i for i, (o, n) in enumerate(ranges) if o >= newer_at]
    if before:
        out[before] = checksums(bucket, [ranges[i] for i in before]).to(out.device)
    if after:
        out[after] = checksums(newer, [(ranges[i][0] - newer_at, ranges[i][1]) for i in after]).to(out.device)
    for i in set(range(len(ranges))) - set(before) - set(after):
        offset, nbytes = ranges[i]
        out[i] = checksum_parts(bucket[offset:newer_at], newer[: offset + nbytes - newer_at])


_WORDS_PER_BLOCK = 512  # 4 KiB
# Ranges up to this size are checksummed together (a prefix sum over them); larger ones one
# at a time. The prefix sum is one int64 per word of a group, whose ranges start within one
# window of the second size (so it spans at most the two together).
_SMALL_RANGE_BYTES = 1 << 20
_BATCH_SPAN_BYTES = 32 << 20
