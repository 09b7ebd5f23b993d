"""Pack, unpack, cast and checksum tensors in flat byte buckets.

Reference implementations in torch, run as device work through the Backend contract
(`backend.copy_` / `backend.launch`), so they are asynchronous on CUDA, NPU and the
simulated accelerator and ordered by the stream they are given.

A bucket is a flat uint8 tensor. Each piece occupies `[offset, offset + nbytes)`;
offsets are multiples of `ALIGNMENT` so that any dtype can be viewed in place.

`hal.kernels.layout` holds the layout (alignment, views, packing), `hal.kernels.verify`
the checksums and `hal.kernels.delta` the delta encoding; everything is re-exported here.
"""

from hal.kernels.layout import ALIGNMENT, PieceViews, align_up, as_bytes, pack_into, pack_range_into, span_bytes, typed_view
from hal.kernels.delta import BITMASK, DENSE, INDICES, Encoding, delta_apply, delta_check, delta_encode, delta_sizes, word_view
from hal.kernels.verify import RangeChecksums, checksum, checksum_parts, checksums, checksums_into

__all__ = [
    "ALIGNMENT", "align_up", "as_bytes", "typed_view", "PieceViews", "pack_into", "pack_range_into", "span_bytes",
    "checksum", "checksums", "checksum_parts", "checksums_into", "RangeChecksums",
    "Encoding", "DENSE", "INDICES", "BITMASK", "word_view", "delta_sizes", "delta_encode", "delta_check", "delta_apply",
]
