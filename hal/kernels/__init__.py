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
