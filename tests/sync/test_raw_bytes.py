"""A sync lands the trainer's bytes, not only its values: weights of random bytes (NaNs of
every sign and payload, negative zeros, fp8's NaN) arrive bit for bit, packed many to a
segment, cut into ranges, through every same-node transport, verified or not, and again in
the steady state. On a GPU torch's multi-tensor copy rewrites NaNs (H200, 2026-11-27:
docs/results/runs/2026-11-27-cuda-h200.json); the cpu and sim lanes run the same path."""

from __future__ import annotations

import pytest
import torch

import hal
from hal import kernels
from hal.sync import BroadcastTransport, IpcTransport, Receiver, Sender, SyncConfig, TensorSource, TensorSpec, copy_into
from tests.conftest import BACKEND_PARAMS
from tests.multiproc import run_group

pytestmark = pytest.mark.multiprocess

BUCKET = 64 * 1024


def raw(step: int) -> list[tuple[str, torch.Tensor]]:
    """The trainer's tensors at `step`: random bytes viewed as each dtype."""
    g = torch.Generator().manual_seed(step)

    def of(dtype: torch.dtype, *shape: int) -> torch.Tensor:
        n = torch.Size(shape).numel() * dtype.itemsize
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(*shape)

    pairs = [(f"experts.{i}.weight", of(torch.bfloat16, 8, 16)) for i in range(300)]  # many to a segment
    pairs += [
        ("embed.weight", of(torch.bfloat16, 600, 80)),  # 94 KiB: larger than a bucket, sent in ranges
        ("norm.weight", of(torch.float32, 33)),
        ("half.weight", of(torch.float16, 5, 7)),
        ("fp8.weight", of(torch.float8_e4m3fn, 17, 3)),
    ]
    return pairs


def worker(rank, world, backend, transport_kind, verify):
    with hal.use(backend):
        device = hal.current().device()
        transport = (IpcTransport if transport_kind == "ipc" else BroadcastTransport)(None, src=0)
        config = SyncConfig(bucket_bytes=BUCKET, verify=verify)
        if rank == 0:
            sender = Sender(transport, config)
            held = [(n, t.to(device)) for n, t in raw(0)]
            for step in range(3):
                for (_, t), (_, new) in zip(held, raw(step)):
                    t.copy_(new.to(device))  # in place: the second and third syncs are steady
                sender.send(TensorSource(held), version=step)
            return None
        specs = [TensorSpec.of(n, t) for n, t in raw(0)]
        receiver = Receiver(transport, specs)
        destinations = {n: torch.zeros_like(t, device=device) for n, t in raw(0)}
        exact = []
        for step in range(3):
            receiver.receive(copy_into(destinations))
            hal.current().synchronize()
            exact.append([n for n, t in raw(step) if not torch.equal(kernels.as_bytes(destinations[n].cpu()), kernels.as_bytes(t))])
        return exact


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verified"])
@pytest.mark.parametrize("transport_kind", ["ipc", "broadcast"])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_random_bytes_land_bit_for_bit(backend, transport_kind, verify):
    _, *receivers = run_group(worker, 3, args=(backend, transport_kind, verify), timeout=180, collective_timeout=60)
    assert receivers == [[[], [], []]] * 2  # per receiver, per sync: no tensor with a wrong byte
