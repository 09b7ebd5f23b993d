"""Weight sync from a trainer to inference engines, written once for every backend.

    # trainer, rank 0 of a group joining it and the engine workers
    sender = Sender(BroadcastTransport(group), SyncConfig(bucket_bytes=256 << 20))
    metrics = sender.send(model, version=step)

    # each engine worker, built from the engine's own parameter specs
    receiver = Receiver(BroadcastTransport(group), specs)
    receiver.receive(lambda pairs: model.load_weights(pairs))
"""

from hal.sync.config import SyncConfig, default_bucket_bytes
from hal.sync.errors import ChecksumMismatchError, PeerError, SpecMismatchError, StaleVersionError, SyncError
from hal.sync.metrics import SyncMetrics
from hal.sync.plan import BucketPlan, PlanCache, TensorSpec, build_plan
from hal.sync.receiver import Receiver
from hal.sync.sender import Sender
from hal.sync.source import ModuleSource, TensorSource, WeightSource, as_source
from hal.sync.transport import BroadcastTransport, IpcTransport, Transport

__all__ = [
    "BroadcastTransport",
    "BucketPlan",
    "ChecksumMismatchError",
    "IpcTransport",
    "ModuleSource",
    "PeerError",
    "PlanCache",
    "Receiver",
    "Sender",
    "SpecMismatchError",
    "StaleVersionError",
    "SyncConfig",
    "SyncError",
    "SyncMetrics",
    "TensorSource",
    "TensorSpec",
    "Transport",
    "WeightSource",
    "as_source",
    "build_plan",
    "default_bucket_bytes",
]
