"""The one place verl-hal touches verl's private names, and the verl releases it was checked against.

verl's public surface for plugins (`verl.plugin.platform.PlatformBase`,
`PlatformRegistry`, `get_platform`; `verl.checkpoint_engine.CheckpointEngine`,
`CheckpointEngineRegistry`; `verl.workers.engine.EngineRegistry.register`) is used
directly elsewhere. What verl offers no public way to ask goes through this module, each
function saying what it reaches into; when verl moves one of these, this file is the one
to change. Importing this module imports no verl module.
"""

from __future__ import annotations

import functools
from importlib import metadata

from hal.integrations._shared import release_of

# The verl releases (major, minor) whose plugin interfaces verl-hal was checked against.
SUPPORTED_VERL = ((0, 9),)


@functools.lru_cache(maxsize=1)
def verl_version() -> str:
    """The installed verl's version (from its distribution metadata; verl is not imported)."""
    try:
        return metadata.version("verl")
    except metadata.PackageNotFoundError:
        return "not installed"


def unsupported_verl() -> str | None:
    """None when the installed verl is one of `SUPPORTED_VERL`, else a one-line reason."""
    version = verl_version()
    if release_of(version) in SUPPORTED_VERL:
        return None
    wanted = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VERL)
    return f"verl-hal's verl plugin was checked against verl {wanted}; verl {version} is installed (see hal/integrations/verl_internals.py)"


def platform_chosen() -> bool:
    """Whether verl has chosen its platform singleton in this process: reads
    `verl.plugin.platform.platform_manager._current_platform` (verl has no public query;
    `get_platform()` would choose one)."""
    from verl.plugin.platform import platform_manager

    return platform_manager._current_platform is not None
