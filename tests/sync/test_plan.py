import pytest
import torch

from hal.kernels import ALIGNMENT
from hal.sync import PlanCache, SyncConfig, TensorSpec, build_plan
from hal.sync.plan import CHECKSUM_BYTES


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


def test_duplicate_names_and_tiny_buckets_are_rejected():
    with pytest.raises(ValueError, match="'p0' appears twice"):
        build_plan([TensorSpec("p0", (1,), torch.float32)] * 2, 4096)
    with pytest.raises(ValueError, match="bucket_bytes must be at least"):
        build_plan(specs((1,)), 100)


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
    with pytest.raises(ValueError, match="timeout_s"):
        SyncConfig(timeout_s=0)


class _FreeMemory:
    def __init__(self, free):
        self.free = free

    def memory_info(self):
        from hal.backend import MemoryInfo

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
