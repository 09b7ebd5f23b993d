"""How a sync's bytes travel: the `Transport` contract (`base`) and its three kinds,
`BroadcastTransport` over a process group (`broadcast`), `IpcTransport` through same-node
shared memory (`ipc`), and `HierarchicalTransport`, the network once per node (`hierarchical`).

A transport owns its data path and has a control channel (hal.sync.wire) over its group;
it is not one. It knows a plan's buckets, never what a tensor is for.
"""

from hal.sync.transport.base import Transport
from hal.sync.transport.broadcast import BroadcastTransport
from hal.sync.transport.hierarchical import HierarchicalTransport
from hal.sync.transport.ipc import IpcTransport

__all__ = [
    "BroadcastTransport",
    "HierarchicalTransport",
    "IpcTransport",
    "Transport",
]
