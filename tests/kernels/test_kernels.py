import pytest
import torch

import hal
from hal import kernels
from tests.conftest import BACKEND_PARAMS


@pytest.fixture(params=["cpu", "sim"])
def backend(request):
    with hal.use(request.param) as b:
        yield b


def test_pack_then_view_round_trips_with_cast(backend):
    bucket = torch.zeros(4096, dtype=torch.uint8)
    a = torch.randn(3, 5)
    b = torch.arange(7, dtype=torch.int64)
    stream = backend.new_stream()
    kernels.pack_into(backend, bucket, 0, a, torch.bfloat16, stream=stream)
    kernels.pack_into(backend, bucket, 256, b, torch.int64, stream=stream)
    stream.synchronize()
    assert torch.equal(kernels.typed_view(bucket, 0, (3, 5), torch.bfloat16), a.to(torch.bfloat16))
    assert torch.equal(kernels.typed_view(bucket, 256, (7,), torch.int64), b)


def test_pack_range_packs_wire_byte_ranges_with_cast(backend):
    bucket = torch.zeros(4096, dtype=torch.uint8)
    a = torch.randn(1000)  # fp32 source, bf16 wire: 2000 wire bytes
    stream = backend.new_stream()
    # the wire bytes [512, 1536) of `a` are elements 256..767, placed at bucket offset 1024
    kernels.pack_range_into(backend, bucket, 1024, a, torch.bfloat16, 512, 1024, stream=stream)
    stream.synchronize()
    assert torch.equal(kernels.typed_view(bucket, 1024, (512,), torch.bfloat16), a[256:768].to(torch.bfloat16))
    assert not bucket[:1024].any() and not bucket[2048:].any()  # nothing outside the range
    with pytest.raises(ValueError, match="splits a torch.bfloat16 element"):
        kernels.pack_range_into(backend, bucket, 0, a, torch.bfloat16, 1, 2)
    with pytest.raises(ValueError, match="overruns a tensor of 1000"):
        kernels.pack_range_into(backend, bucket, 0, a, torch.bfloat16, 1800, 400)


def test_typed_view_is_zero_copy_and_checks_bounds():
    bucket = torch.zeros(1024, dtype=torch.uint8)
    view = kernels.typed_view(bucket, 256, (4,), torch.float32)
    view.fill_(1.5)
    assert kernels.typed_view(bucket, 256, (4,), torch.float32).tolist() == [1.5] * 4
    with pytest.raises(ValueError, match="overrun"):
        kernels.typed_view(bucket, 1000, (8,), torch.float32)
    with pytest.raises(ValueError, match="not aligned"):
        kernels.typed_view(bucket, 2, (2,), torch.float32)


def test_as_bytes_rejects_non_contiguous():
    with pytest.raises(ValueError, match="not contiguous"):
        kernels.as_bytes(torch.zeros(4, 4).t())


def test_checksum_detects_changes_and_shifts():
    data = torch.randint(0, 256, (3 * 4096 + 13,), dtype=torch.uint8)
    base = kernels.checksum(data)
    assert torch.equal(base, kernels.checksum(data.clone()))
    flipped = data.clone()
    flipped[5000] ^= 1
    assert kernels.checksum(flipped) != base
    tail = data.clone()
    tail[-1] ^= 0x80
    assert kernels.checksum(tail) != base
    # two 4 KiB blocks swapped: same words, different order
    swapped = data.clone()
    swapped[:4096], swapped[4096:8192] = data[4096:8192].clone(), data[:4096].clone()
    assert kernels.checksum(swapped) != base
    assert kernels.checksum(torch.zeros(8192, dtype=torch.uint8)) != kernels.checksum(data[:8192])


@pytest.mark.parametrize(
    "first,second",
    [(0, 0), (0, 100), (8, 0), (4096, 4096), (4096, 8), (8, 4096), (4104, 3 * 4096 + 16), (2 * 4096 - 8, 4096 + 8), (16, 24)],
)
def test_checksum_of_two_parts_equals_the_checksum_of_their_concatenation(first, second):
    data = torch.randint(0, 256, (first + second,), dtype=torch.uint8)
    whole = kernels.checksum(data)
    a, b = data[:first].clone(), data[first:].clone()  # apart in memory, as a baseline and a pack target
    assert torch.equal(kernels.checksum_parts(a, b), whole)
    if first + second:  # one byte changed on either side of the seam changes it
        b_or_a = b if second else a
        b_or_a[0] ^= 1
        assert not torch.equal(kernels.checksum_parts(a, b), whole)


def test_checksums_into_takes_the_bytes_from_where_the_newer_ones_begin():
    """A delta sync's sender: a bucket's new bytes are in the baseline before the segment
    being packed and in the pack target from it on; ranges before, after and across."""
    new = torch.randint(0, 256, (6 * 4096,), dtype=torch.uint8)
    at = 2 * 4096 + 512
    baseline = new.clone()
    baseline[at:] = 0  # what the baseline still holds there: the old bytes
    ranges = [(0, 4096), (4096, 3 * 4096), (at + 8, 4096), (5 * 4096, 4096)]
    out = torch.zeros(len(ranges), dtype=torch.int64)
    kernels.checksums_into(out, baseline, ranges, new[at:].clone(), at)
    expected = torch.zeros(len(ranges), dtype=torch.int64)
    kernels.checksums_into(expected, new, ranges)
    assert torch.equal(out, expected)
    kernels.checksums_into(out, baseline, ranges)
    assert out[0] == expected[0] and (out[1:] != expected[1:]).all()


_MIXED_RANGES = [(0, 0), (8, 3), (16, 4096), (4160, 4101), (8320, 8), (8328, 12_000), (20_480, 1), (30_000, 9_999), (24_000, 5000)]


@pytest.mark.parametrize("window", [8, 64, 4096, 4104, 1 << 20])
def test_checksums_of_many_ranges_equal_one_checksum_each(window):
    """Ranges of every kind at once: empty, under a word, with a partial last word, whole
    blocks, across blocks, large ones, out of order; windows of one word to all of it."""
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (40_000,), dtype=torch.uint8, generator=g)
    expected = torch.stack([kernels.checksum(data[o : o + n]) for o, n in _MIXED_RANGES])
    assert torch.equal(kernels.RangeChecksums(_MIXED_RANGES, "cpu", window_bytes=window).compute(data), expected)
    assert torch.equal(kernels.checksums(data, _MIXED_RANGES), expected)
    assert kernels.checksums(data, []).numel() == 0
    with pytest.raises(ValueError, match="8-byte boundaries"):
        kernels.checksums(data, [(4, 8)])
    with pytest.raises(ValueError, match="inside the 40000 bytes"):
        kernels.checksums(data, [(39_992, 16)])


@pytest.mark.parametrize("backend_name", BACKEND_PARAMS)
@pytest.mark.parametrize("seed", range(4))
def test_checksums_of_a_plans_layout_equal_one_checksum_each(backend_name, seed):
    """A plan's layout: pieces on 256-byte boundaries (so sums of groups of words stand
    in for the words), of odd sizes, smaller and larger than a block and a window, in
    several windows, with the newer bytes from any 256-byte boundary on; the same plan
    computed twice (its kept indices are not consumed); on each backend's device."""
    device = hal.get_backend(backend_name).device()
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 20_000, (40,), generator=g).tolist() + [1, 7, 8, 4096, 4097, 70_000, 300_001]
    ranges, at = [], 0
    for n in sizes:
        ranges.append((at, n))
        at = kernels.align_up(at + n)
    data = torch.randint(0, 256, (at + 64,), dtype=torch.uint8, generator=g).to(device)
    expected = torch.stack([kernels.checksum(data[o : o + n]) for o, n in ranges])
    for window in (256, 4096, 1 << 20):
        plan = kernels.RangeChecksums(ranges, device, window_bytes=window)
        assert plan.group == 32  # 256 bytes: every piece and block start is a multiple
        assert torch.equal(plan.compute(data), expected) and torch.equal(plan.compute(data), expected)
        cut = kernels.align_up(int(torch.randint(0, at, (1,), generator=g)))
        baseline = data.clone()
        baseline[cut:] = 0
        plan = kernels.RangeChecksums(ranges, device, newer_at=cut, window_bytes=window)
        assert torch.equal(plan.compute(baseline, data[cut:].clone()), expected)
        changed = data.clone()
        changed[cut + 3] ^= 1
        assert not torch.equal(plan.compute(baseline, changed[cut:].clone()), expected)


def test_range_checksums_name_what_is_wrong_with_their_input():
    data = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="newer_at must be a non-negative multiple of 8, got 12"):
        kernels.RangeChecksums([(0, 64)], "cpu", newer_at=12)
    with pytest.raises(ValueError, match="window_bytes must be a positive multiple of 8, got 100"):
        kernels.RangeChecksums([(0, 64)], "cpu", window_bytes=100)
    plan = kernels.RangeChecksums([(0, 64), (256, 64)], "cpu", newer_at=256)
    with pytest.raises(ValueError, match="called without newer bytes"):
        plan.compute(data)
    with pytest.raises(ValueError, match="inside the 32 bytes of the newer bytes"):
        plan.compute(data, data[:32])
    with pytest.raises(ValueError, match="flat uint8"):
        plan.compute(data, torch.zeros(64))


def test_checksum_pads_a_partial_last_word_and_weighs_blocks_by_position():
    data = torch.randint(0, 256, (2 * 4096 + 5,), dtype=torch.uint8)
    words = data[: 2 * 4096].view(torch.int64)
    tail = torch.zeros(8, dtype=torch.uint8)
    tail[:5] = data[2 * 4096 :]
    expected = words[:512].sum() + 2 * words[512:].sum() + 3 * tail.view(torch.int64)[0]
    assert kernels.checksum(data) == expected


def test_checksum_rejects_typed_tensors():
    with pytest.raises(ValueError, match="flat uint8"):
        kernels.checksum(torch.zeros(4))


def test_align_up():
    assert [kernels.align_up(n) for n in (0, 1, 256, 257)] == [0, 256, 256, 512]


# ---- delta encoding ------------------------------------------------------------------
def _reference_delta_encode(new: torch.Tensor, base: torch.Tensor, word: int):
    """The plain definition of delta_encode's output (padding zeroed), to hold the faster one to."""
    a, b = kernels.word_view(new, word), kernels.word_view(base, word)
    mask = a != b
    changed = int(mask.long().sum())
    sizes = kernels.delta_sizes(a.numel(), changed, word)
    encoding = min(sizes, key=lambda e: (sizes[e], e))
    if encoding == kernels.DENSE:
        return encoding, None, changed
    payload = torch.zeros(sizes[encoding], dtype=torch.uint8)
    payload[:8].view(torch.int64)[0] = changed
    idx = mask.nonzero().flatten()
    if encoding == kernels.INDICES:
        payload[8 : 8 + 4 * changed].view(torch.int32).copy_(idx)
    else:
        bits = mask.tolist()
        for j in range(-(-len(bits) // 8)):
            payload[8 + j] = sum(1 << i for i, bit in enumerate(bits[8 * j : 8 * j + 8]) if bit)
    if changed:
        payload[sizes[encoding] - changed * word :].view(a.dtype).copy_(a[idx])
    return encoding, payload, changed


@pytest.mark.parametrize("word", [1, 2, 4, 8])
@pytest.mark.parametrize("words", [1, 7, 8, 63, 64, 1000, 4099])
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.02, 0.05, 0.2, 0.9, 1.0])
def test_delta_encode_matches_its_plain_definition(word, words, fraction):
    g = torch.Generator().manual_seed(words * 31 + word)
    base = torch.randint(0, 256, (words * word,), dtype=torch.uint8, generator=g)
    new = base.clone()
    hit = torch.rand(words, generator=g) < fraction
    new.view(-1, word)[hit, 0] ^= 1  # flip one bit of each chosen word
    if fraction == 0.001:
        new.view(-1, word)[words - 1, word - 1] ^= 0x80  # a change in the last word's last byte
    encoding, payload, changed = kernels.delta_encode(new, base, word)
    want_encoding, want_payload, want_changed = _reference_delta_encode(new, base, word)
    assert (encoding, changed) == (want_encoding, want_changed)
    if want_payload is None:
        assert payload is None
    else:
        assert torch.equal(payload, want_payload)  # every byte, padding included
        target = base.clone()
        assert kernels.delta_apply(target, payload, encoding, word) == changed and torch.equal(target, new)


def test_delta_encode_sparse_changes_in_a_large_segment():
    # past the sizes above: the grouped index search over many 8-word groups, and a bitmask
    g = torch.Generator().manual_seed(7)
    base = torch.randn(1 << 18, generator=g).to(torch.bfloat16)
    for fraction, expected in ((0.01, kernels.INDICES), (0.2, kernels.BITMASK)):
        new = base.clone()
        hit = torch.rand(base.numel(), generator=g) < fraction
        new[hit] = (new[hit].float() * 1.5 + 1e-3).to(torch.bfloat16)
        nb, bb = kernels.as_bytes(new), kernels.as_bytes(base)
        encoding, payload, changed = kernels.delta_encode(nb, bb, 2)
        want = _reference_delta_encode(nb, bb, 2)
        assert encoding == expected == want[0] and changed == want[2] and torch.equal(payload, want[1])


def test_delta_encode_of_unaligned_views_and_a_word_tail():
    # a segment that starts at an odd multiple of its word inside a larger tensor, and
    # a mask whose length is not a multiple of 8
    g = torch.Generator().manual_seed(11)
    big = torch.randint(0, 256, (8 * 1000 + 6,), dtype=torch.uint8, generator=g)
    other = big.clone()
    other[2 + 2 * 5 :: 2 * 37] ^= 3
    new, base = other[2:], big[2:]  # 4002 words of 2 bytes at byte offset 2
    encoding, payload, changed = kernels.delta_encode(new, base, 2)
    want = _reference_delta_encode(new, base, 2)
    assert (encoding, changed) == want[::2] and torch.equal(payload, want[1])
