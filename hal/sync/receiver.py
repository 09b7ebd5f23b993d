"""The receiving side of a weight sync: built from engine-side specs alone.

A receiver knows the names, shapes and dtypes it accepts (`TensorSpec`s, e.g. from
the engine's own model), never the trainer's model. Per sync it checks the sender's
header against them before anything is applied (every rank learns the verdict), then
takes each bucket into a reused slot and hands zero-copy views to `apply`, while the
next bucket is already on its way where the transport allows.
"""

from __future__ import annotations

import time
from typing import Any, Callable, ClassVar, Iterable

import torch

import hal
from hal import kernels
from hal.backend import Backend
from hal.sync import errors
from hal.sync.config import SyncConfig
from hal.sync.metrics import PhaseTimer, SyncMetrics
from hal.sync.plan import Bucket, BucketPlan, PlanCache, Segment, TensorSpec
from hal.sync.transport import Transport

Apply = Callable[[list[tuple[str, torch.Tensor]]], Any]

_MAX_REPORTED = 5


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise errors.SpecMismatchError(f"header names an unknown dtype {name!r}")
    return dtype


class Receiver:
    """Receives syncs into `apply`, accepting only tensors described by `specs`.

    A sync may carry any subset of `specs` (a LoRA sync sends only adapters).
    `apply` is called as tensors complete: once per segment that completes any (see
    `SyncConfig.segment_bytes`), or once per bucket with `apply_whole_buckets` or
    verification (whose checksums travel at the end of a bucket).
    `version` is the weight version this side holds: set after a sync that every rank
    completed, never after a failed one.
    """

    # True: call apply once per bucket, after its last segment, for targets that pay for
    # tensors of one group (a layer) arriving in different calls.
    apply_whole_buckets: ClassVar[bool] = False

    def __init__(
        self,
        transport: Transport,
        specs: Iterable[TensorSpec],
        config: SyncConfig | None = None,
        *,
        backend: Backend | None = None,
        version: int | None = None,
    ) -> None:
        if transport.is_sender:
            raise ValueError(f"Receiver on rank {transport.rank}, which is the transport's sender")
        self.transport = transport
        self.config = config or SyncConfig()
        self.backend = backend or hal.current()
        self.transport.timeout_s = self.config.timeout_s
        self.specs: dict[str, TensorSpec] = {}
        for spec in specs:
            if not isinstance(spec, TensorSpec):
                raise TypeError(f"Receiver specs must be TensorSpec, got {type(spec).__name__}")
            if spec.name in self.specs:
                raise ValueError(f"parameter {spec.name!r} is listed twice in the receiver's specs")
            self.specs[spec.name] = spec
        self.version = version
        self.plans = PlanCache()
        self._stream = self.backend.new_stream()
        # Buffers for tensors that arrive in chunks, kept across syncs (their size is part of
        # the layout): a fresh one per sync is page-faulted in each time, which cost more
        # than its transfer (docs/benchmarks.md).
        self._reassembly: dict[str, torch.Tensor] = {}

    def _check_header(self, header: dict[str, Any]) -> tuple[BucketPlan | None, str | None]:
        version = header["version"]
        if self.version is not None and version < self.version:
            return None, errors.encode("stale", f"receiver holds weight version {self.version}; refusing older version {version}")
        problems: list[str] = []
        specs: list[TensorSpec] = []
        for name, shape, dtype_name in header["specs"]:
            try:
                dtype = _dtype(dtype_name)
            except errors.SpecMismatchError as exc:
                problems.append(f"parameter {name!r}: {exc}")
                continue
            spec = TensorSpec(name, tuple(shape), dtype)
            specs.append(spec)
            expected = self.specs.get(name)
            if expected is None:
                problems.append(f"parameter {name!r}: not a parameter this receiver accepts")
            elif expected.shape != spec.shape:
                problems.append(f"parameter {name!r}: expected shape {expected.shape}, got {spec.shape}")
            elif expected.dtype != spec.dtype:
                problems.append(f"parameter {name!r}: expected dtype {expected.dtype}, got {spec.dtype}")
        if problems:
            more = f" (+{len(problems) - _MAX_REPORTED} more)" if len(problems) > _MAX_REPORTED else ""
            return None, errors.encode("spec", "; ".join(problems[:_MAX_REPORTED]) + more)
        try:
            self.validate(specs)
        except errors.SpecMismatchError as exc:
            return None, errors.encode("spec", str(exc))
        plan = self.plans.get(specs, header["bucket_bytes"], header["verify"], header["segment_bytes"])
        if plan.digest != header["digest"]:
            return None, errors.encode("spec", f"bucket layout differs from the sender's ({plan.digest} vs {header['digest']}): mismatched verl-hal versions?")
        return plan, None

    @property
    def reassembly_bytes(self) -> int:
        """Memory held across syncs for tensors that arrive in chunks (0 when none do)."""
        return sum(t.numel() for t in self._reassembly.values())

    def validate(self, specs: list[TensorSpec]) -> None:
        """Hook for rules beyond name/shape/dtype, on the whole list a sync carries (e.g.
        "whole layers only"). Raise SpecMismatchError to refuse the sync on every rank
        before anything is applied. The default accepts any subset of `self.specs`."""

    def receive(self, apply: Apply) -> SyncMetrics:
        """Take one sync; `apply(pairs)` is called as tensors complete (see the class doc)
        with zero-copy views that are valid only during the call (copy what you keep, as
        `load_weights` does).
        """
        start = time.perf_counter()
        timer = PhaseTimer()
        rank = self.transport.rank
        builds = self.plans.builds
        header = self.transport.broadcast_object(None)
        version = header["version"]
        where = f"sync of version {version}"
        plan, error = self._check_header(header)
        errors.raise_if_any(self.transport.agree(error, "header check"), rank, where)
        assert plan is not None  # every rank agreed there was no error
        self.transport.setup(self.backend, plan.max_bucket_nbytes)
        chunked = {p.spec.name for b in plan.buckets for p in b.pieces if not p.is_whole}
        for name in set(self._reassembly) - chunked:  # the layout changed: drop what it no longer needs
            del self._reassembly[name]

        local_error = self._receive_buckets(plan, apply, timer)
        errors.raise_if_any(self.transport.agree(local_error, "apply status"), rank, where)
        self.version = version
        return SyncMetrics(
            version=version,
            bytes=plan.total_bytes,
            buckets=len(plan.buckets),
            tensors=len(plan.specs),
            transfer_s=timer.get("transfer"),
            apply_s=timer.get("apply"),
            total_s=time.perf_counter() - start,
            plan_reused=self.plans.builds == builds,
        )

    def _receive_buckets(self, plan: BucketPlan, apply: Apply, timer: PhaseTimer) -> str | None:
        """Runs every bucket through the transport even after a local failure, so the
        ranks stay in step; returns this rank's error, if any."""
        transport, buckets = self.transport, plan.buckets
        local_error: str | None = None
        destinations = self._destinations(plan, apply)
        # With prefetch, both slots' receives are posted before anything is applied:
        # bucket k+2 is posted as soon as bucket k's slot is released.
        ahead = 2 if transport.prefetch else 1
        with timer("transfer"):
            for bucket in buckets[:ahead]:
                self._post(bucket, destinations)
        for bucket in buckets:
            k = bucket.index
            data = transport.slot(k % 2)
            whole_bucket = self.apply_whole_buckets or self._verifying(bucket)  # checksums come last
            pairs: list[tuple[str, torch.Tensor]] = []
            for segment in bucket.segments:
                with timer("transfer"):
                    transport.wait_received(k)
                if local_error is not None:
                    continue
                try:
                    with timer("apply"):  # copies into destinations are the receiver's part of applying
                        pairs += self._arrived(bucket, segment, data, destinations)
                    if whole_bucket and segment.stop != bucket.nbytes:
                        continue
                    if whole_bucket:
                        self._verify(bucket, data)
                    if pairs:
                        with timer("apply"):
                            apply(pairs)
                    pairs = []
                except errors.PeerError:
                    raise
                except Exception as exc:
                    local_error = errors.encode_exception(exc)
            transport.release(k)
            if k + ahead < len(buckets):
                with timer("transfer"):
                    self._post(buckets[k + ahead], destinations)
        transport.finish(len(buckets))
        return local_error

    def _destinations(self, plan: BucketPlan, apply: Apply) -> dict[str, torch.Tensor]:
        """The tensors this sync may write in place: those `apply.destination(name)` names
        that match the wire spec exactly (shape, dtype, contiguous, on the slots' device).

        Looked up afresh every sync. None when verifying (bytes must be checked before
        they land anywhere the engine reads) or over shared memory (no bytes travel).
        """
        lookup = getattr(apply, "destination", None)
        if lookup is None or plan.verify or not self.transport.segmented:
            return {}
        device = self.transport.slot(0).device
        found: dict[str, torch.Tensor] = {}
        for spec in plan.specs:
            tensor = lookup(spec.name)
            if (
                isinstance(tensor, torch.Tensor)
                and tuple(tensor.shape) == spec.shape
                and tensor.dtype == spec.dtype
                and tensor.is_contiguous()
                and tensor.device == device
            ):
                found[spec.name] = tensor
        return found

    @staticmethod
    def _in_place(bucket: Bucket, segment: Segment, destinations: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Where a segment that is exactly one range of a destination's bytes lands, else None."""
        if len(segment.parts) != 1:
            return None
        index, lo, hi = segment.parts[0]
        piece = bucket.pieces[index]
        dest = destinations.get(piece.spec.name)
        if dest is None or hi == lo or segment.stop - segment.start != hi - lo:
            return None
        return kernels.as_bytes(dest)[piece.tensor_offset + lo : piece.tensor_offset + hi]

    def _post(self, bucket: Bucket, destinations: dict[str, torch.Tensor]) -> None:
        slot = self.transport.slot(bucket.index % 2)
        for segment in bucket.segments:
            into = self._in_place(bucket, segment, destinations)
            self.transport.recv(bucket.index, slot[segment.start : segment.stop] if into is None else into)

    def _arrived(
        self, bucket: Bucket, segment: Segment, data: torch.Tensor, destinations: dict[str, torch.Tensor]
    ) -> list[tuple[str, torch.Tensor]]:
        """Move a segment's bytes where they belong and return the tensors it completed.

        Ranges of a tensor with a destination go into the destination (unless received
        there in place), ranges of a tensor larger than a bucket into its reassembly
        buffer; a whole tensor without either is handed out as a view of the slot.
        """
        copied = False
        if self._in_place(bucket, segment, destinations) is None:
            for index, lo, hi in segment.parts:
                piece = bucket.pieces[index]
                spec = piece.spec
                into = destinations.get(spec.name)
                if into is None and piece.is_whole:
                    continue  # viewed in the slot
                if into is None:
                    into = self._reassembly.get(spec.name)
                    if into is None or into.numel() != spec.nbytes:
                        into = self._reassembly[spec.name] = self.backend.empty(spec.nbytes)
                if hi == lo:
                    continue
                if not copied and self.backend.collectives_follow_streams:  # the receive completed on the current stream
                    self._stream.wait_stream(self.backend.current_stream())
                start = piece.tensor_offset + lo
                self.backend.copy_(kernels.as_bytes(into)[start : start + hi - lo], data[piece.offset + lo : piece.offset + hi], stream=self._stream)
                copied = True
        if copied:
            # apply reads the copies on the host, and the slot is reused after this bucket
            self._stream.synchronize()
        pairs: list[tuple[str, torch.Tensor]] = []
        for index, _, hi in segment.parts:
            piece = bucket.pieces[index]
            spec = piece.spec
            if hi != piece.nbytes or not piece.is_last:
                continue  # this tensor has more bytes to come
            if spec.name in destinations:
                pairs.append((spec.name, destinations[spec.name]))
            elif piece.is_whole:
                pairs.append((spec.name, kernels.typed_view(data, piece.offset, spec.shape, spec.dtype)))
            else:
                pairs.append((spec.name, kernels.typed_view(self._reassembly[spec.name], 0, spec.shape, spec.dtype)))
        return pairs

    def _verify(self, bucket: Bucket, data: torch.Tensor) -> None:
        if not self._verifying(bucket):
            return
        sent = kernels.typed_view(data, bucket.checksum_offset, (len(bucket.pieces),), torch.int64)
        got = torch.stack([kernels.checksum(data[o : o + n]) for o, n in bucket.checksum_ranges()])
        bad = (sent != got).nonzero().flatten().tolist()
        if bad:
            names = ", ".join(repr(bucket.pieces[i].spec.name) for i in bad[:_MAX_REPORTED])
            raise errors.ChecksumMismatchError(f"bucket {bucket.index}: checksum mismatch for parameter(s) {names}")

    def _verifying(self, bucket: Bucket) -> bool:
        return bucket.nbytes > bucket.checksum_offset
