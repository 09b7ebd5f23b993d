import pytest
import torch

import hal
from hal import kernels


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


def test_checksum_rejects_typed_tensors():
    with pytest.raises(ValueError, match="flat uint8"):
        kernels.checksum(torch.zeros(4))


def test_align_up():
    assert [kernels.align_up(n) for n in (0, 1, 256, 257)] == [0, 256, 256, 512]
