"""CPU-backend specifics the conformance suite cannot state generically: anonymous shared
memory (memfd) and its JSON handles, which `import_ipc` must treat as untrusted input."""

from __future__ import annotations

import copy
import glob
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from hal.backends.cpu import SHM_PREFIX, CpuBackend
from tests.conftest import run_python


@pytest.fixture
def shared_view():
    """(backend, handle of a float32 view of 8 elements at byte 16 of a 64-byte shared buffer, view)."""
    backend = CpuBackend()
    shared = backend.empty_shared(64)
    view = shared[16:48].view(torch.float32)
    view.copy_(torch.arange(8, dtype=torch.float32))
    yield backend, backend.export_ipc(view), view
    backend.release_shared(shared)


def test_handle_is_plain_json(shared_view):
    backend, handle, view = shared_view
    assert json.loads(json.dumps(handle)) == handle
    assert handle == {
        "kind": "shm",
        "name": handle["name"],
        "pid": os.getpid(),
        "fd": handle["fd"],
        "storage_nbytes": 64,
        "byte_offset": 16,
        "shape": [8],
        "stride": [1],
        "dtype": "float32",
    }
    assert handle["name"].startswith(f"{SHM_PREFIX}{os.getpid()}-")


def test_shared_memory_has_no_name_in_any_directory(shared_view):
    # nothing to clean up after a crash: the memory is not a file of /dev/shm or /tmp
    _, handle, _ = shared_view
    assert not glob.glob(f"/dev/shm/{handle['name']}*") and not glob.glob(f"/tmp/{handle['name']}*")
    assert os.readlink(f"/proc/self/fd/{handle['fd']}") == f"/memfd:{handle['name']} (deleted)"


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


@pytest.mark.multiprocess
def test_json_round_trip_between_processes(shared_view):
    backend, handle, view = shared_view
    wire = json.dumps(handle)  # what travels: text, never a pickle
    result = run_python(
        f"""
        import json
        from hal.backends.cpu import CpuBackend
        tensor = CpuBackend().import_ipc(json.loads({wire!r}))
        print(json.dumps([tensor.tolist(), str(tensor.dtype), list(tensor.shape)]))
        tensor.mul_(-1)
        """
    )
    assert result.returncode == 0, result.stderr
    seen, dtype, shape = json.loads(result.stdout)
    assert seen == [float(i) for i in range(8)]
    assert (dtype, shape) == ("torch.float32", [8])
    assert view.tolist() == [-float(i) for i in range(8)]  # the child's writes landed in our memory


def test_released_buffer_cannot_be_imported():
    backend = CpuBackend()
    shared = backend.empty_shared(16)
    handle = backend.export_ipc(shared)
    backend.release_shared(shared)
    with pytest.raises(FileNotFoundError, match=f"shared memory {handle['name']} is gone"):
        backend.import_ipc(handle)


@pytest.mark.multiprocess
def test_a_killed_exporter_leaves_nothing_and_a_mapped_buffer_stays_readable():
    """SIGKILL the exporter: no file anywhere, the importer's mapping still holds the bytes,
    a fresh import fails naming the memory as gone."""
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            """
            import json, sys, time, torch
            from hal.backends.cpu import CpuBackend
            backend = CpuBackend()
            shared = backend.empty_shared(64)
            shared.view(torch.float32).copy_(torch.arange(16, dtype=torch.float32))
            print(json.dumps(backend.export_ipc(shared)), flush=True)
            time.sleep(120)
            """
        )],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        handle = json.loads(child.stdout.readline())
        mapped = CpuBackend().import_ipc(handle)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    assert not glob.glob(f"/dev/shm/{SHM_PREFIX}{child.pid}-*"), "a killed exporter left a file in /dev/shm"
    assert mapped.view(torch.float32).tolist() == [float(i) for i in range(16)]
    with pytest.raises(FileNotFoundError, match=f"shared memory {handle['name']} is gone"):
        CpuBackend().import_ipc(handle)


def test_export_refuses_a_dtype_outside_the_allow_list():
    backend = CpuBackend()
    shared = backend.empty_shared(16)
    try:
        with pytest.raises(ValueError, match=r"dtype torch.complex32 cannot travel in an IPC handle"):
            backend.export_ipc(shared.view(torch.complex32))
    finally:
        backend.release_shared(shared)


def test_export_checks_what_a_backend_returns_is_json_safe():
    class Leaky(CpuBackend):
        def _export_ipc(self, tensor):
            return {"kind": "shm", "rebuild": (print, ())}

    with pytest.raises(TypeError, match=r"handle\['rebuild'\]: a tuple is not JSON-safe"):
        Leaky().export_ipc(torch.zeros(1))


# (how to spoil the good handle, the field the error must name)
MALFORMED = [
    pytest.param(lambda h: ("rebuild", ()), "must be a dict \\(JSON object\\), got tuple", id="not-a-dict"),
    pytest.param(lambda h: {**h, 5: 1}, "non-str key 5", id="int-key"),
    pytest.param(lambda h: {k: v for k, v in h.items() if k != "name"}, "'name' is missing", id="missing-name"),
    pytest.param(lambda h: {k: v for k, v in h.items() if k != "fd"}, "'fd' is missing", id="missing-fd"),
    pytest.param(lambda h: {**h, "rebuild": "os.system"}, "'rebuild' is not part of this handle format", id="extra-field"),
    pytest.param(lambda h: {**h, "file": h["name"]}, "'file' is not part of this handle format", id="old-file-field"),
    pytest.param(lambda h: {**h, "kind": "cuda"}, "'kind' is 'cuda', expected 'shm'", id="kind"),
    pytest.param(lambda h: {**h, "kind": None}, "'kind' must be a str", id="kind-none"),
    # the name: this backend's pattern, nothing else
    pytest.param(lambda h: {**h, "name": "../../etc/passwd"}, "'name'", id="dotdot"),
    pytest.param(lambda h: {**h, "name": f"/dev/shm/{h['name']}"}, "'name'", id="absolute"),
    pytest.param(lambda h: {**h, "name": "torch_1234_5_6"}, "'name'", id="no-prefix"),
    pytest.param(lambda h: {**h, "name": ""}, "'name'", id="empty"),
    pytest.param(lambda h: {**h, "name": h["name"].upper()}, "'name'", id="upper-case"),
    pytest.param(lambda h: {**h, "name": h["name"] + "\x00"}, "'name'", id="nul"),
    pytest.param(lambda h: {**h, "name": 12}, "'name' must be a str", id="name-int"),
    pytest.param(lambda h: {**h, "name": "x" * 10_000}, "'name' is 10000 characters long", id="name-huge"),
    pytest.param(lambda h: {**h, "name": f"{SHM_PREFIX}1-{'a' * 12}"}, "'name'.*is not the shared memory", id="other-name"),
    # where it is: a process and one of its descriptors
    pytest.param(lambda h: {**h, "pid": 0}, "'pid' must be >= 1", id="pid-zero"),
    pytest.param(lambda h: {**h, "pid": -1}, "'pid' must be >= 1", id="pid-negative"),
    pytest.param(lambda h: {**h, "pid": "self"}, "'pid' must be an int", id="pid-self"),
    pytest.param(lambda h: {**h, "pid": 2**40}, "'pid' must be <=", id="pid-huge"),
    pytest.param(lambda h: {**h, "fd": -1}, "'fd' must be >= 0", id="fd-negative"),
    pytest.param(lambda h: {**h, "fd": "3"}, "'fd' must be an int", id="fd-str"),
    pytest.param(lambda h: {**h, "fd": 0}, "'(fd|name)'", id="fd-stdin"),
    # sizes and offsets
    pytest.param(lambda h: {**h, "storage_nbytes": -64}, "'storage_nbytes' must be >= 1", id="nbytes-negative"),
    pytest.param(lambda h: {**h, "storage_nbytes": 0}, "'storage_nbytes' must be >= 1", id="nbytes-zero"),
    pytest.param(lambda h: {**h, "storage_nbytes": "64"}, "'storage_nbytes' must be an int", id="nbytes-str"),
    pytest.param(lambda h: {**h, "storage_nbytes": 64.0}, "'storage_nbytes' must be an int", id="nbytes-float"),
    pytest.param(lambda h: {**h, "storage_nbytes": True}, "'storage_nbytes' must be an int", id="nbytes-bool"),
    pytest.param(lambda h: {**h, "storage_nbytes": 2**70}, "'storage_nbytes' must be <=", id="nbytes-huge"),
    pytest.param(lambda h: {**h, "storage_nbytes": 4096}, "'storage_nbytes' 4096 overruns the file, which holds 64", id="nbytes-overrun"),
    pytest.param(lambda h: {**h, "byte_offset": -16}, "'byte_offset' must be >= 0", id="offset-negative"),
    pytest.param(lambda h: {**h, "byte_offset": None}, "'byte_offset' must be an int", id="offset-none"),
    pytest.param(lambda h: {**h, "byte_offset": 18}, "'byte_offset' puts the view at byte 18, not a multiple", id="offset-misaligned"),
    pytest.param(lambda h: {**h, "byte_offset": 48}, "'shape' \\[8\\] with stride \\[1\\] at byte 48 reaches byte 80", id="offset-overrun"),
    pytest.param(lambda h: {**h, "byte_offset": 128, "shape": [0]}, "'byte_offset' puts the view at byte 128, past", id="offset-past-end"),
    # shape and stride
    pytest.param(lambda h: {**h, "shape": [-8]}, "'shape\\[0\\]' must be >= 0", id="shape-negative"),
    pytest.param(lambda h: {**h, "shape": "8"}, "'shape' must be a list of ints", id="shape-str"),
    pytest.param(lambda h: {**h, "shape": [8.0]}, "'shape\\[0\\]' must be an int", id="shape-float"),
    pytest.param(lambda h: {**h, "shape": [True]}, "'shape\\[0\\]' must be an int", id="shape-bool"),
    pytest.param(lambda h: {**h, "shape": [100]}, "'shape' \\[100\\] with stride \\[1\\] at byte 16 reaches byte 416", id="shape-overrun"),
    pytest.param(lambda h: {**h, "shape": [1] * 65, "stride": [1] * 65}, "'shape' has 65 entries", id="shape-too-many-dims"),
    pytest.param(lambda h: {**h, "stride": [-1]}, "'stride\\[0\\]' must be >= 0", id="stride-negative"),
    pytest.param(lambda h: {**h, "stride": [1, 1]}, "'stride' has 2 entries for a shape of 1", id="stride-length"),
    pytest.param(lambda h: {**h, "stride": [100]}, "'shape' \\[8\\] with stride \\[100\\]", id="stride-overrun"),
    # dtype: torch attribute names from an allow-list only
    pytest.param(lambda h: {**h, "dtype": "float128"}, "'dtype' names no allowed dtype: 'float128'", id="dtype-unknown"),
    pytest.param(lambda h: {**h, "dtype": "torch.float32"}, "'dtype' names no allowed dtype", id="dtype-prefixed"),
    pytest.param(lambda h: {**h, "dtype": "Tensor"}, "'dtype' names no allowed dtype", id="dtype-class"),
    pytest.param(lambda h: {**h, "dtype": "__class__"}, "'dtype' names no allowed dtype", id="dtype-dunder"),
    pytest.param(lambda h: {**h, "dtype": "complex32"}, "'dtype' names no allowed dtype", id="dtype-not-allowed"),
    pytest.param(lambda h: {**h, "dtype": 6}, "'dtype' must be a str", id="dtype-int"),
]


@pytest.mark.parametrize(("spoil", "message"), MALFORMED)
def test_malformed_handles_are_refused_naming_the_field(shared_view, spoil, message):
    backend, handle, _ = shared_view
    bad = spoil(copy.deepcopy(handle))
    with pytest.raises(ValueError, match=rf"import_ipc on backend 'cpu': handle.*{message}"):
        backend.import_ipc(bad)


def test_a_descriptor_of_a_plain_file_is_refused(shared_view, tmp_path):
    # a hostile handle pointing at a file some process has open must not map that file
    backend, handle, _ = shared_view
    secret = tmp_path / "secret"
    secret.write_bytes(b"\x07" * 64)
    fd = os.open(secret, os.O_RDWR)
    try:
        with pytest.raises(ValueError, match="handle field 'name' .* is not the shared memory"):
            backend.import_ipc({**handle, "fd": fd})
    finally:
        os.close(fd)
    assert secret.read_bytes() == b"\x07" * 64


def test_another_programs_memory_file_is_refused(shared_view):
    backend, handle, _ = shared_view
    fd = os.memfd_create("not-ours")
    try:
        os.ftruncate(fd, 64)
        with pytest.raises(ValueError, match="handle field 'name' .* is not the shared memory"):
            backend.import_ipc({**handle, "fd": fd})
    finally:
        os.close(fd)


def test_a_directory_descriptor_is_refused(shared_view, tmp_path):
    backend, handle, _ = shared_view
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="handle field 'fd'"):
            backend.import_ipc({**handle, "fd": fd})
    finally:
        os.close(fd)


def test_a_good_handle_still_imports_after_the_refusals(shared_view):
    # The refusals above must not come from a handle that was never importable.
    backend, handle, view = shared_view
    assert backend.import_ipc(copy.deepcopy(handle)).tolist() == view.tolist()
    assert backend.import_ipc({**handle, "shape": [2, 2], "stride": [4, 1]}).tolist() == [[0.0, 1.0], [4.0, 5.0]]
