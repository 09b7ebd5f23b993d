"""The sending side of a weight sync: one implementation for every backend.

Per sync: declare the tensors (header), let every receiver check them, then for each
bucket k pack it on the pack stream while bucket k-1 is in flight, and send it once its
pack event completed. Two slots alternate; a slot is packed again only after the
transport says its previous bucket is done. There is no global synchronize in the
loop: ordering comes from events.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import hal
from hal import kernels
from hal.backend import Backend, Event
from hal.sync import errors
from hal.sync.config import SyncConfig, default_bucket_bytes
from hal.sync.metrics import PhaseTimer, SyncMetrics
from hal.sync.plan import Bucket, BucketPlan, PlanCache, Segment, TensorSpec
from hal.sync.source import as_source
from hal.sync.transport import Transport


def header_of(plan: BucketPlan, version: int) -> dict[str, Any]:
    return {
        "version": version,
        "specs": [(s.name, s.shape, str(s.dtype).removeprefix("torch.")) for s in plan.specs],
        "bucket_bytes": plan.bucket_bytes,
        "verify": plan.verify,
        "segment_bytes": plan.segment_bytes,
        "digest": plan.digest,
    }


class Sender:
    """Sends a source's tensors to every receiver of `transport`.

    Reused across syncs: it keeps the bucket layout (while metadata is unchanged), the
    pack stream and the pinned staging buffer, and nothing else.
    """

    def __init__(self, transport: Transport, config: SyncConfig | None = None, *, backend: Backend | None = None) -> None:
        if not transport.is_sender:
            raise ValueError(f"Sender on rank {transport.rank}, but the transport's sender is rank {transport.src}")
        self.transport = transport
        self.config = config or SyncConfig()
        self.backend = backend or hal.current()
        self.transport.timeout_s = self.config.timeout_s
        # None until the first sync when derived from free memory (it depends on the largest tensor)
        self.bucket_bytes: int | None = self.config.bucket_bytes
        self.plans = PlanCache()
        self.version: int | None = None
        self._stream = self.backend.new_stream()
        self._staging: torch.Tensor | None = None
        self._sized_for = 0
        # On CUDA/NPU the source tensors are produced, and collectives issued, on the current
        # stream while packs run on our own: the two must wait on each other on the device.
        self._cross_stream_waits = self.backend.collectives_follow_streams
        # Segments may go straight from a tensor's memory: not when staging through the host
        # (the point of staging), not when verifying (checksums are computed over the slot),
        # not through shared memory (the bytes must be in the slot).
        self._sends_from_tensors = self.config.bypass_cpu and not self.config.verify and transport.segmented

    def _wire_specs(self, metadata: list[TensorSpec]) -> list[TensorSpec]:
        wire = self.config.wire_dtype
        if wire is None:
            return metadata
        return [TensorSpec(s.name, s.shape, wire) if s.dtype.is_floating_point else s for s in metadata]

    def send(self, source: Any, *, version: int) -> SyncMetrics:
        """Send every tensor of `source` as weight version `version`; returns this sync's metrics.

        Raises a `SyncError` subclass (on this and every receiving rank) if any rank
        rejected the header, failed to apply, or did not answer in time.
        """
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version must be a non-negative int (e.g. the global step), got {version!r}")
        start = time.perf_counter()
        timer = PhaseTimer()
        source = as_source(source)
        metadata = list(source.metadata())
        builds = self.plans.builds
        wire_specs = self._wire_specs(metadata)
        self._size_buckets(wire_specs)
        segment_bytes = self.config.segment_bytes if self.transport.segmented else None
        plan = self.plans.get(wire_specs, self.bucket_bytes, self.config.verify, segment_bytes)
        where = f"sync of version {version}"

        self.transport.broadcast_object(header_of(plan, version))
        errors.raise_if_any(self.transport.agree(None, "header check"), self.transport.rank, where)
        self.transport.setup(self.backend, plan.max_bucket_nbytes)
        if not self.config.bypass_cpu:
            self._ensure_staging(plan.max_bucket_nbytes)

        local_error = None
        try:
            self._send_buckets(plan, iter(source), metadata, timer)
        except errors.PeerError:
            raise
        except Exception as exc:  # the protocol still completes below, so nobody hangs
            local_error = errors.encode_exception(exc)
        errors.raise_if_any(self.transport.agree(local_error, "apply status"), self.transport.rank, where)

        self.version = version
        return SyncMetrics(
            version=version,
            bytes=plan.total_bytes,
            buckets=len(plan.buckets),
            tensors=len(plan.specs),
            gather_s=timer.get("gather"),
            pack_s=timer.get("pack"),
            transfer_s=timer.get("transfer"),
            total_s=time.perf_counter() - start,
            plan_reused=self.plans.builds == builds,
        )

    def _size_buckets(self, specs: list[TensorSpec]) -> None:
        """Derive the bucket size once, and again only if a larger tensor appears, so that
        free-memory noise between syncs does not change the layout."""
        if self.config.bucket_bytes is not None:
            return
        largest = max((s.nbytes for s in specs), default=0)
        if self.bucket_bytes is None or largest > self._sized_for:
            self.bucket_bytes = default_bucket_bytes(self.backend, largest)
            self._sized_for = largest

    def _ensure_staging(self, nbytes: int) -> None:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None  # free the old one before allocating the larger
            self._staging = self.backend.empty_pinned(nbytes)

    def _send_buckets(self, plan: BucketPlan, it: Any, metadata: list[TensorSpec], timer: PhaseTimer) -> None:
        transport = self.transport
        alive: dict[int, list[torch.Tensor]] = {}  # keeps sources alive until their bucket is sent
        current: torch.Tensor | None = None
        failure: Exception | None = None
        for bucket in plan.buckets:
            k, slot = bucket.index, bucket.index % 2
            if k >= 2:
                with timer("transfer"):
                    transport.wait_sent(k - 2)
                if self._cross_stream_waits:  # the send of k-2 (on the current stream) read this slot
                    self._stream.wait_stream(self.backend.current_stream())
                alive.pop(k - 2, None)
            keep = alive.setdefault(k, [])
            for segment in bucket.segments:
                data = None
                if failure is None:
                    try:
                        gathered = timer.get("gather") or 0.0
                        began = time.perf_counter()
                        current, data = self._pack(bucket, segment, slot, it, metadata, current, keep, timer)
                        # on synchronous backends the copies happen here, not in _wait_packed
                        timer.add("pack", time.perf_counter() - began - ((timer.get("gather") or 0.0) - gathered))
                    except Exception as exc:
                        failure = exc  # keep sending so every rank reaches the final agreement
                if data is None:
                    data = transport.slot(slot)[segment.start : segment.stop]
                event = self._stream.record_event()
                with timer("pack"):
                    self._wait_packed(event)
                transport.send(k, data)
        with timer("transfer"):
            transport.finish(len(plan.buckets))
        alive.clear()
        if failure is not None:
            raise failure

    def _pack(
        self,
        bucket: Bucket,
        segment: Segment,
        slot: int,
        it: Any,
        metadata: list[TensorSpec],
        current: torch.Tensor | None,
        keep: list[torch.Tensor],
        timer: PhaseTimer,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Pack one segment; returns the tensor whose piece is being packed and the bytes
        to send: the segment's range of the slot, or the tensor's own bytes."""
        backend, stream = self.backend, self._stream
        target = self.transport.slot(slot) if self.config.bypass_cpu else self._staging
        for index, lo, hi in segment.parts:
            piece = bucket.pieces[index]
            spec = piece.spec
            if piece.is_first and lo == 0:
                with timer("gather"):
                    current = self._next(it, spec, metadata)
                if self._cross_stream_waits:  # a gather (e.g. full_tensor) may still be running
                    stream.wait_stream(backend.current_stream())
                if not piece.is_whole and current.dtype != spec.dtype:
                    wire = backend.empty(tuple(current.shape), spec.dtype)  # cast once, then chunk its bytes
                    backend.copy_(wire, current, stream=stream)
                    current = wire
                if not (lo == 0 and hi == spec.nbytes) and not current.is_contiguous():
                    current = current.contiguous()  # sent in ranges: one flat copy, not one per range
                keep.append(current)
            if self._sends_in_place(segment, current, spec, hi - lo):
                keep.append(current)  # also when its first range went in an earlier bucket
                return current, kernels.as_bytes(current)[piece.tensor_offset + lo : piece.tensor_offset + hi]
            if hi == lo:
                continue
            if piece.is_whole and lo == 0 and hi == piece.nbytes:
                kernels.pack_into(backend, target, piece.offset, current, spec.dtype, stream=stream)
            else:
                # a range of the piece, in wire bytes (ALIGNMENT-aligned: whole elements)
                kernels.pack_range_into(backend, target, piece.offset + lo, current, spec.dtype, piece.tensor_offset + lo, hi - lo, stream=stream)
        if segment.stop == bucket.nbytes and bucket.nbytes > bucket.checksum_offset:  # checksums travel last
            sums = kernels.typed_view(target, bucket.checksum_offset, (len(bucket.pieces),), torch.int64)
            backend.launch(stream, kernels.checksums_into, sums, target, bucket.checksum_ranges())
        if not self.config.bypass_cpu:
            backend.copy_(self.transport.slot(slot)[segment.start : segment.stop], target[segment.start : segment.stop], stream=stream)
        return current, self.transport.slot(slot)[segment.start : segment.stop]

    def _sends_in_place(self, segment: Segment, tensor: torch.Tensor, spec: TensorSpec, nbytes: int) -> bool:
        """Whether a segment can go straight from the tensor's memory, skipping the pack:
        it holds exactly one range of one tensor that is already contiguous, in its wire
        dtype and where the slots are."""
        return (
            self._sends_from_tensors
            and nbytes > 0
            and segment.stop - segment.start == nbytes
            and len(segment.parts) == 1
            and tensor.dtype == spec.dtype
            and tensor.is_contiguous()
            and tensor.device == self.transport.slot(0).device
        )

    def _next(self, it: Any, spec: TensorSpec, metadata: list[TensorSpec]) -> torch.Tensor:
        try:
            name, tensor = next(it)
        except StopIteration:
            raise errors.SpecMismatchError(f"source ended before parameter {spec.name!r} that its metadata() declared") from None
        if name != spec.name:
            raise errors.SpecMismatchError(f"source yielded {name!r} where its metadata() declared {spec.name!r}; iteration must follow metadata order")
        if tuple(tensor.shape) != spec.shape:
            raise errors.SpecMismatchError(f"parameter {name!r}: metadata() declared shape {spec.shape}, iteration yielded {tuple(tensor.shape)}")
        return tensor

    def _wait_packed(self, event: Event) -> None:
        """Order the transfer of a bucket after its pack.

        NCCL/HCCL collectives follow the issuing stream, so a device-side wait suffices;
        gloo and the IPC signal run on the host, so the host waits for the event.
        """
        if self.backend.collectives_follow_streams and not self.transport.host_ordered:
            self.backend.current_stream().wait_event(event)
        else:
            event.synchronize()
