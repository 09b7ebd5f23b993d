"""Functions run in spawned child processes by the backend tests (importable by name)."""

from __future__ import annotations


def open_shared(rank: int, world_size: int, backend_name: str, wire: str, fill: float) -> list[float]:
    """Map the exporter's tensor from its JSON handle, report what it holds, then overwrite it with `fill`."""
    import json

    import hal

    backend = hal.get_backend(backend_name)
    tensor = backend.import_ipc(json.loads(wire))
    seen = tensor.cpu().tolist()
    tensor.fill_(fill)
    backend.synchronize()
    return seen
