"""Functions run in spawned child processes by the backend tests (importable by name)."""

from __future__ import annotations


def open_shared(rank: int, world_size: int, backend_name: str, handle, fill: float) -> list[float]:
    """Map the exporter's tensor, report what it holds, then overwrite it with `fill`."""
    import hal

    backend = hal.get_backend(backend_name)
    tensor = backend.import_ipc(handle)
    seen = tensor.cpu().tolist()
    tensor.fill_(fill)
    backend.synchronize()
    return seen
