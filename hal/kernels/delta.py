"""Delta encoding of a segment against the bytes a receiver already holds (delta sync).

Reference implementations in torch, like the rest of hal.kernels; hal.sync.delta decides
when to use them.
"""

from __future__ import annotations

import enum

import torch

from hal.kernels.layout import align_up


# ---- delta encoding ------------------------------------------------------------------
# A segment's new bytes against the bytes the receiver already holds (the baseline), in
# words of `word` bytes (the smallest element size in the segment, so a changed element
# is one or more whole words). Payload layouts (all offsets 8-aligned):
#   INDICES: [count int64][count int32 word indices, padded to 8][count values]
#   BITMASK: [count int64][ceil(words / 8) bytes, bit i = word i changed, padded to 8][count values]
class Encoding(enum.IntEnum):
    """How a segment's bytes travel: the one list of encodings (the segment's status on the
    wire carries it: hal.sync.wire.channel.SegmentStatus)."""

    DENSE = 0  # the segment's bytes as packed
    INDICES = 1  # the words that changed, by index
    BITMASK = 2  # the words that changed, by bitmask


DENSE, INDICES, BITMASK = Encoding.DENSE, Encoding.INDICES, Encoding.BITMASK
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
