"""The `verl.plugins` entry point: registers verl's platform "hal" and checkpoint engine "hal".

verl 0.9.1 imports every entry point of the group `verl.plugins` when `verl` itself is
imported (unless `VERL_USE_EXTERNAL_PLUGINS=none`). Importing this module registers two
classes, and does nothing else: no patch of verl or torch, no device touched, no
torch_npu or vLLM imported, no backend resolved, no platform chosen.

    VERL_PLATFORM=hal                                        # verl's device code through hal
    actor_rollout_ref.rollout.checkpoint_engine.backend=hal  # weight sync through hal.sync

verl swallows an exception raised while it loads a plugin (it logs it at debug level),
so a verl release this plugin was not checked against gets a warning here, not an error.
docs/verl.md has the settings.
"""

from __future__ import annotations

import logging

from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.plugin.platform import PlatformRegistry

from hal.integrations.verl.checkpoint import HalCheckpointEngine
from hal.integrations.verl.internals import unsupported_verl
from hal.integrations.verl.platform import HalPlatform

# The name both registries know verl-hal by: VERL_PLATFORM=hal, checkpoint_engine.backend=hal.
NAME = "hal"

_reason = unsupported_verl()
if _reason is not None:
    logging.getLogger(__name__).warning("%s", _reason)

PlatformRegistry.register(platform=NAME)(HalPlatform)
CheckpointEngineRegistry.register(NAME)(HalCheckpointEngine)
