"""Weight sync from a trainer to inference engines, written once for every backend.

    # trainer, rank 0 of a group joining it and the engine workers
    sender = Sender(BroadcastTransport(group), SyncConfig(bucket_bytes=256 << 20))
    metrics = sender.send(model, version=step)

    # each engine worker, built from the engine's own parameter specs
    receiver = Receiver(BroadcastTransport(group), specs)
    receiver.receive(copy_into(engine_weights))        # or any Sink, or apply(pairs)

Only the sender takes a `SyncConfig`; receivers read everything from the typed header
of each sync (`SyncHeader`). A sync either completes on every rank or leaves every
engine tensor with its old or its new bytes, and the receiver says whether it is
`consistent` (docs/design.md, "Failures").
"""

from hal.sync.config import DeltaConfig, SyncConfig, WaitBounds, default_bucket_bytes, wire_dtype_for
from hal.sync.endpoints import SENDING, TRANSPORTS, SyncReceiver, SyncSender, TrainerSide, make_receiver, make_sender, open_transport
from hal.sync.errors import (
    AuthError,
    ChecksumMismatchError,
    DeltaBaseError,
    HeaderError,
    PeerError,
    SourceError,
    SpecMismatchError,
    StaleVersionError,
    SyncError,
    VersionError,
)
from hal.sync.wire.header import SyncHeader
from hal.sync.transport.hierarchical import HierarchicalTransport
from hal.sync.metrics import SyncMetrics
from hal.sync.plan.buckets import BucketPlan, PlanCache, build_plan
from hal.sync.spec import TensorSpec
from hal.sync.receive.receiver import Receiver
from hal.sync.sink import CopyInto, copy_into
from hal.sync.send.sender import Sender
from hal.sync.receive.sharded import ShardedReceiver
from hal.sync.send.sharded import ShardedSender
from hal.sync.sink import Sink, SinkPolicy, as_sink
from hal.sync.source import ModuleSource, TensorSource, WeightSource, as_source
from hal.sync.send.gather import TrainerSync
from hal.sync.wire.channel import SegmentStatus
from hal.sync.transport.ipc import IpcTransport
from hal.sync.transport.broadcast import BroadcastTransport
from hal.sync.transport.base import Transport

__all__ = [
    "AuthError",
    "BroadcastTransport",
    "BucketPlan",
    "ChecksumMismatchError",
    "CopyInto",
    "DeltaBaseError",
    "DeltaConfig",
    "HeaderError",
    "HierarchicalTransport",
    "IpcTransport",
    "ModuleSource",
    "PeerError",
    "PlanCache",
    "SENDING",
    "Receiver",
    "SegmentStatus",
    "Sender",
    "ShardedReceiver",
    "ShardedSender",
    "Sink",
    "SinkPolicy",
    "SourceError",
    "SpecMismatchError",
    "StaleVersionError",
    "SyncConfig",
    "SyncError",
    "SyncHeader",
    "SyncMetrics",
    "SyncReceiver",
    "SyncSender",
    "TRANSPORTS",
    "TensorSource",
    "TensorSpec",
    "TrainerSide",
    "TrainerSync",
    "Transport",
    "VersionError",
    "WaitBounds",
    "WeightSource",
    "as_sink",
    "as_source",
    "build_plan",
    "copy_into",
    "default_bucket_bytes",
    "make_receiver",
    "make_sender",
    "open_transport",
    "wire_dtype_for",
]
