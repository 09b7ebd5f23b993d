"""The engine side of a sync.

- `receiver`: `Receiver`, one sender's sync checked, landed and concluded (`IncomingSync`);
- `delivery`: where each segment lands, which tensors it completes, the handover to the sink;
- `sharded`: `ShardedReceiver`, every trainer rank's share at once (M-to-N);
- `assembly`: whole tensors put together from the senders' shares;
- `links`: `LinkReceiver`, each engine worker only its own pieces, from every trainer rank;
- `landing`: `LandingSink`, those pieces landed straight in the engine's layers (`EngineLayers`);
- `engine_specs`: the specs an engine holds, read from its checkpoint, config or module.

Which of them an engine holds: hal.sync.endpoints (`make_receiver`).
"""

from hal.sync.receive.engine_specs import allocate, specs_from_safetensors, total_bytes
from hal.sync.receive.landing import EngineLayers, LandingSink
from hal.sync.receive.links import LinkReceiver
from hal.sync.receive.receiver import Receiver
from hal.sync.receive.sharded import ShardedReceiver

__all__ = [
    "EngineLayers",
    "LandingSink",
    "LinkReceiver",
    "Receiver",
    "ShardedReceiver",
    "allocate",
    "specs_from_safetensors",
    "total_bytes",
]
