"""CPU-backend specifics the conformance suite cannot state generically: shared-memory files
and their JSON handles, which `import_ipc` must treat as untrusted input."""

from __future__ import annotations

import copy
import json
import os
import uuid

import pytest
import torch

from hal.backends.cpu import SHM_PREFIX, CpuBackend, _shm_dir
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
        "file": handle["file"],
        "storage_nbytes": 64,
        "byte_offset": 16,
        "shape": [8],
        "stride": [1],
        "dtype": "float32",
    }
    assert handle["file"].startswith(SHM_PREFIX) and "/" not in handle["file"]


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
    path = os.path.join(_shm_dir(), handle["file"])
    assert not os.path.exists(path)
    with pytest.raises(FileNotFoundError, match=f"shared-memory file {path} is gone"):
        backend.import_ipc(handle)


def test_unreleased_files_are_removed_at_exit():
    result = run_python(
        """
        import os
        from hal.backends.cpu import CpuBackend, _shm_dir
        backend = CpuBackend()
        kept = backend.empty_shared(32)
        released = backend.empty_shared(32)
        print(os.path.join(_shm_dir(), backend.export_ipc(kept)["file"]))
        backend.release_shared(released)
        """
    )
    assert result.returncode == 0, result.stderr
    path = result.stdout.strip()
    assert path.startswith(("/dev/shm/verl-hal-", "/tmp/verl-hal-")), path
    assert not os.path.exists(path), f"{path} outlived the process that created it"


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


_OTHER_NAME = f"{SHM_PREFIX}1-{'a' * 12}"

# (how to spoil the good handle, the field the error must name)
MALFORMED = [
    pytest.param(lambda h: ("rebuild", ()), "must be a dict \\(JSON object\\), got tuple", id="not-a-dict"),
    pytest.param(lambda h: {**h, 5: 1}, "non-str key 5", id="int-key"),
    pytest.param(lambda h: {k: v for k, v in h.items() if k != "file"}, "'file' is missing", id="missing-file"),
    pytest.param(lambda h: {**h, "rebuild": "os.system"}, "'rebuild' is not part of this handle format", id="extra-field"),
    pytest.param(lambda h: {**h, "kind": "cuda"}, "'kind' is 'cuda', expected 'shm'", id="kind"),
    pytest.param(lambda h: {**h, "kind": None}, "'kind' must be a str", id="kind-none"),
    # the file: a plain name of this backend's shm directory, nothing else
    pytest.param(lambda h: {**h, "file": "../../etc/passwd"}, "'file'", id="dotdot"),
    pytest.param(lambda h: {**h, "file": f"/dev/shm/{h['file']}"}, "'file'", id="absolute"),
    pytest.param(lambda h: {**h, "file": f"{h['file']}/../{h['file']}"}, "'file'", id="slash-dotdot"),
    pytest.param(lambda h: {**h, "file": f"{SHM_PREFIX}../../etc/passwd"}, "'file'", id="prefix-dotdot"),
    pytest.param(lambda h: {**h, "file": "torch_1234_5_6"}, "'file'", id="no-prefix"),
    pytest.param(lambda h: {**h, "file": ""}, "'file'", id="empty"),
    pytest.param(lambda h: {**h, "file": h["file"].upper()}, "'file'", id="upper-case"),
    pytest.param(lambda h: {**h, "file": h["file"] + "\x00"}, "'file'", id="nul"),
    pytest.param(lambda h: {**h, "file": 12}, "'file' must be a str", id="file-int"),
    pytest.param(lambda h: {**h, "file": ["a"]}, "'file' must be a str", id="file-list"),
    pytest.param(lambda h: {**h, "file": "x" * 10_000}, "'file' is 10000 characters long", id="file-huge"),
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


def test_a_symlink_in_the_shm_directory_is_not_followed(shared_view, tmp_path):
    backend, handle, _ = shared_view
    outside = tmp_path / "secret"
    outside.write_bytes(b"\x07" * 64)
    link = os.path.join(_shm_dir(), f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    os.symlink(outside, link)
    try:
        with pytest.raises(ValueError, match="handle field 'file' .* cannot be opened as a plain file"):
            backend.import_ipc({**handle, "file": os.path.basename(link)})
    finally:
        os.unlink(link)
    assert outside.read_bytes() == b"\x07" * 64


def test_a_directory_in_the_shm_directory_is_refused(shared_view):
    backend, handle, _ = shared_view
    directory = os.path.join(_shm_dir(), f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    os.mkdir(directory)
    try:
        with pytest.raises(ValueError, match="handle field 'file'"):
            backend.import_ipc({**handle, "file": os.path.basename(directory)})
    finally:
        os.rmdir(directory)


def test_a_good_handle_still_imports_after_the_refusals(shared_view):
    # The refusals above must not come from a handle that was never importable.
    backend, handle, view = shared_view
    assert backend.import_ipc(copy.deepcopy(handle)).tolist() == view.tolist()
    assert backend.import_ipc({**handle, "shape": [2, 2], "stride": [4, 1]}).tolist() == [[0.0, 1.0], [4.0, 5.0]]
