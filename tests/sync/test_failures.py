"""A sync that fails part-way leaves every engine tensor with its old bytes or its new ones.

The trainer's source raises at the first tensor of the sync, and at the first, a middle
and the last tensor that starts in a bucket; a pack fails; a checksum mismatches on one
receiver. Every transport (point-to-point to one receiver, broadcast to two, shared
memory) runs every combination of segments, verification, bypass_cpu/staged and
in-place destinations/apply copies. After each failed sync every engine tensor is
checked byte for byte against the old and the new weights; then a complete sync must
make the engine consistent again at the new version.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import hal
from hal import kernels
from hal.sync import (
    BroadcastTransport,
    IpcTransport,
    Receiver,
    Sender,
    SyncConfig,
    SyncError,
    TensorSource,
    TensorSpec,
    build_plan,
    copy_into,
)
from hal.sync.config import wire_dtype_for
from hal.sync.sink import SinkPolicy
from tests.multiproc import run_group

pytestmark = pytest.mark.multiprocess

BUCKET = 16 * 1024
SEGMENT = 4096


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(300, 64, generator=g)),  # 75 KiB: spread over several buckets
        ("layers.0.w", torch.randn(33, 7, generator=g)),
        ("layers.0.b", torch.randn(5, generator=g)),
        ("layers.1.w", torch.randn(64, 64, generator=g)),  # exactly a bucket's worth: chunked
        ("layers.1.b", torch.randn(100, generator=g).to(torch.bfloat16)),
        ("layers.2.w", torch.randn(40, 40, generator=g)),  # its own segments, one bucket
        ("layers.2.scale", torch.randn(17, generator=g).to(torch.float8_e4m3fn)),
        ("step", torch.tensor([seed], dtype=torch.int64)),
    ]


def specs() -> list[TensorSpec]:
    return [TensorSpec.of(n, t) for n, t in weights(0)]


class FailingSource(TensorSource):
    """Yields the pairs in order and raises when it reaches `fail_at`."""

    def __init__(self, pairs, fail_at: str | None) -> None:
        super().__init__(pairs)
        self.fail_at = fail_at

    def __iter__(self):
        for name, tensor in self.pairs:
            if name == self.fail_at:
                raise RuntimeError(f"trainer source failed at {name}")
            yield name, tensor


class KeepCopies:
    """An engine that takes views and copies them itself (a load_weights-style sink)."""

    policy = SinkPolicy()

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def destination(self, name):
        return None

    def apply(self, pairs):
        for name, tensor in pairs:
            self.tensors[name] = tensor.clone()

    def abort(self):
        self.aborted = True


def fail_points(segment_bytes, verify) -> list[str | None]:
    """The first tensor of the sync; the first, a middle and the last tensor whose first
    byte is in the last bucket where three or more start (earlier buckets are complete by
    then, so something was applied); and the last tensor starting in the first such
    bucket, a tensor chunked over two buckets."""
    plan = build_plan(specs(), BUCKET, verify=verify, segment_bytes=segment_bytes)
    crowded = [s for b in plan.buckets[1:] if len(s := [p.spec.name for p in b.pieces if p.is_first]) >= 3]
    assert len(crowded) >= 2, "the layout changed: pick other weights"
    last = crowded[-1]
    return [specs()[0].name, last[0], last[len(last) // 2], last[-1], crowded[0][-1]]


def cases(transport: str):
    segments = (None,) if transport == "ipc" else (SEGMENT, None)
    for segment_bytes, verify, bypass, sink in itertools.product(segments, (False, True), (True, False), ("dest", "copies")):
        for fail_at in fail_points(segment_bytes, verify):
            yield dict(segment_bytes=segment_bytes, verify=verify, bypass=bypass, sink=sink, fail_at=fail_at)


def classify(held: dict[str, torch.Tensor]) -> dict[str, str]:
    old, new = dict(weights(1)), dict(weights(2))
    out = {}
    for name in old:
        t = held[name]
        as_bytes = lambda x: kernels.as_bytes(x.contiguous()).clone()  # noqa: E731
        if torch.equal(as_bytes(t), as_bytes(old[name])):
            out[name] = "old"
        elif torch.equal(as_bytes(t), as_bytes(new[name])):
            out[name] = "new"
        else:
            out[name] = "OTHER"
    return out


def failures_worker(rank, world, backend, transport):
    with hal.use(backend):
        t = {"broadcast": BroadcastTransport, "ipc": IpcTransport}[transport](None, src=0)
        results = []
        for case in cases(transport):
            cfg = SyncConfig(bucket_bytes=BUCKET, segment_bytes=case["segment_bytes"], verify=case["verify"], bypass_cpu=case["bypass"])
            if rank == 0:
                sender = Sender(t, cfg)
                outcome = {}
                try:
                    sender.send(FailingSource(weights(2), case["fail_at"]), version=2)
                    outcome["error"] = None
                except SyncError as exc:
                    outcome.update(error=type(exc).__name__, trainer_side=exc.trainer_side, inconsistent=exc.inconsistent_ranks)
                sender.send(TensorSource(weights(2)), version=2)
                results.append(outcome)
                continue
            held = {n: x.clone() for n, x in weights(1)}
            sink = copy_into(held) if case["sink"] == "dest" else KeepCopies(held)
            receiver = Receiver(t, specs(), version=1)
            outcome = {}
            try:
                receiver.receive(sink)
                outcome["error"] = None
            except SyncError as exc:
                outcome["error"] = type(exc).__name__
            outcome.update(held=classify(held), consistent=receiver.consistent, version=receiver.version, torn=receiver.torn)
            receiver.receive(sink)
            outcome["after"] = (set(classify(held).values()), receiver.consistent, receiver.version)
            results.append(outcome)
        return results


@pytest.mark.parametrize(
    "backend,transport,world",
    [("cpu", "broadcast", 2), ("cpu", "broadcast", 3), ("cpu", "ipc", 3), ("sim", "broadcast", 2)],
    ids=["point-to-point", "broadcast-2-receivers", "shared-memory", "sim-point-to-point"],
)
def test_a_failing_source_leaves_only_old_or_new_bytes(backend, transport, world):
    results = run_group(failures_worker, world, args=(backend, transport), timeout=240)
    order = [s.name for s in specs()]
    for i, case in enumerate(cases(transport)):
        sent = results[0][i]
        assert sent["error"] == "SourceError" and sent["trainer_side"], (case, sent)
        first = order.index(case["fail_at"])
        touched = []
        for receiver in results[1:]:
            got = receiver[i]
            where = f"{case} -> {got}"
            assert got["error"] == "SourceError", where
            assert "OTHER" not in got["held"].values(), where
            # the failing tensor and everything after it kept the old bytes
            assert all(got["held"][name] == "old" for name in order[first:]), where
            some_new = "new" in got["held"].values()
            assert got["consistent"] is (not some_new), where
            assert got["version"] == 1 and got["torn"] == (), where
            assert got["after"] == ({"new"}, True, 2), where
            if first == 0:
                assert not some_new, where
            touched.append(some_new)
        # the trainer learns exactly which receivers were left inconsistent
        assert sent["inconsistent"] == [r for r, t in enumerate(touched, start=1) if t], (case, sent, touched)
    # the matrix exercised partial applies, not only failures before the first byte
    assert any("new" in results[1][i]["held"].values() for i in range(len(results[1])))


# ---- a pack that fails, a checksum that mismatches on one receiver ----------------------
def pack_and_checksum_worker(rank, world, fail_pack_after):
    t = BroadcastTransport(None, src=0)
    out = {}
    if rank == 0:
        # a pack fails after `fail_pack_after` packing calls, whichever way a segment is
        # packed: one tensor at a time (kernels.pack_into) or all its whole tensors at once
        # (the backend's multi-tensor copy)
        calls = {"n": 0}
        backend = hal.current()
        real_pack, real_many = kernels.pack_into, backend.copy_many_

        def flaky(real):
            def call(*args, **kwargs):
                calls["n"] += 1
                if calls["n"] > fail_pack_after:
                    raise RuntimeError("pack kernel failed")
                return real(*args, **kwargs)

            return call

        kernels.pack_into, backend.copy_many_ = flaky(real_pack), flaky(real_many)
        try:
            Sender(t, SyncConfig(bucket_bytes=BUCKET, segment_bytes=SEGMENT)).send(TensorSource(weights(2)), version=2)
        except SyncError as exc:
            out["pack"] = (type(exc).__name__, "pack kernel failed" in str(exc))
        kernels.pack_into = real_pack
        del backend.copy_many_
        try:
            Sender(t, SyncConfig(bucket_bytes=BUCKET, verify=True)).send(TensorSource(weights(2)), version=2)
        except SyncError as exc:
            out["checksum"] = (type(exc).__name__, exc.trainer_side, exc.inconsistent_ranks)
        return out
    held = {n: x.clone() for n, x in weights(1)}
    receiver = Receiver(t, specs(), version=1)
    try:
        receiver.receive(copy_into(held))
    except SyncError as exc:
        out["pack"] = (type(exc).__name__, classify(held), receiver.consistent)
    if rank == 2:  # corrupt bucket 5 once it arrived: buckets 0-4 complete the embedding and more
        real_receive = t.receive_segments

        def corrupting(land, complete):
            def corrupt(k, j, landed, status):
                if k == 5 and j == 0:
                    t.buffer(5)[0] ^= 0xFF
                complete(k, j, landed, status)

            return real_receive(land, corrupt)

        t.receive_segments = corrupting
    held = {n: x.clone() for n, x in weights(1)}
    try:
        receiver.receive(copy_into(held))
    except SyncError as exc:
        out["checksum"] = (type(exc).__name__, classify(held), receiver.consistent, receiver.version)
    return out


def test_a_failing_pack_and_a_checksum_mismatch_leave_only_old_or_new_bytes():
    sender, clean, corrupted = run_group(pack_and_checksum_worker, 3, args=(1,), timeout=120)
    assert sender["pack"] == ("SourceError", True)
    for receiver in (clean, corrupted):
        kind, held, consistent = receiver["pack"]
        assert kind == "SourceError" and "OTHER" not in held.values()
        assert consistent is ("new" not in held.values())
    kind, trainer_side, inconsistent = sender["checksum"]
    assert kind == "ChecksumMismatchError" and not trainer_side
    # the clean receiver applied everything (it holds the new weights, but the sync failed);
    # the corrupted one stopped at bucket 5 after applying what buckets 0-4 completed
    _, held, consistent, version = clean["checksum"]
    assert set(held.values()) == {"new"} and consistent is False and version == 1
    _, held, consistent, version = corrupted["checksum"]
    assert "OTHER" not in held.values() and {"old", "new"} <= set(held.values())
    assert consistent is False and version == 1
    assert inconsistent == [1, 2]


def test_wire_dtype_never_widens():
    assert wire_dtype_for(torch.float32, torch.bfloat16) is torch.bfloat16
    assert wire_dtype_for(torch.float8_e4m3fn, torch.bfloat16) is torch.float8_e4m3fn
    assert wire_dtype_for(torch.float16, torch.bfloat16) is torch.float16
    assert wire_dtype_for(torch.int64, torch.bfloat16) is torch.int64
    assert wire_dtype_for(torch.float32, None) is torch.float32


# ---- a pack that fails asynchronously, on the stream (the sim backend) ------------------
def async_pack_failure_worker(rank, world):
    from hal.backends.sim import SimBackend

    with hal.use(SimBackend(latency=0.002)) as backend:
        t = BroadcastTransport(None, src=0)
        if rank == 0:
            # the second segment packed by one multi-tensor copy (its whole tensors) is
            # launched fine and fails later, on the stream's thread
            real = backend.copy_many_
            calls = {"n": 0}

            def fails_on_the_stream(dsts, srcs, *, stream=None, shapes_checked=False):
                calls["n"] += 1
                if calls["n"] == 2:
                    backend.launch(stream, _boom)
                    return
                real(dsts, srcs, stream=stream, shapes_checked=shapes_checked)

            backend.copy_many_ = fails_on_the_stream
            try:
                Sender(t, SyncConfig(bucket_bytes=BUCKET, segment_bytes=SEGMENT)).send(TensorSource(weights(2)), version=2)
                first = "sent"
            except SyncError as exc:
                first = (type(exc).__name__, "device work failed" in str(exc))
            del backend.copy_many_
            Sender(t, SyncConfig(bucket_bytes=BUCKET, segment_bytes=SEGMENT)).send(TensorSource(weights(2)), version=2)
            return first
        held = {n: x.clone() for n, x in weights(1)}
        receiver = Receiver(t, specs(), version=1)
        try:
            receiver.receive(copy_into(held))
            first = "received"
        except SyncError as exc:
            first = (type(exc).__name__, classify(held))
        receiver.receive(copy_into(held))  # the stream's error was reported once, not forever
        return first, set(classify(held).values()), receiver.version, backend.name


def _boom() -> None:
    raise RuntimeError("device work failed")


def test_an_asynchronous_pack_failure_is_caught_before_its_segment_leaves():
    sender, (first, after, version, backend) = run_group(async_pack_failure_worker, 2, timeout=90)
    assert backend == "sim"
    assert sender == ("SourceError", True)
    kind, held = first
    assert kind == "SourceError" and "OTHER" not in held.values()
    assert after == {"new"} and version == 2
