import pytest
import torch

from hal.kernels import ALIGNMENT
from hal.sync import PlanCache, SyncConfig, TensorSpec, build_plan
from hal.sync.plan.buckets import CHECKSUM_BYTES


def specs(*shapes, dtype=torch.float32):
    return [TensorSpec(f"p{i}", shape, dtype) for i, shape in enumerate(shapes)]


def covered(plan):
    """bytes of every tensor, reassembled from its pieces in order"""
    seen = {}
    for bucket in plan.buckets:
        for piece in bucket.pieces:
            assert piece.offset % ALIGNMENT == 0
            assert piece.offset + piece.nbytes <= bucket.checksum_offset <= bucket.nbytes <= plan.bucket_bytes
            assert piece.tensor_offset == seen.get(piece.spec.name, 0), "pieces out of order"
            seen[piece.spec.name] = piece.tensor_offset + piece.nbytes
    return seen


@pytest.mark.parametrize("verify", [False, True])
def test_every_byte_is_placed_once_in_order(verify):
    s = specs((10, 10), (3,), (100, 100), (7, 7), dtype=torch.float32)
    plan = build_plan(s, 16384, verify=verify)
    assert covered(plan) == {x.name: x.nbytes for x in s}
    assert plan.total_bytes == sum(x.nbytes for x in s)
    if verify:
        for b in plan.buckets:
            assert b.nbytes == b.checksum_offset + CHECKSUM_BYTES * len(b.pieces)


def test_tensor_larger_than_a_bucket_is_chunked_at_aligned_boundaries():
    big = TensorSpec("big", (10_000,), torch.float32)  # 40000 bytes
    plan = build_plan([big], 8192)
    pieces = [p for b in plan.buckets for p in b.pieces]
    assert len(pieces) > 1 and len(plan.buckets) == len(pieces)
    assert all(p.tensor_offset % ALIGNMENT == 0 for p in pieces)
    assert pieces[0].is_first and pieces[-1].is_last and not pieces[0].is_whole
    assert covered(plan) == {"big": 40000}


def test_a_tensor_that_fits_a_fresh_bucket_is_not_split():
    plan = build_plan(specs((1000,), (1500,)), 8192)  # 4000 + 6000 bytes
    assert [len(b.pieces) for b in plan.buckets] == [1, 1]
    assert all(p.is_whole for b in plan.buckets for p in b.pieces)


def test_empty_tensor_still_travels():
    plan = build_plan([TensorSpec("empty", (0, 4), torch.float32)], 4096)
    assert [p.spec.name for b in plan.buckets for p in b.pieces] == ["empty"]


def test_layout_is_cached_while_metadata_is_unchanged_and_rebuilt_on_any_change():
    cache = PlanCache()
    base = specs((4, 4), (8,))
    first = cache.get(base, 4096, False)
    assert cache.get(list(base), 4096, False) is first and cache.builds == 1
    changes = [
        [TensorSpec("renamed", (4, 4), torch.float32), base[1]],
        [TensorSpec("p0", (4, 5), torch.float32), base[1]],
        [TensorSpec("p0", (4, 4), torch.bfloat16), base[1]],
    ]
    for changed in changes:
        assert cache.get(changed, 4096, False).digest != first.digest
    assert cache.builds == 4
    assert cache.get(base, 8192, False).digest != first.digest  # bucket size is part of the key


def test_spec_of_a_tensor_is_the_last_one_while_it_matches_and_the_cache_knows_it_by_identity(monkeypatch):
    w = TensorSpec.of("model.w", torch.zeros(4, 4))
    assert TensorSpec.of("model.w", torch.ones(4, 4)) is w  # same name, shape, dtype: nothing built
    for changed in (torch.zeros(4, 5), torch.zeros(4, 4, dtype=torch.bfloat16)):
        fresh = TensorSpec.of("model.w", changed)
        assert fresh is not w and (fresh.shape, fresh.dtype) == (tuple(changed.shape), changed.dtype)
    metadata = [TensorSpec.of(f"layer.{i}", torch.zeros(i + 1)) for i in range(3)]
    cache = PlanCache()
    plan = cache.get(metadata, 4096, False)
    again = [TensorSpec.of(f"layer.{i}", torch.zeros(i + 1)) for i in range(3)]  # a new list, the same objects
    monkeypatch.setattr("hal.sync.plan.buckets.plan_key", lambda *a: pytest.fail("the same spec objects are known by identity"))
    assert cache.get(again, 4096, False) is plan and cache.builds == 1


def test_duplicate_names_and_tiny_buckets_are_rejected():
    with pytest.raises(ValueError, match="'p0' appears twice"):
        build_plan([TensorSpec("p0", (1,), torch.float32)] * 2, 4096)
    with pytest.raises(ValueError, match="bucket_bytes must be at least"):
        build_plan(specs((1,)), 100)


def check_segments(plan, segment_bytes):
    """Segments cover every byte of every piece exactly once, in order, and never overlap;
    padding does not travel; checksums travel last."""
    limit = segment_bytes // ALIGNMENT * ALIGNMENT
    for bucket in plan.buckets:
        carried = {i: 0 for i in range(len(bucket.pieces))}
        previous_stop = 0
        for seg in bucket.segments:
            assert previous_stop <= seg.start <= seg.stop and seg.start % (ALIGNMENT if seg.ranges else 8) == 0
            previous_stop = seg.stop
            for i, lo, hi in seg.ranges:
                piece = bucket.pieces[i]
                assert lo == carried[i], "ranges of a piece out of order"
                assert seg.start <= piece.offset + lo <= piece.offset + hi <= seg.stop
                carried[i] = hi
            if len(seg.ranges) == 1 and seg.ranges[0][2] > seg.ranges[0][1]:
                i, lo, hi = seg.ranges[0]
                assert seg.stop - seg.start == hi - lo  # a single range travels without padding
            elif seg.ranges:
                first, last = seg.ranges[0], seg.ranges[-1]
                assert seg.start == bucket.pieces[first[0]].offset + first[1]
                assert seg.stop == bucket.pieces[last[0]].offset + last[2]
                assert seg.stop - seg.start <= limit
        assert carried == {i: p.nbytes for i, p in enumerate(bucket.pieces)}
        if plan.verify:
            assert (bucket.segments[-1].start, bucket.segments[-1].stop) == (bucket.checksum_offset, bucket.nbytes)
            assert bucket.segments[-1].ranges == ()


@pytest.mark.parametrize("verify", [False, True])
def test_segments_group_small_tensors_and_give_large_ones_their_own(verify):
    seg = 8192
    s = specs((100,), (3000,), (10, 10), (0,), (300,), (5000,), (7,), dtype=torch.float32)  # 0 B .. 20 KB
    plan = build_plan(s, 64 * 1024, verify=verify, segment_bytes=seg)
    check_segments(plan, seg)
    (bucket,) = plan.buckets
    names = [[bucket.pieces[i].spec.name for i, _, _ in segment.ranges] for segment in bucket.segments if segment.ranges]
    # p1 (12 KB) and p5 (20 KB) are at least a quarter segment: their own transfers, split at
    # the segment size; the small ones (the empty p3 included) travel together
    assert names == [["p0"], ["p1"], ["p1"], ["p2", "p3", "p4"], ["p5"], ["p5"], ["p5"], ["p6"]]
    assert len(plan.buckets[0].segments) == 8 + verify


def test_segments_hold_for_random_layouts():
    import random

    rng = random.Random(0)
    for trial in range(200):
        shapes = [(rng.choice([0, 1, 3, 17, 64, 255, 1000, 4096, 20000]),) for _ in range(rng.randint(1, 12))]
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int8])
        seg = rng.choice([256, 1024, 4096, 10000])
        verify = rng.random() < 0.5
        plan = build_plan(specs(*shapes, dtype=dtype), rng.choice([4096, 16384, 65536]), verify=verify, segment_bytes=seg)
        covered(plan)
        check_segments(plan, seg)


def test_without_a_segment_size_a_bucket_travels_whole():
    plan = build_plan(specs((100,), (5000,)), 64 * 1024, verify=True)
    assert [(s.start, s.stop) for s in plan.buckets[0].segments] == [(0, plan.buckets[0].nbytes)]
    # the segment size is part of the layout's key: sender and receivers must agree on it
    assert plan.digest != build_plan(specs((100,), (5000,)), 64 * 1024, verify=True, segment_bytes=4096).digest


def test_tensor_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="negative dimension"):
        TensorSpec("w", (-1, 2), torch.float32)
    with pytest.raises(ValueError, match="'w': dtype must be a torch.dtype"):
        TensorSpec("w", (1,), "float32")
    with pytest.raises(ValueError, match="name"):
        TensorSpec("", (1,), torch.float32)


def test_sync_config_validation_names_the_field():
    with pytest.raises(ValueError, match="bucket_bytes"):
        SyncConfig(bucket_bytes=10)
    with pytest.raises(ValueError, match="wire_dtype"):
        SyncConfig(wire_dtype=torch.int8)
    with pytest.raises(ValueError, match="segment_bytes"):
        SyncConfig(segment_bytes=100)
    with pytest.raises(ValueError, match="timeout_s"):
        SyncConfig(timeout_s=0)


class _FreeMemory:
    def __init__(self, free):
        self.free = free

    def memory_info(self):
        from hal.backends.types import MemoryInfo

        return MemoryInfo(free=self.free, total=self.free)


def test_default_bucket_follows_free_memory_and_holds_the_largest_tensor_when_it_can():
    from hal.sync import default_bucket_bytes

    mib, gib = 1 << 20, 1 << 30
    assert default_bucket_bytes(_FreeMemory(1 * gib)) == 32 * mib  # floor
    assert default_bucket_bytes(_FreeMemory(8 * gib)) == 128 * mib  # 1/64 of free
    assert default_bucket_bytes(_FreeMemory(64 * gib)) == 256 * mib  # cap
    # a 272 MB embedding: held whole when two such buckets fit in 1/8 of free memory ...
    whole = default_bucket_bytes(_FreeMemory(23 * gib), 272 * 10**6)
    assert 272 * 10**6 < whole <= 272 * 10**6 + 2 * mib
    assert build_plan([TensorSpec("embed", (68_000_000,), torch.float32)], whole).buckets[0].pieces[0].is_whole
    # ... and chunked rather than exhausting a small device
    assert default_bucket_bytes(_FreeMemory(2 * gib), 272 * 10**6) == 32 * mib
    # several senders into the same receivers: each a share, so a receiver's buffers add up to one sender's
    assert default_bucket_bytes(_FreeMemory(64 * gib), sender_count=4) == 64 * mib
    assert default_bucket_bytes(_FreeMemory(1 * gib), sender_count=3) == 10 * mib  # whole MiB
    assert default_bucket_bytes(_FreeMemory(1 * gib), sender_count=64) == 1 * mib  # never below 1 MiB
    # the largest share still travels whole when it can
    assert default_bucket_bytes(_FreeMemory(23 * gib), 136 * 10**6, sender_count=2) > 136 * 10**6


def test_a_sender_sizes_its_buckets_once_per_listing_and_again_for_a_larger_tensor():
    """Derived from free memory at the first sync; a steady sync (the same specs list) does
    not look at its specs again, nor at free memory (noise must not change the layout); a
    listing with a larger tensor sizes them again."""
    from hal.backends.cpu import CpuBackend
    from hal.sync import Sender, SyncConfig

    class Backend(CpuBackend):
        def __init__(self, free: int) -> None:
            super().__init__()
            self.free, self.asked = free, 0

        def memory_info(self):
            from hal.backends.types import MemoryInfo

            self.asked += 1
            return MemoryInfo(free=self.free, total=self.free)

    class Transport:  # what a Sender reads of its transport before any sync
        is_sender, rank, src = True, 0, 0

    mib, gib = 1 << 20, 1 << 30
    backend = Backend(8 * gib)
    sender = Sender(Transport(), SyncConfig(bucket_bytes=None), backend=backend)
    specs = [TensorSpec("w", (1024,), torch.float32)]
    sender._size_buckets(specs)
    assert (sender.bucket_bytes, backend.asked) == (128 * mib, 1)
    backend.free = 64 * gib  # free memory moved: the same specs keep their layout
    sender._size_buckets(specs)
    assert (sender.bucket_bytes, backend.asked) == (128 * mib, 1)
    listed = list(specs)
    sender._size_buckets(listed)  # another listing of the same tensors: no larger one, kept
    assert (sender.bucket_bytes, backend.asked) == (128 * mib, 1)
    # The same list object is not read again: a sender's specs list is made anew whenever its
    # source's metadata changed (hal.sync.plan.steady), so only an unchanged one comes back.
    listed.append(TensorSpec("embed", (68_000_000,), torch.float32))  # 272 MB
    sender._size_buckets(listed)
    assert (sender.bucket_bytes, backend.asked) == (128 * mib, 1)
    sender._size_buckets(list(listed))  # a new list holding a larger tensor: sized again
    assert backend.asked == 2 and sender.bucket_bytes > 272 * 10**6
