"""Sender and receivers in separate processes over gloo, on the cpu and sim backends."""

from __future__ import annotations

import os
import time

import pytest
import torch

import hal
from hal.sync import (
    BroadcastTransport,
    ChecksumMismatchError,
    IpcTransport,
    PeerError,
    Receiver,
    Sender,
    SpecMismatchError,
    SyncConfig,
    SyncError,
    TensorSource,
    TensorSpec,
)
from hal.kernels import RangeChecksums
from hal.sync.receive import allocate
from hal.sync.sink import copy_into
from tests.multiproc import run_group

pytestmark = pytest.mark.multiprocess

BUCKET = 16 * 1024  # small, so the big tensor is chunked and there are many buckets


def weights(seed: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(300, 64, generator=g).to(dtype)),  # 76 KiB: larger than a bucket
        ("layers.0.w", torch.randn(33, 7, generator=g).to(dtype)),
        ("layers.0.b", torch.randn(5, generator=g).to(dtype)),
        ("layers.1.w", torch.randn(64, 64, generator=g).to(dtype)),
        ("step", torch.tensor([seed], dtype=torch.int64)),
    ]


def specs(dtype: torch.dtype = torch.float32) -> list[TensorSpec]:
    return [TensorSpec.of(n, t) for n, t in weights(0, dtype)]


class Collect:
    """An apply target that keeps copies, like load_weights does."""

    def __init__(self) -> None:
        self.got: dict[str, torch.Tensor] = {}
        self.calls = 0

    def __call__(self, pairs):
        self.calls += 1
        for name, tensor in pairs:
            self.got[name] = tensor.clone()

    def matches(self, expected) -> bool:
        exp = dict(expected)
        return self.got.keys() == exp.keys() and all(torch.equal(self.got[n], exp[n]) for n in exp)


def _transport(kind: str):
    return {"broadcast": BroadcastTransport, "ipc": IpcTransport}[kind](None, src=0)


# ---- round trips ---------------------------------------------------------------------
def roundtrip_worker(rank, world, backend, kind, verify, segment_bytes=None):
    planned = []  # checksum plans built, counted after each sync
    built = [0]
    init = RangeChecksums.__init__

    def counting(self, *args, **kwargs):
        built[0] += 1
        init(self, *args, **kwargs)

    RangeChecksums.__init__ = counting
    try:
        with hal.use(backend):
            transport = _transport(kind)
            cfg = SyncConfig(bucket_bytes=BUCKET, verify=verify, segment_bytes=segment_bytes)
            if rank == 0:
                sender = Sender(transport, cfg)
                sent = []
                for v in (1, 2, 3):
                    sent.append(sender.send(TensorSource(weights(v)), version=v))
                    planned.append(built[0])
                return sent, planned
            receiver = Receiver(transport, specs())
            results = []
            for v in (1, 2, 3):
                target = Collect()
                metrics = receiver.receive(target)
                results.append((target.matches(weights(v)), receiver.version, metrics.apply_s is not None))
                planned.append(built[0])
            return results, planned
    finally:
        RangeChecksums.__init__ = init


@pytest.mark.parametrize(
    "backend,kind,world,verify,segment_bytes",
    [
        ("cpu", "broadcast", 2, True, None),
        ("cpu", "broadcast", 3, True, None),
        ("cpu", "broadcast", 3, False, 4096),  # segments, applied as they arrive, to two receivers
        ("cpu", "ipc", 3, True, None),
        ("sim", "broadcast", 2, True, None),
        ("sim", "broadcast", 2, False, 4096),
        ("sim", "ipc", 2, True, None),
    ],
)
def test_weights_arrive_exactly_across_consecutive_syncs(backend, kind, world, verify, segment_bytes):
    results = run_group(roundtrip_worker, world, args=(backend, kind, verify, segment_bytes), timeout=90)
    sender_metrics = results[0][0]
    for receiver, _ in results[1:]:
        assert receiver == [(True, 1, True), (True, 2, True), (True, 3, True)]
    for _, planned in results:  # a verified sync plans its checksums with its layout, once per bucket
        assert planned == ([sender_metrics[0].buckets] * 3 if verify else [0, 0, 0])
    total = sum(t.numel() * t.element_size() for _, t in weights(0))
    first, second, _ = sender_metrics
    assert first.bytes == total and first.tensors == 5 and first.buckets > 5
    assert not first.plan_reused and second.plan_reused  # layout built once, reused while metadata is unchanged
    assert first.apply_s is None and first.pack_s is not None  # the sender applies nothing


# ---- bypass_cpu and staged give identical bytes; wire dtype cast ---------------------
class RecordingTransport(BroadcastTransport):
    """Keeps a copy of the slot each bucket arrived in (padding included)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.buckets: list[bytes] = []

    def receive_segments(self, land, complete):
        last = {k: j for k, j, _, _ in self._order}

        def recording(k, j, landed, status):
            complete(k, j, landed, status)
            if j == last[k]:
                self.buckets.append(bytes(self.buffer(k).numpy()))

        return super().receive_segments(land, recording)


SEGMENT = 4096  # the smallest allowed: the 16 KiB pieces travel in segments of their own


def modes_worker(rank, world, backend):
    """The same weights sent bypass_cpu and staged, with and without verification (which
    also decides whether big segments go straight from the tensors) and segments."""
    modes = [(bypass, verify, segment) for verify in (True, False) for segment in (SEGMENT, None) for bypass in (True, False)]
    with hal.use(backend):
        transport = RecordingTransport(None, src=0)
        if rank == 0:
            src = TensorSource(weights(7))
            for version, (bypass, verify, segment) in enumerate(modes, 1):
                cfg = SyncConfig(bucket_bytes=BUCKET, bypass_cpu=bypass, verify=verify, segment_bytes=segment)
                Sender(transport, cfg).send(src, version=version)
            # fp32 trainer weights travel as bf16
            Sender(transport, SyncConfig(bucket_bytes=BUCKET, wire_dtype=torch.bfloat16, segment_bytes=SEGMENT)).send(src, version=99)
            return None
        receiver = Receiver(transport, specs())
        received = []
        for bypass, verify, segment in modes:
            transport.buckets = []
            target = Collect()
            receiver.receive(target)
            plan = receiver.plans.get(specs(), BUCKET, verify, segment)
            data = [[raw[o : o + n] for o, n in b.checksum_ranges] for b, raw in zip(plan.buckets, transport.buckets)]
            sums = [raw[b.checksum_offset : b.nbytes] for b, raw in zip(plan.buckets, transport.buckets)]
            received.append((data, sums, target.matches(weights(7))))
        same_data = all(r[0] == received[0][0] for r in received) and len(received[0][0]) > 1
        same_sums = received[0][1] == received[1][1] == received[2][1] == received[3][1] and received[0][1][0]
        all_match = all(r[2] for r in received)
        bf16 = Receiver(transport, specs(torch.bfloat16), version=1)
        target = Collect()
        bf16.receive(target)
        expected = [(n, t.to(torch.bfloat16) if t.is_floating_point() else t) for n, t in weights(7)]
        return same_data and bool(same_sums), all_match, target.matches(expected)


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_bypass_cpu_and_staged_send_identical_bytes_and_wire_dtype_casts(backend):
    _, (identical, all_match, cast_ok) = run_group(modes_worker, 2, args=(backend,), timeout=90)
    assert identical
    assert all_match
    assert cast_ok


# ---- one receiver on gloo: point-to-point transfers; more receivers: broadcasts -------
def transfer_kind_worker(rank, world):
    transport = BroadcastTransport(None, src=0)
    cfg = SyncConfig(bucket_bytes=BUCKET, segment_bytes=SEGMENT)
    if rank == 0:
        Sender(transport, cfg).send(TensorSource(weights(8)), version=1)
        return transport.point_to_point
    target = Collect()
    Receiver(transport, specs()).receive(target)
    return transport.point_to_point, target.matches(weights(8))


@pytest.mark.parametrize("world", [2, 3])
def test_a_single_receiver_on_gloo_gets_point_to_point_transfers(world):
    sender, *receivers = run_group(transfer_kind_worker, world, timeout=90)
    assert sender is (world == 2)
    assert receivers == [(world == 2, True)] * (world - 1)


def library_worker(rank, world):
    from hal.backends.cpu import CpuBackend

    class NcclNamed(CpuBackend):  # a device backend whose own library is NCCL, here in a gloo group
        dist_backend = "nccl"

    transport = BroadcastTransport(None, src=0)
    cfg = SyncConfig(bucket_bytes=BUCKET, segment_bytes=SEGMENT)
    if rank == 0:
        Sender(transport, cfg, backend=NcclNamed()).send(TensorSource(weights(8)), version=1)
    else:
        target = Collect()
        Receiver(transport, specs(), backend=NcclNamed()).receive(target)
        assert target.matches(weights(8))
    return transport.point_to_point, transport._traits.follows_streams


def test_the_groups_own_library_decides_how_transfers_go_not_the_devices():
    # A CUDA tensor in a gloo group is moved by gloo: the host must wait for the pack
    # before each transfer (gloo does not follow streams), and one receiver gets
    # point-to-point transfers. Taking NCCL's traits from the device would skip the wait.
    assert run_group(library_worker, 2, timeout=90) == [(True, False), (True, False)]


# ---- large tensors skip the buckets: sent from their memory, received into their destination
class TransferLog(BroadcastTransport):
    """Notes the address of every transfer sent or received."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.addresses: list[int] = []

    def _transfer(self, tensor, what):
        if "status" not in what and "failure" not in what:  # the bytes of a segment
            self.addresses.append(tensor.data_ptr())
        return super()._transfer(tensor, what)


def _holding(tensors, addresses):
    """The names of the tensors some transfer went straight from or into."""
    return {n for n, t in tensors for a in addresses if t.data_ptr() <= a < t.data_ptr() + t.numel() * t.element_size()}


def in_place_worker(rank, world, backend):
    with hal.use(backend):
        transport = TransferLog(None, src=0)
        cfg = SyncConfig(bucket_bytes=BUCKET, segment_bytes=SEGMENT)
        if rank == 0:
            source = weights(4)
            Sender(transport, cfg).send(TensorSource(source), version=1)
            Sender(transport, cfg).send(TensorSource(source), version=2)
            packed = len(_holding(source, transport.addresses)) < len(transport.addresses)
            return _holding(source, transport.addresses), packed
        receiver = Receiver(transport, specs())
        destinations = allocate(specs(), fill=float("nan"))
        target = copy_into(destinations)
        receiver.receive(target)
        first = (
            _holding(destinations.items(), transport.addresses),
            all(torch.equal(destinations[n], t) for n, t in weights(4)),
            receiver.reassembly_bytes,
        )
        # a destination in another dtype than the wire is not written in place: copied (cast) instead
        transport.addresses = []
        mixed = dict(destinations, **{"layers.1.w": torch.zeros(64, 64, dtype=torch.float64)})
        receiver.receive(copy_into(mixed))
        exact = torch.equal(mixed["layers.1.w"], weights(4)[3][1].double())
        return first, (_holding(mixed.items(), transport.addresses), exact)


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_large_tensors_go_from_the_sender_tensor_into_the_receiver_destination(backend):
    (sent_direct, packed_too), (first, second) = run_group(in_place_worker, 2, args=(backend,), timeout=90)
    # 76 KiB and 16 KiB: transfers of their own; "step" (8 bytes) is alone in its transfer too
    assert sent_direct == {"embed.weight", "layers.1.w", "step"}
    assert packed_too  # the other small tensors travelled packed in a slot
    received_in_place, correct, reassembly = first
    assert received_in_place == {"embed.weight", "layers.1.w", "step"} and correct
    assert reassembly == 0  # the embedding spans buckets, but landed in its destination: no reassembly buffer
    received_in_place, exact = second
    assert received_in_place == {"embed.weight", "step"} and exact


# ---- the sender's event wait is what makes the sim backend correct --------------------
def missing_wait_worker(rank, world, skip_wait):
    from hal.backends.sim import SimBackend

    with hal.use(SimBackend(latency=0.02)):
        transport = BroadcastTransport(None, src=0)
        cfg = SyncConfig(bucket_bytes=BUCKET)
        if rank == 0:
            if skip_wait:
                BroadcastTransport._order_after = lambda self, ready: None  # the bug under test
            Sender(transport, cfg).send(TensorSource(weights(3)), version=1)
            return None
        target = Collect()
        Receiver(transport, specs()).receive(target)
        return target.matches(weights(3))


def test_sim_backend_exposes_a_missing_event_wait_in_the_sender():
    assert run_group(missing_wait_worker, 2, args=(False,), timeout=90)[1] is True
    assert run_group(missing_wait_worker, 2, args=(True,), timeout=90)[1] is False


# ---- versions and bad input ----------------------------------------------------------
def rejections_worker(rank, world):
    """Several refused syncs, each followed by proof that the group still works."""
    transport = BroadcastTransport(None, src=0)
    cfg = SyncConfig(bucket_bytes=BUCKET)
    outcome = []

    def attempt(fn):
        try:
            fn()
            outcome.append("ok")
        except SyncError as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")

    if rank == 0:
        sender = Sender(transport, cfg)
        good = TensorSource(weights(5))
        attempt(lambda: sender.send(good, version=5))
        attempt(lambda: sender.send(good, version=4))  # older than the receiver's
        bad_shape = [(n, t if n != "layers.0.w" else torch.zeros(7, 33)) for n, t in weights(5)]
        attempt(lambda: sender.send(TensorSource(bad_shape), version=6))
        attempt(lambda: sender.send(TensorSource(weights(5) + [("extra.bias", torch.zeros(3))]), version=6))
        bad_dtype = [(n, t.double() if n == "layers.0.b" else t) for n, t in weights(5)]
        attempt(lambda: sender.send(TensorSource(bad_dtype), version=6))
        attempt(lambda: sender.send(TensorSource(weights(6)), version=6))  # into a transposed destination
        attempt(lambda: sender.send(TensorSource(weights(6)), version=6))
        return outcome, None
    receiver = Receiver(transport, specs())
    target = Collect()
    calls = []
    for _ in range(5):
        before = target.calls
        attempt(lambda: receiver.receive(target))
        calls.append(target.calls - before)
    engine = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs()}
    engine["layers.0.w"] = torch.zeros(7, 33)  # same element count, transposed
    attempt(lambda: receiver.receive(copy_into(engine)))
    untouched = all(not t.any() for t in engine.values())
    attempt(lambda: receiver.receive(target))
    return outcome, (receiver.version, calls, target.matches(weights(6)), untouched)


def test_stale_versions_and_mismatched_specs_fail_every_rank_before_anything_is_applied():
    (sent, _), (received, (version, calls, final_ok, untouched)) = run_group(rejections_worker, 2, timeout=90)
    for outcomes in (sent, received):
        assert outcomes[0] == "ok" and outcomes[6] == "ok"
        assert outcomes[1].startswith("StaleVersionError") and "holds weight version 5" in outcomes[1]
        assert outcomes[2].startswith("SpecMismatchError")
        assert "'layers.0.w': expected shape (33, 7), got (7, 33)" in outcomes[2]
        assert "'extra.bias': not a parameter this receiver accepts" in outcomes[3]
        assert "'layers.0.b': expected dtype torch.float32, got torch.float64" in outcomes[4]
        assert "'layers.0.w': the engine's destination has shape (7, 33), the sync carries (33, 7)" in outcomes[5]
    assert calls[1:5] == [0, 0, 0, 0]  # refused syncs applied nothing
    assert untouched
    assert version == 6 and final_ok


def one_bad_receiver_worker(rank, world):
    transport = BroadcastTransport(None, src=0)
    cfg = SyncConfig(bucket_bytes=BUCKET)
    try:
        if rank == 0:
            Sender(transport, cfg).send(TensorSource(weights(1)), version=1)
        else:
            accepted = specs() if rank == 1 else [s for s in specs() if s.name != "layers.1.w"]
            target = Collect()
            try:
                Receiver(transport, accepted).receive(target)
            finally:
                if target.calls:
                    return "applied"
        return "ok"
    except SpecMismatchError as exc:
        return str(exc)


def test_one_receiver_rejecting_stops_every_rank():
    results = run_group(one_bad_receiver_worker, 3, timeout=90)
    assert all("'layers.1.w': not a parameter this receiver accepts" in r for r in results), results
    assert "rank 2" in results[0] and "rank 2" in results[1]


# ---- verification and failures during the data phase ---------------------------------
class CorruptingTransport(BroadcastTransport):
    """Flips the first byte of bucket 2 once it has arrived."""

    def receive_segments(self, land, complete):
        def corrupting(k, j, landed, status):
            if k == 2 and not getattr(self, "flipped", False):
                self.buffer(2)[0] ^= 0xFF
                self.flipped = True
            complete(k, j, landed, status)

        return super().receive_segments(land, corrupting)


def corruption_worker(rank, world, verify):
    transport = CorruptingTransport(None, src=0)
    cfg = SyncConfig(bucket_bytes=BUCKET, verify=verify)
    try:
        if rank == 0:
            Sender(transport, cfg).send(TensorSource(weights(2)), version=1)
            return "ok"
        receiver = Receiver(transport, specs())
        target = Collect()
        receiver.receive(target)
        return f"ok matches={target.matches(weights(2))}"
    except ChecksumMismatchError as exc:
        return f"checksum: {exc} version={None if rank == 0 else receiver.version}"


def test_verification_catches_corrupted_bytes_on_every_rank():
    sender, receiver = run_group(corruption_worker, 2, args=(True,), timeout=90)
    assert sender.startswith("checksum:") and "checksum mismatch for parameter(s) 'embed.weight'" in sender
    assert receiver.startswith("checksum:") and receiver.endswith("version=None")
    # the same corruption goes unnoticed without verification: the check is what catches it
    assert run_group(corruption_worker, 2, args=(False,), timeout=90)[1] == "ok matches=False"


def apply_failure_worker(rank, world):
    transport = BroadcastTransport(None, src=0)
    cfg = SyncConfig(bucket_bytes=BUCKET)
    if rank == 0:
        sender = Sender(transport, cfg)
        try:
            sender.send(TensorSource(weights(1)), version=1)
        except SyncError as exc:
            first = f"{type(exc).__name__}: {exc}"
        sender.send(TensorSource(weights(2)), version=2)
        return first, sender.version
    receiver = Receiver(transport, specs())

    def explode(pairs):
        raise RuntimeError("engine refused the tensor")

    try:
        receiver.receive(explode)
    except SyncError:
        pass
    failed_version = receiver.version
    target = Collect()
    receiver.receive(target)
    return failed_version, receiver.version, target.matches(weights(2))


def test_a_failed_apply_is_never_reported_as_success():
    (message, sender_version), (failed_version, version, ok) = run_group(apply_failure_worker, 2, timeout=90)
    assert "rank 1: RuntimeError: engine refused the tensor" in message
    assert failed_version is None  # the failed sync did not advance the version
    assert (sender_version, version, ok) == (2, 2, True)


def dead_receiver_worker(rank, world, mode):
    transport = BroadcastTransport(None, src=0)
    cfg = SyncConfig(bucket_bytes=BUCKET, timeout_s=3.0)
    if rank == 0:
        start = time.monotonic()
        try:
            Sender(transport, cfg).send(TensorSource(weights(1)), version=1)
            return "sent", time.monotonic() - start
        except PeerError as exc:
            return f"PeerError: {exc}", time.monotonic() - start

    def die(pairs):
        if mode == "exit":
            os._exit(3)
        time.sleep(12)  # stops answering for far longer than timeout_s
        raise SystemExit("stalled receiver gives up")

    Receiver(transport, specs(), timeout_s=3.0).receive(die)


@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_a_dead_or_silent_receiver_fails_the_sender_within_the_timeout(mode):
    results = run_group(dead_receiver_worker, 2, args=(mode,), timeout=60, allow_failure=True)
    message, seconds = results[0]
    assert message.startswith("PeerError:"), message
    assert seconds < 10  # bounded by timeout_s (3 s), not by the receiver's 12 s stall


# ---- misuse --------------------------------------------------------------------------
def misuse_worker(rank, world):
    transport = BroadcastTransport(None, src=0)
    problems = []
    for make in (
        lambda: Receiver(transport, specs()) if rank == 0 else Sender(transport),
        lambda: Receiver(transport, specs() + specs()) if rank else Sender(transport).send(weights(0), version=-1),
    ):
        try:
            make()
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def test_misuse_is_rejected_with_a_clear_error():
    sender, receiver = run_group(misuse_worker, 2, timeout=60)
    assert "Receiver on rank 0, which is the transport's sender" in sender[0]
    assert "version must be a non-negative int" in sender[1]
    assert "Sender on rank 1" in receiver[0]
    assert "'embed.weight' is listed twice" in receiver[1]
