"""Every import path the documentation names, every entry point pyproject.toml declares (and
the ones installed here), the vLLM worker extensions by name resolve; every file of
hal/ the documentation names by its path (hal/integrations/vllm/engine.py) exists."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
_PATH = re.compile(r"hal\.integrations(?:\.[A-Za-z_]\w*)+(?::\w+)?")

# Each host's package: its paths are checked by import where the host is installed, else by
# reading the source (the main lane has no verl; the verl lane no vLLM).
HOSTS = {"vllm": "vllm", "verl": "verl", "ray": "ray"}

# Names users hand to vLLM as strings (docs/vllm.md), and what each must be.
WORKER_EXTENSIONS = ["hal.integrations.vllm.HalWorkerExtension", "hal.integrations.vllm.lora.HalLoraWorkerExtension"]


def documented() -> list[str]:
    found = set()
    for doc in DOCS:
        found.update(m.rstrip(".") for m in _PATH.findall(doc.read_text()))
    return sorted(found)


def _host(path: str) -> str | None:
    head = path.split(":")[0].split(".")[2]
    return next((host for prefix, host in HOSTS.items() if head == prefix or head.startswith(prefix + "_")), None)


def _installed(host: str | None) -> bool:
    return host is None or importlib.util.find_spec(host) is not None


def _split(path: str) -> tuple[str, list[str]]:
    """(the longest importable-looking module of `path`, the attributes after it)."""
    dotted = path.replace(":", ".")
    parts = dotted.split(".")
    for end in range(len(parts), 1, -1):
        module = ".".join(parts[:end])
        try:
            found = importlib.util.find_spec(module)
        except ModuleNotFoundError:  # a name inside a module, not a module of its own
            continue
        if found is not None:
            return module, parts[end:]
    raise AssertionError(f"{path}: no module of it exists")


def resolve(path: str) -> object:
    module, attrs = _split(path)
    value: object = importlib.import_module(module)
    for attr in attrs:
        value = getattr(value, attr)
    return value


def defined_in_source(path: str) -> bool:
    """Without the host installed: the module exists and defines (or imports) the name."""
    module, attrs = _split(path)
    if not attrs:
        return True
    spec = importlib.util.find_spec(module)
    tree = ast.parse(Path(spec.origin).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # a lazily answered name (hal.integrations.vllm's table)
    return attrs[0] in names


_FILE = re.compile(r"(?<![\w/.])hal/[\w/]+\.py\b")


def documented_files() -> list[tuple[str, str]]:
    """(document, path) for every file of hal/ a document names by its path (hal/.../x.py)."""
    return sorted({(doc.name, m) for doc in DOCS for m in _FILE.findall(doc.read_text())})


def test_the_docs_name_files_of_hal():
    assert len(documented_files()) > 10


@pytest.mark.parametrize("doc, path", documented_files())
def test_every_file_the_docs_name_exists(doc, path):
    assert (ROOT / path).is_file(), f"{doc} names {path}, which does not exist"


def test_the_docs_name_integration_paths():
    assert len(documented()) > 10


@pytest.mark.parametrize("path", documented())
def test_every_documented_path_resolves(path):
    if _installed(_host(path)):
        assert resolve(path) is not None
    else:
        assert defined_in_source(path), f"{path}: not defined in its module"


def _declared_entry_points() -> list[tuple[str, str, str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    points = [("console_scripts", name, value) for name, value in project.get("scripts", {}).items()]
    for group, entries in project.get("entry-points", {}).items():
        points += [(group, name, value) for name, value in entries.items()]
    return points


@pytest.mark.parametrize("group, name, value", _declared_entry_points())
def test_every_declared_entry_point_resolves(group, name, value):
    host = _host(value) if value.startswith("hal.integrations.") else None
    if not _installed(host):
        assert defined_in_source(value), f"{group} {name} = {value}: not defined"
        return
    loaded = importlib.metadata.EntryPoint(name=name, value=value, group=group).load()
    assert callable(loaded) or hasattr(loaded, "__name__")


def test_the_installed_entry_points_resolve():
    """What vLLM and verl find in this environment's metadata (an editable install may have
    been made from an older checkout: its values must still resolve)."""
    installed = [
        ep for group in ("vllm.general_plugins", "verl.plugins") for ep in importlib.metadata.entry_points(group=group)
        if ep.value.startswith("hal.")
    ]
    if not installed:
        pytest.skip("verl-hal's entry points are not installed in this environment")
    for ep in installed:
        if _installed(_host(ep.value)):
            assert ep.load() is not None, ep
        else:
            assert defined_in_source(ep.value), ep


@pytest.mark.parametrize("qualname", WORKER_EXTENSIONS)
def test_the_worker_extensions_resolve_by_name(qualname):
    if not _installed("vllm"):
        pytest.skip("vLLM is not installed here")
    module, _, name = qualname.rpartition(".")
    assert isinstance(getattr(importlib.import_module(module), name), type)
