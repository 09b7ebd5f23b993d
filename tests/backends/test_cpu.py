"""CPU-backend specifics the conformance suite cannot state generically: shared-memory files."""

from __future__ import annotations

import os

import pytest
import torch

from hal.backends.cpu import CpuBackend, SharedMemoryHandle
from tests.conftest import run_python


def test_import_view_of_odd_sized_buffer():
    # 10 bytes do not divide into float32: only the view's own span may be reinterpreted.
    backend = CpuBackend()
    shared = backend.empty_shared(10)
    try:
        view = shared[4:8].view(torch.float32)
        view.fill_(2.5)
        opened = backend.import_ipc(backend.export_ipc(view))
        assert opened.tolist() == [2.5]
        opened.fill_(-1.0)
        assert view.tolist() == [-1.0]
    finally:
        backend.release_shared(shared)


def test_released_buffer_cannot_be_imported():
    backend = CpuBackend()
    shared = backend.empty_shared(16)
    handle = backend.export_ipc(shared)
    backend.release_shared(shared)
    assert not os.path.exists(handle.path)
    with pytest.raises(FileNotFoundError, match=f"shared-memory file {handle.path} is gone"):
        backend.import_ipc(handle)


def test_import_rejects_foreign_handle():
    with pytest.raises(TypeError, match="expected a SharedMemoryHandle, got tuple"):
        CpuBackend().import_ipc(("rebuild", ()))


def test_unreleased_files_are_removed_at_exit():
    result = run_python(
        """
        from hal.backends.cpu import CpuBackend
        backend = CpuBackend()
        kept = backend.empty_shared(32)
        released = backend.empty_shared(32)
        print(backend.export_ipc(kept).path)
        backend.release_shared(released)
        """
    )
    assert result.returncode == 0, result.stderr
    path = result.stdout.strip()
    assert path.startswith(("/dev/shm/verl-hal-", "/tmp/verl-hal-")), path
    assert not os.path.exists(path), f"{path} outlived the process that created it"


def test_handle_is_plain_data():
    handle = SharedMemoryHandle("/dev/shm/x", 8, 0, (2,), (1,), torch.float32)
    import pickle

    assert pickle.loads(pickle.dumps(handle)) == handle
