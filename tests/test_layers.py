"""The library apart from the tools (issue 19, item 8): what a trainer or an engine imports
never imports the benchmarks, the demo or the tiny-model builder, and no module of hal
imports itself back through another, at module level or inside a function."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import hal

ROOT = Path(hal.__file__).parent
LIBRARY = ["hal", "hal.backends", "hal.kernels", "hal.sync", "hal.canary", "hal.integrations", "hal.offload", "hal.procs", "hal.engine_processes", "hal.env"]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """hal modules `name` imports anywhere in its text (a function's import counts too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
    return {m for m in found if m in modules and m != name}


def test_library_modules_never_import_the_tools():
    modules = _modules()
    library = [m for m in modules if not m.startswith(("hal.tools", "hal.cli", "hal.__main__"))]
    offenders = {m: sorted(d for d in _imports(m, modules[m], modules) if d.startswith("hal.tools")) for m in library}
    assert not {m: d for m, d in offenders.items() if d}


def test_importing_the_library_loads_no_tool():
    code = (
        "import importlib, pkgutil, sys\n"
        f"for name in {LIBRARY!r}:\n"
        "    importlib.import_module(name)\n"
        "import hal.canary, hal.integrations, hal.sync\n"
        "for pkg in (hal.canary, hal.integrations, hal.sync):\n"
        "    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        try:\n"
        "            importlib.import_module(info.name)\n"
        "        except ImportError:\n"
        "            pass  # an optional host (verl) not installed here\n"
        "print(sorted(m for m in sys.modules if m.startswith('hal.tools')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    # hal's own __init__ resolves the backend lazily: a module importing `hal` for
    # `hal.current()` is no cycle through the package's submodules
    graph = {m: {d for d in deps if d != "hal"} for m, deps in graph.items()}
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep):] + [dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


# ---- one module's insides are its own (issue 26) ----------------------------------------------
# A private name (one leading underscore) is read only where it is defined: no module imports
# another's, imports another package's private module, or reads a private attribute that
# another module of hal defines (`other._group`). Reads of other libraries' private names are
# not hal's to police here; the fenced modules (`vllm_internals`, `verl_internals`) hold those.


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_privates(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, assignments, `self._x = ...`."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name) and _private(sub.id):
                        names.add(sub.id)
                    elif isinstance(sub, ast.Attribute) and _private(sub.attr):
                        names.add(sub.attr)
        elif isinstance(node, ast.arg) and _private(node.arg):
            names.add(node.arg)
    return names


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def test_no_module_reads_another_modules_private_names():
    modules = _modules()
    trees = {m: ast.parse(p.read_text()) for m, p in modules.items()}
    defined = {m: _defined_privates(t) for m, t in trees.items()}
    offences = []
    for name, tree in trees.items():
        package = _package_of(name, modules[name])
        others = set().union(*(d for m, d in defined.items() if m != name)) - defined[name]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hal"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if _private(alias.name) and full not in modules:
                        offences.append(f"{name}:{node.lineno} imports {alias.name} from {node.module}")
                    target = full if full in modules else node.module
                    private_module = next((part for part in target.split(".") if _private(part)), None)
                    if private_module is not None:
                        owner = target[: target.index(private_module) - 1]
                        if not (package == owner or package.startswith(owner + ".")):
                            offences.append(f"{name}:{node.lineno} imports {target}, private to {owner}")
            elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in others:
                base = node.value
                if not (isinstance(base, ast.Name) and base.id in ("self", "cls")):
                    offences.append(f"{name}:{node.lineno} reads .{node.attr}, another module's private name")
    assert not offences, "\n".join(offences)


# ---- a receiver or a source is used through its declared protocol, never probed ---------------
_PROBED = ("receiver", "source")


def _last_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def test_no_getattr_probe_of_a_receiver_or_a_source():
    offences = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and node.args:
                probed = _last_name(node.args[0]).lower()
                if any(word in probed for word in _PROBED):
                    offences.append(f"{name}:{node.lineno} {node.func.id}({_last_name(node.args[0])}, ...)")
    assert not offences, "\n".join(offences)


# ---- packages by role (issue 40) ------------------------------------------------------------------
# hal.sync's units in the order they may import each other: a unit imports only units of the
# layers before it (the base vocabulary's modules also import each other); a package's own
# modules import each other freely. Imports under `if TYPE_CHECKING:` never run and do not
# count: the wire and the transports name the plan's BucketPlan in signatures only.
SYNC_LAYERS = [
    {"hal.sync.spec", "hal.sync.errors", "hal.sync.metrics", "hal.sync.config", "hal.sync.sink", "hal.sync.adapters", "hal.sync.source"},
    {"hal.sync.wire"},
    {"hal.sync.transport"},
    {"hal.sync.plan"},
    {"hal.sync.delta"},
    {"hal.sync.send", "hal.sync.receive"},
    {"hal.sync.lora"},
    {"hal.sync.endpoints"},
    {"hal.sync"},  # the package's __init__: what users import
]


def _sync_unit(module: str) -> str:
    return ".".join(module.split(".")[:3])  # hal.sync, hal.sync.<base module>, hal.sync.<package>


def _runtime_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """`_imports`, without the imports under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = [ast.Pass()]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
    return {m for m in found if m in modules and m != name}


def test_hal_sync_packages_import_only_the_layers_below():
    modules = _modules()
    rank = {unit: i for i, layer in enumerate(SYNC_LAYERS) for unit in layer}
    units = {_sync_unit(m) for m in modules if m.startswith("hal.sync")}
    assert units <= set(rank), f"place {sorted(units - set(rank))} in SYNC_LAYERS"
    offences = []
    for name, path in modules.items():
        if not name.startswith("hal.sync"):
            continue
        own = _sync_unit(name)
        for dep in _runtime_imports(name, path, modules):
            other = _sync_unit(dep) if dep.startswith("hal.sync") else None
            if other is None or other == own or rank[other] == rank[own] == 0:
                continue
            if rank[other] >= rank[own]:
                offences.append(f"{name} imports {dep} ({other} is not below {own})")
    assert not offences, "\n".join(offences)
