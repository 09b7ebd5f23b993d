"""How a sync's bytes travel: the `Transport` contract (`base`) and its kinds,
`BroadcastTransport` over a process group (`broadcast`), `IpcTransport` through same-node
shared memory (`ipc`), and `HierarchicalTransport`, the network once per node (`hierarchical`);
`PeerTransport`, one link of a group point to point, each receiver only its own (`peer`).

A transport owns its data path and has a control channel (hal.sync.wire) over its group;
it is not one. It knows a plan's buckets, never what a tensor is for.
"""

from hal.sync.transport.base import Transport
from hal.sync.transport.broadcast import BroadcastTransport
from hal.sync.transport.hierarchical import HierarchicalTransport
from hal.sync.transport.ipc import IpcTransport
from hal.sync.transport.peer import PeerChannel, PeerTransport, peer_links

__all__ = [
    "BroadcastTransport",
    "HierarchicalTransport",
    "IpcTransport",
    "PeerChannel",
    "PeerTransport",
    "Transport",
    "peer_links",
]
