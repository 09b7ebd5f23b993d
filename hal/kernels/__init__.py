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


class PieceViews:
    """Typed views of every whole piece of a bucket inside a flat buffer, kept while the
    plan and the buffer stay the same: a sync of thousands of small tensors then makes no
    view per tensor (three view ops each, more than the copy of a small tensor costs)."""

    def __init__(self) -> None:
        self._digest: str | None = None
        self._views: dict[tuple[int, int, int], list[torch.Tensor | None]] = {}

    def of(self, plan, buffer: torch.Tensor, bucket) -> list[torch.Tensor | None]:
        """Per piece of `bucket` (by index): its typed view in `buffer` when the piece is a
        whole tensor, else None. `plan` is a hal.sync.plan.BucketPlan."""
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
        # in groups spanning at most _BATCH_SPAN_BYTES, so the one temporary stays that small
        order = small[torch.argsort(offsets[small], stable=True)]
        first, group_start = 0, int(offsets[order[0]])
        ends = (offsets + sizes)[order]
        for j in range(1, order.numel() + 1):
            if j == order.numel() or int(ends[j]) - group_start > _BATCH_SPAN_BYTES:
                rows = order[first:j]
                out.index_copy_(0, rows.to(data.device), _small_checksums(data, offsets[rows], sizes[rows]))
                if j < order.numel():
                    first, group_start = j, int(offsets[order[j]])
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
# at a time. The prefix sum is one int64 per word of a group, which spans at most the second.
_SMALL_RANGE_BYTES = 1 << 20
_BATCH_SPAN_BYTES = 32 << 20


# ---- delta encoding ------------------------------------------------------------------
# A segment's new bytes against the bytes the receiver already holds (the baseline), in
# words of `word` bytes (the smallest element size in the segment, so a changed element
# is one or more whole words). Payload layouts (all offsets 8-aligned):
#   INDICES: [count int64][count int32 word indices, padded to 8][count values]
#   BITMASK: [count int64][ceil(words / 8) bytes, bit i = word i changed, padded to 8][count values]
DENSE, INDICES, BITMASK = 0, 1, 2
_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
# Entry v: the 8 bytes (0 or 1) that mask byte v stands for, bit i in byte i, held as one
# int64 (built from the bytes, so the lookup does not depend on byte order).
_BIT_SPREAD = torch.tensor([[(v >> i) & 1 for i in range(8)] for v in range(256)], dtype=torch.uint8).view(torch.int64).flatten()


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
    fresh uint8 tensor on `new`'s device, padding zeroed; nothing is written to `new` or
    `base`.

    Words narrower than 8 bytes are compared 8 bytes at a time first (`_changed_groups`):
    when at most a quarter of the 8-byte groups differ, only those are gathered and compared word
    by word, so a sparse change costs one int64 compare of the segment and work on the
    groups it touched; the bitmask is then built per group, the indices only for INDICES.
    Otherwise one comparison makes the mask of changed words, and the encoding is chosen
    from its count before anything else is made (a DENSE segment costs the compare and
    the count); indices come from `_true_indices`, the bitmask from `_pack_bits_into`.
    Indices, values and bits are written straight into the payload. docs/benchmarks.md,
    "Delta sync", has what these cost on a CPU.
    """
    if new.numel() != base.numel():
        raise ValueError(f"delta_encode: new has {new.numel()} bytes, base {base.numel()}")
    if new.numel() == 0:
        return DENSE, None, 0
    a, b = word_view(new, word), word_view(base, word)
    n = a.numel()
    groups = _changed_groups(new, base, a, b, word)
    if groups is None:
        changed_mask = torch.ne(a, b)
        changed = int(torch.count_nonzero(changed_mask))  # Tensor.sum of a bool mask is ~15x slower on a CPU
    else:
        changed = groups.changed
    sizes = delta_sizes(n, changed, word)
    encoding = min(sizes, key=lambda e: (sizes[e], e))
    if encoding == DENSE:
        return DENSE, None, changed
    payload = torch.empty(sizes[encoding], dtype=torch.uint8, device=new.device)
    payload[:8].view(torch.int64).fill_(changed)
    values_at = sizes[encoding] - changed * word
    if groups is not None:
        idx = groups.indices() if encoding == INDICES else None
        groups.values_into(payload[values_at:].view(a.dtype))
    else:
        idx = _true_indices(changed_mask, changed) if changed else None
        if idx is not None:
            torch.index_select(a, 0, idx, out=payload[values_at:].view(a.dtype))
    if encoding == INDICES:
        if idx is not None:
            payload[8 : 8 + 4 * changed].view(torch.int32).copy_(idx)
        payload[8 + 4 * changed : values_at].zero_()  # alignment padding
    elif groups is not None:
        groups.bits_into(payload[8:values_at])
    else:
        _pack_bits_into(payload[8:values_at], changed_mask)
    return encoding, payload, changed


class _ChangedGroups:
    """A segment's changed words, found 8 bytes at a time (made by `_changed_groups`).

    The segment is `groups` 8-byte groups of `per` words, then a tail of fewer than 8
    bytes. `hit`: the groups that differ (int64, ascending); `new_words`: their words in
    the new bytes; `changed_at`: which of those words changed (bool, `per` per group);
    `tail_mask` / `tail_new`: the tail's changed words and its new words (None: no tail).
    """

    __slots__ = ("per", "groups", "hit", "new_words", "changed_at", "tail_start", "tail_mask", "tail_new", "changed", "_pos")

    def __init__(
        self,
        per: int,
        groups: int,
        hit: torch.Tensor,
        new_words: torch.Tensor,
        changed_at: torch.Tensor,
        tail_start: int,
        tail_mask: torch.Tensor | None,
        tail_new: torch.Tensor | None,
    ) -> None:
        self.per, self.groups, self.hit = per, groups, hit
        self.new_words, self.changed_at = new_words, changed_at
        self.tail_start, self.tail_mask, self.tail_new = tail_start, tail_mask, tail_new
        self.changed = int(torch.count_nonzero(changed_at)) + (int(torch.count_nonzero(tail_mask)) if tail_mask is not None else 0)
        self._pos: torch.Tensor | None = None

    def positions(self) -> torch.Tensor:
        """Where the changed words are among the gathered ones (int64, ascending)."""
        if self._pos is None:
            self._pos = self.changed_at.nonzero().flatten()
        return self._pos

    def indices(self) -> torch.Tensor | None:
        """The changed words' indices in the segment (int64, ascending); None if none."""
        if not self.changed:
            return None
        pos = self.positions()
        idx = self.hit.index_select(0, pos >> (self.per.bit_length() - 1)) * self.per + (pos & (self.per - 1))
        if self.tail_mask is not None:
            idx = torch.cat([idx, self.tail_mask.nonzero().flatten() + self.tail_start])
        return idx

    def values_into(self, out: torch.Tensor) -> None:
        """The changed words' new values, in index order, into `out` (`changed` words)."""
        if not self.changed:
            return
        pos = self.positions()
        torch.index_select(self.new_words, 0, pos, out=out[: pos.numel()])
        if self.tail_mask is not None and pos.numel() < out.numel():
            torch.masked_select(self.tail_new, self.tail_mask, out=out[pos.numel() :])

    def bits_into(self, out: torch.Tensor) -> None:
        """The bitmask (bit i of byte j: word 8j + i changed) into `out`, the rest zeroed.

        Each group's `per` bits (a lane) are gathered from its `per` mask bytes; the lanes
        go into a zeroed array with one per group (the tail's last), and every 8 / per
        neighbouring lanes are merged into one byte (`_merge_lanes`)."""
        per_byte = 8 // self.per
        slots = self.groups + (1 if self.tail_mask is not None else 0)
        lanes = torch.zeros(align_up(slots, per_byte), dtype=torch.uint8, device=out.device)
        if self.hit.numel():
            lanes.index_copy_(0, self.hit, _gather_bits(self.changed_at, self.per))
        if self.tail_mask is not None:
            weights = _BIT_WEIGHTS[: self.tail_mask.numel()].to(out.device)
            lanes[self.groups] = (self.tail_mask.to(torch.uint8) * weights).sum(dtype=torch.uint8)
        packed = _merge_lanes(lanes, self.per)
        nbytes = min(packed.numel(), out.numel())
        out[:nbytes].copy_(packed[:nbytes])
        out[nbytes:].zero_()


# The signed integer dtype of 1, 2, 4, 8 bytes, for bit tricks over that many mask bytes.
_LANE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _gather_bits(mask: torch.Tensor, per: int) -> torch.Tensor:
    """uint8 per run of `per` entries of the fresh flat bool `mask`: bit i = entry i.

    The run's bytes (0 or 1 each, entry i at bit 8i of an integer of `per` bytes) are
    shift-or'ed together: x | x >> 7 puts entry i + 1 next to entry i, then >> 14 and
    >> 28 as for `_pack_bits_into`; the low byte is kept."""
    x = mask.view(torch.uint8).view(_LANE_INTS[per])
    shift = 7
    while shift < 7 * per:  # log2(per) steps: 7; 7, 14; 7, 14, 28
        x = x | (x >> shift)
        shift *= 2
    return x.to(torch.uint8) if per > 1 else x


def _merge_lanes(lanes: torch.Tensor, per: int) -> torch.Tensor:
    """uint8 `lanes` of `per` bits each (a length that is a multiple of 8 / per), merged
    8 / per at a time into bytes: lane k at bits per * k of its byte."""
    if per == 8:
        return lanes
    x = lanes.view(_LANE_INTS[8 // per])  # lane k at bit 8k
    shift = 8 - per
    while shift < 8 * (8 // per) - 8:  # log2(8 / per) steps: 4 (per 4); 6, 12 (per 2)
        x = x | (x >> shift)
        shift *= 2
    return x.to(torch.uint8)


def _changed_groups(new: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, word: int) -> _ChangedGroups | None:
    """The changed words of `a` (the word view of `new`) against `b`, found by comparing
    8-byte groups first. None where that does not apply (8-byte words, bytes not 8-byte
    aligned) or does not pay: more than a quarter of the groups differ (in every 64th
    group, for a segment of 4096 groups or more, before all are compared), or so many that the
    segment goes DENSE even with one changed word in each (the caller then counts with
    one word compare)."""
    if word >= 8 or new.storage_offset() % 8 or base.storage_offset() % 8:
        return None
    per = 8 // word
    full = new.numel() // 8 * 8
    groups = full // 8
    n = a.numel()
    tail_start = groups * per
    tail_mask = tail_new = None
    if tail_start < n:
        tail_new = a[tail_start:]
        tail_mask = torch.ne(tail_new, b[tail_start:])
    g_new, g_base = new[:full].view(torch.int64), base[:full].view(torch.int64)
    if groups >= 1 << 12 and 4 * int(torch.count_nonzero(torch.ne(g_new[::64], g_base[::64]))) > -(-groups // 64):
        return None  # over a quarter of a sample of the groups differ: so will the rest (skips the int64 compare)
    differ = torch.ne(g_new, g_base)
    hits = int(torch.count_nonzero(differ))
    least = hits + (int(torch.count_nonzero(tail_mask)) if tail_mask is not None else 0)
    sizes = delta_sizes(n, least, word)
    if 4 * hits > groups or min(sizes, key=lambda e: (sizes[e], e)) == DENSE:
        return None
    hit = differ.nonzero().flatten()
    new_words = g_new.index_select(0, hit).view(a.dtype)
    changed_at = torch.ne(new_words, g_base.index_select(0, hit).view(a.dtype))
    return _ChangedGroups(per, groups, hit, new_words, changed_at, tail_start, tail_mask, tail_new)


def _true_indices(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The positions of the `count` True entries of the flat bool `mask`, ascending (int64):
    `mask.nonzero().flatten()`, computed faster when few 8-entry groups hold any.

    The mask's bytes are read as int64 words of 8 entries each; only the groups whose word
    is not 0 are looked into. Below one True in 16 entries (at most ~40% of the groups hold
    one) this looks at far fewer entries than a nonzero over the whole mask.
    """
    n = mask.numel()
    full = n // 8 * 8
    if count * 16 >= n or full == 0 or mask.storage_offset() % 8:
        return mask.nonzero().flatten()
    groups = mask[:full].view(torch.uint8).view(torch.int64)
    hit = torch.ne(groups, 0).nonzero().flatten()  # groups holding a True
    entries = groups.index_select(0, hit).view(torch.uint8)  # their 8 entries each, in order
    pos = entries.nonzero().flatten()
    idx = hit.index_select(0, pos >> 3) * 8 + (pos & 7)
    if full < n:
        idx = torch.cat([idx, mask[full:].nonzero().flatten() + full])
    return idx


def _pack_bits_into(out: torch.Tensor, mask: torch.Tensor) -> None:
    """Write the bool `mask` as bits into the uint8 `out` (bit i of byte j = mask[8j + i]),
    zeroing the bytes of `out` past the last one the mask fills.

    Eight mask bytes (each 0 or 1) form one int64 word w with entry i at bit 8i; three
    shift-ors gather them into its low byte: w | w >> 7 puts entry i+1 next to entry i,
    w | w >> 14 then holds four in a row, w | w >> 28 all eight. Only the low byte is kept.
    (No multiply: the well-known w * 0x0102040810204080 >> 56 is faster on a CPU but
    relies on int64 overflow wrapping.)
    """
    n = mask.numel()
    nbytes = -(-n // 8)
    full = n // 8
    if full and mask.storage_offset() % 8 == 0:
        w = mask[: full * 8].view(torch.uint8).view(torch.int64)
        y = w | (w >> 7)
        y = y | (y >> 14)
        y = y | (y >> 28)
        out[:full].copy_(y)  # int64 to uint8 keeps the low byte
    elif full:
        out[:full] = (mask[: full * 8].view(-1, 8).to(torch.uint8) * _BIT_WEIGHTS.to(mask.device)).sum(dim=1, dtype=torch.uint8)
    if nbytes > full:
        rest = mask[full * 8 :].to(torch.uint8)
        out[full:nbytes] = (rest * _BIT_WEIGHTS[: rest.numel()].to(mask.device)).sum(dtype=torch.uint8)
    out[nbytes:].zero_()


def delta_check(payload: torch.Tensor, encoding: int, words: int, word: int) -> int:
    """How many words `payload` changes in a segment of `words` words of `word` bytes;
    ValueError for a payload that does not fit such a segment. Lets a receiver check every
    payload of a bucket before it writes any."""
    if payload.numel() < 8:
        raise ValueError(f"delta payload of {payload.numel()} bytes has no count")
    changed = int(payload[:8].view(torch.int64)[0])
    expected = delta_sizes(words, changed, word).get(encoding) if encoding in (INDICES, BITMASK) else None
    if expected is None or not 0 <= changed <= words or payload.numel() != expected:
        raise ValueError(f"delta payload of {payload.numel()} bytes (encoding {encoding}, {changed} changed) does not fit {words} words of {word} byte(s)")
    if changed and encoding == INDICES:
        idx = payload[8 : 8 + 4 * changed].view(torch.int32)
        if int(idx.min()) < 0 or int(idx.max()) >= words:
            raise ValueError(f"delta payload indexes outside the segment's {words} words")
    elif changed:
        marked = _marked_words(payload, words)
        if marked != changed:
            raise ValueError(f"delta payload's bitmask marks {marked} words, its count says {changed}")
    return changed


def _marked_words(payload: torch.Tensor, words: int) -> int:
    """How many of the first `words` bits of a BITMASK payload's mask are set: a per-byte
    popcount of the packed bytes (bits past `words` in the last byte do not count)."""
    full = words // 8
    packed = payload[8 : 8 + full]
    if words % 8:
        last = payload[8 + full : 9 + full] & ((1 << (words % 8)) - 1)
        packed = torch.cat([packed, last])
    x = packed - ((packed >> 1) & 0x55)  # per bit pair: its count (never borrows)
    x = (x & 0x33) + ((x >> 2) & 0x33)  # per nibble
    x = (x + (x >> 4)) & 0x0F  # per byte
    return int(x.sum(dtype=torch.int64))


def _unpack_bits(payload: torch.Tensor, words: int) -> torch.Tensor:
    """The bool mask of a BITMASK payload's first `words` bits: each packed byte looked up
    as the 8 mask bytes it stands for (one int64 gather per byte)."""
    packed = payload[8 : 8 + -(-words // 8)]
    spread = _BIT_SPREAD.to(packed.device).index_select(0, packed.int())
    return spread.view(torch.uint8).view(torch.bool)[:words]


def delta_apply(target: torch.Tensor, payload: torch.Tensor, encoding: int, word: int, *, checked: int | None = None) -> int:
    """Write the changed words of `payload` into the flat uint8 `target` (the old bytes
    before, the new bytes after); returns how many words changed. ValueError for a payload
    that does not fit `target` (nothing is written then). `checked`: what `delta_check`
    returned for this payload and target size already (it is not checked again)."""
    t = word_view(target, word)
    n = t.numel()
    changed = delta_check(payload, encoding, n, word) if checked is None else checked
    if changed == 0:
        return 0
    values = payload[payload.numel() - changed * word :].view(t.dtype)
    if encoding == INDICES:
        t.index_copy_(0, payload[8 : 8 + 4 * changed].view(torch.int32).long(), values)
    else:
        t.masked_scatter_(_unpack_bits(payload, n), values)
    return changed
