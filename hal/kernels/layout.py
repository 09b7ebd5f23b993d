"""The layout of tensors in flat byte buckets: alignment, views, and packing (with a cast)."""

from __future__ import annotations

import operator
from operator import attrgetter
from typing import Sequence

import torch

from hal.backends.interface import Backend
from hal.backends.types import Stream

# Every piece starts at a multiple of this: covers every element size and the
# 128/256-byte alignment collective and DMA engines prefer.
ALIGNMENT = 256
_dtype = attrgetter("dtype")


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


def span_bytes(tensors: Sequence[torch.Tensor], offsets: Sequence[int], nbytes: int, dtypes: Sequence[torch.dtype], device: torch.device) -> torch.Tensor | None:
    """The memory `tensors` lie in, as `nbytes` flat bytes, when they lie back to back in it
    exactly as a tight segment's pieces lie in the segment: tensor i contiguous, of dtype
    `dtypes[i]`, on `device`, at byte `offsets[i]` of one allocation's range (no copy).
    None when any of that does not hold: the caller then copies, as for any layout.
    Reading or writing the range touches those tensors' bytes and nothing else, provided
    `offsets` tile `[0, nbytes)` (a tight segment's do) and the tensors' byte sizes fit them."""
    first = tensors[0]
    if first.device != device:
        return None
    start = first.data_ptr()
    storage = first.untyped_storage()
    at = start - storage.data_ptr()  # where the range starts in the allocation
    if at < 0 or at + nbytes > storage.nbytes():
        return None
    if list(map(torch.Tensor.data_ptr, tensors)) != [start + o for o in offsets]:
        return None
    if not all(map(torch.Tensor.is_contiguous, tensors)) or not all(map(operator.is_, map(_dtype, tensors), dtypes)):
        return None
    if any(t.device != device for t in tensors):
        return None
    flat = torch.empty(0, dtype=torch.uint8, device=device)
    return flat.set_(storage, at, (nbytes,))


class PieceViews:
    """Typed views of every whole piece of a bucket inside a flat buffer, kept while the
    plan and the buffer stay the same: a sync of thousands of small tensors then makes no
    view per tensor (three view ops each, more than the copy of a small tensor costs)."""

    def __init__(self) -> None:
        self._digest: str | None = None
        self._views: dict[tuple[int, int, int], list[torch.Tensor | None]] = {}

    def of(self, plan, buffer: torch.Tensor, bucket) -> list[torch.Tensor | None]:
        """Per piece of `bucket` (by index): its typed view in `buffer` when the piece is a
        whole tensor, else None. `plan` is a hal.sync.plan.buckets.BucketPlan."""
        # a new layout drops them all; so do more (buffer, bucket) pairs than a layout has
        # use for (a few buffers per bucket): buffers were reallocated, the old keys are stale
        if plan.digest != self._digest or len(self._views) >= 4 * len(plan.buckets) + 8:
            self._digest, self._views = plan.digest, {}
        key = (buffer.data_ptr(), buffer.numel(), bucket.index)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = [
                typed_view(buffer, p.offset, p.spec.shape, p.spec.dtype) if p.is_whole else None for p in bucket.pieces
            ]
        return views


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
