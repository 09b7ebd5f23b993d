"""Pack, unpack, cast and checksum tensors in flat byte buckets.

Reference implementations in torch, run as device work through the Backend contract
(`backend.copy_` / `backend.launch`), so they are asynchronous on CUDA, NPU and the
simulated accelerator and ordered by the stream they are given.

A bucket is a flat uint8 tensor. Each piece occupies `[offset, offset + nbytes)`;
offsets are multiples of `ALIGNMENT` so that any dtype can be viewed in place.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hal.backend import Backend, Stream

# Every piece starts at a multiple of this: covers every element size and the
# 128/256-byte alignment collective and DMA engines prefer.
ALIGNMENT = 256


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError(f"as_bytes: tensor of shape {tuple(tensor.shape)} is not contiguous")
    return tensor.reshape(-1).view(torch.uint8)


def typed_view(bucket: torch.Tensor, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero-copy view of `bucket[offset:]` as a tensor of `shape` and `dtype`."""
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    if offset % dtype.itemsize:
        raise ValueError(f"typed_view: offset {offset} is not aligned to {dtype} ({dtype.itemsize} bytes)")
    if offset + nbytes > bucket.numel():
        raise ValueError(f"typed_view: {nbytes} bytes at offset {offset} overrun a bucket of {bucket.numel()} bytes")
    return bucket[offset : offset + nbytes].view(dtype).view(tuple(shape))


def pack_into(
    backend: Backend,
    bucket: torch.Tensor,
    offset: int,
    tensor: torch.Tensor,
    wire_dtype: torch.dtype,
    *,
    stream: Stream | None = None,
) -> None:
    """Copy `tensor` into `bucket` at `offset`, cast to `wire_dtype` on the way."""
    dst = typed_view(bucket, offset, tensor.shape, wire_dtype)
    backend.copy_(dst, tensor, stream=stream)


def pack_range_into(
    backend: Backend,
    bucket: torch.Tensor,
    offset: int,
    tensor: torch.Tensor,
    wire_dtype: torch.dtype,
    tensor_offset: int,
    nbytes: int,
    *,
    stream: Stream | None = None,
) -> None:
    """Copy the wire bytes `[tensor_offset, tensor_offset + nbytes)` of a contiguous `tensor`,
    cast to `wire_dtype` on the way, into `bucket` at `offset`.

    Offsets count bytes of the tensor as it is on the wire (in `wire_dtype`), so a range
    of an fp32 tensor sent as bf16 reads half as many bytes of the source. Both ends must
    fall on whole wire elements.
    """
    size = wire_dtype.itemsize
    if tensor_offset % size or nbytes % size:
        raise ValueError(f"pack_range_into: range [{tensor_offset}, {tensor_offset + nbytes}) splits a {wire_dtype} element")
    first, count = tensor_offset // size, nbytes // size
    if first + count > tensor.numel():
        raise ValueError(f"pack_range_into: range of {count} elements at {first} overruns a tensor of {tensor.numel()}")
    dst = typed_view(bucket, offset, (count,), wire_dtype)
    backend.copy_(dst, tensor.reshape(-1)[first : first + count], stream=stream)


def checksum(data: torch.Tensor) -> torch.Tensor:
    """A cheap order-sensitive checksum of a flat uint8 tensor: a 0-d int64 tensor on its device.

    Sums the 64-bit words of each 4 KiB block (wrapping on overflow), then weights each
    block sum by its block index: one read of memory, no full-size temporary. It catches stale,
    zeroed, truncated and shifted data; it is not a cryptographic hash.
    """
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"checksum: expected a flat uint8 tensor, got {data.dtype} of shape {tuple(data.shape)}")
    n_blocks = data.numel() // _BLOCK_BYTES
    full = n_blocks * _BLOCK_BYTES
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    if n_blocks:
        block_sums = data[:full].view(torch.int64).view(n_blocks, -1).sum(dim=1)
        weights = torch.arange(1, n_blocks + 1, device=data.device, dtype=torch.int64)
        total = total + (block_sums * weights).sum()
    if full != data.numel():
        tail = data[full:].to(torch.int64)
        weights = torch.arange(1, tail.numel() + 1, device=data.device, dtype=torch.int64)
        total = total + (tail * weights).sum() * 7919
    return total


_BLOCK_BYTES = 4096


def checksums_into(out: torch.Tensor, bucket: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> None:
    """Write the checksum of each `(offset, nbytes)` range of `bucket` into `out[i]` (int64)."""
    for i, (offset, nbytes) in enumerate(ranges):
        out[i] = checksum(bucket[offset : offset + nbytes])


# ---- delta encoding ------------------------------------------------------------------
# A segment's new bytes against the bytes the receiver already holds (the baseline), in
# words of `word` bytes (the smallest element size in the segment, so a changed element
# is one or more whole words). Payload layouts (all offsets 8-aligned):
#   INDICES: [count int64][count int32 word indices, padded to 8][count values]
#   BITMASK: [count int64][ceil(words / 8) bytes, bit i = word i changed, padded to 8][count values]
DENSE, INDICES, BITMASK = 0, 1, 2
_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def word_view(data: torch.Tensor, word: int) -> torch.Tensor:
    """A flat uint8 tensor seen as integer words of `word` bytes (bit patterns: -0.0 differs from 0.0, NaN equals itself)."""
    if word not in _WORD_DTYPES or data.numel() % word:
        raise ValueError(f"word_view: {data.numel()} bytes are not whole words of {word} byte(s)")
    return data.view(_WORD_DTYPES[word])


def delta_sizes(words: int, changed: int, word: int) -> dict[int, int]:
    """Payload bytes of each encoding of `changed` of `words` words (DENSE: the segment itself)."""
    return {
        DENSE: words * word,
        INDICES: 8 + align_up(4 * changed, 8) + changed * word,
        BITMASK: 8 + align_up(-(-words // 8), 8) + changed * word,
    }


def delta_encode(new: torch.Tensor, base: torch.Tensor, word: int) -> tuple[int, torch.Tensor | None, int]:
    """(encoding, payload, changed words) of the flat uint8 `new` against `base`.

    DENSE (payload None) when no encoding is smaller than the segment. The payload is a
    fresh uint8 tensor on `new`'s device; nothing is written to `new` or `base`.
    """
    if new.numel() != base.numel():
        raise ValueError(f"delta_encode: new has {new.numel()} bytes, base {base.numel()}")
    if new.numel() == 0:
        return DENSE, None, 0
    a, b = word_view(new, word), word_view(base, word)
    changed_mask = a != b
    changed = int(changed_mask.sum())
    sizes = delta_sizes(a.numel(), changed, word)
    encoding = min(sizes, key=lambda e: (sizes[e], e))
    if encoding == DENSE:
        return DENSE, None, changed
    payload = torch.empty(sizes[encoding], dtype=torch.uint8, device=new.device)
    payload[:8].view(torch.int64)[0] = changed
    values_at = sizes[encoding] - changed * word
    if encoding == INDICES:
        idx = changed_mask.nonzero().flatten()
        payload[8 : 8 + 4 * changed].view(torch.int32).copy_(idx)
        values = a[idx]
    else:
        bits = torch.zeros(align_up(a.numel(), 8), dtype=torch.uint8, device=new.device)
        bits[: a.numel()] = changed_mask
        payload[8 : 8 + bits.numel() // 8] = (bits.view(-1, 8) * _BIT_WEIGHTS.to(new.device)).sum(dim=1, dtype=torch.uint8)
        values = a[changed_mask]
    if changed:
        payload[values_at:].view(a.dtype).copy_(values)
    return encoding, payload, changed


def delta_apply(target: torch.Tensor, payload: torch.Tensor, encoding: int, word: int) -> int:
    """Write the changed words of `payload` into the flat uint8 `target` (the old bytes
    before, the new bytes after); returns how many words changed. ValueError for a payload
    that does not fit `target` (nothing is written then)."""
    t = word_view(target, word)
    n = t.numel()
    if payload.numel() < 8:
        raise ValueError(f"delta payload of {payload.numel()} bytes has no count")
    changed = int(payload[:8].view(torch.int64)[0])
    expected = delta_sizes(n, changed, word).get(encoding) if encoding in (INDICES, BITMASK) else None
    if expected is None or not 0 <= changed <= n or payload.numel() != expected:
        raise ValueError(f"delta payload of {payload.numel()} bytes (encoding {encoding}, {changed} changed) does not fit {n} words of {word} byte(s)")
    if changed == 0:
        return 0
    values = payload[expected - changed * word :].view(t.dtype)
    if encoding == INDICES:
        idx = payload[8 : 8 + 4 * changed].view(torch.int32).long()
        if int(idx.min()) < 0 or int(idx.max()) >= n:
            raise ValueError(f"delta payload indexes outside the segment's {n} words")
        t[idx] = values
    else:
        packed = payload[8 : 8 + align_up(-(-n // 8), 8)][: -(-n // 8)]
        bits = ((packed.unsqueeze(1) & _BIT_WEIGHTS.to(packed.device)) != 0).flatten()[:n]
        if int(bits.sum()) != changed:
            raise ValueError(f"delta payload's bitmask marks {int(bits.sum())} words, its count says {changed}")
        t.masked_scatter_(bits, values)
    return changed
