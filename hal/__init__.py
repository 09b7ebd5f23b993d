"""verl-hal: one device layer for RL post-training on CUDA, Ascend NPU and the CPU.

    import hal
    backend = hal.current()          # resolved from VERL_DEVICE on first use
    stream = backend.new_stream()
    backend.copy_(dst, src, stream=stream)
    done = stream.record_event()

Importing this package touches no device and imports no optional library.
"""

from hal.backends.interface import Backend
from hal.backends.types import BackendUnavailableError, Event, MemoryInfo, Stream
from hal.device import backend_names, current, get_backend, reset, resolution, resolve, use

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "Event",
    "MemoryInfo",
    "Stream",
    "backend_names",
    "current",
    "get_backend",
    "reset",
    "resolution",
    "resolve",
    "use",
]
