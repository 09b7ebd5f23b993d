"""What the ranks of a sync say to each other besides the weights' bytes.

- `header`, `header_json`: the typed header (`SyncHeader`) announcing a sync, its JSON, the
  dtype names, and the reading that refuses hostile input;
- `auth`: the token's proofs (in the header, with an engine's init request);
- `channel`: the control plane over a group: the header's challenge and exchange, the
  status before each segment (`SegmentStatus`), the agreement every sync ends with
  (`GroupChannel.agree`), the trainer group's channel;
- `group`: the sync group outside c10d's registry (`join_sync_group`, `SyncGroupSpec`).

Imports the base vocabulary of hal.sync (spec, errors, config) and nothing else of it.
"""

from hal.sync.wire.auth import check_auth, check_init_proof, init_proof
from hal.sync.wire.channel import Complete, GroupChannel, Land, SegmentStatus, SyncChannel, trainer_channel
from hal.sync.wire.group import LOOPBACK, RendezvousServer, SyncGroupSpec, destroy_sync_group, join_sync_group
from hal.sync.wire.header import SyncHeader
from hal.sync.wire.header_json import WIRE_DTYPES, dtype_from_name, dtype_name

__all__ = [
    "Complete",
    "GroupChannel",
    "LOOPBACK",
    "Land",
    "RendezvousServer",
    "SegmentStatus",
    "SyncChannel",
    "SyncGroupSpec",
    "SyncHeader",
    "WIRE_DTYPES",
    "check_auth",
    "check_init_proof",
    "destroy_sync_group",
    "dtype_from_name",
    "dtype_name",
    "init_proof",
    "join_sync_group",
    "trainer_channel",
]
