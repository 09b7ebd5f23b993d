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


# ---- no object writes another's private state (issue 40) ------------------------------------------
# A private attribute is written by its own object's methods only: `self._x = ...` (or `cls._x`),
# never `other._x = ...`, `setattr(other, "_x", ...)` or `del other._x`, in any module. A class
# that needs its owner (or its phase) to change calls a public step of it (`Receiver.completed`,
# `LayerwiseReload.start`). On one object, the classes of one module write a private attribute:
# a subclass or mixin of another module that writes its base's `self._x` writes another's state
# too (hal's engine for vLLM 0.23 wrote the engine's `_reloading` and `_seen`). A host's private
# that hal must write is named here with the reason; the fences (`FENCES`) may write their
# host's, which is what they are for.
HOST_PRIVATE_WRITES = {
    ("hal.sync.wire.group", "_devices"): "torch's ProcessGroupGloo._Options: the only way to put gloo's listener on one address",
    ("hal.sync.wire.group", "_timeout"): "torch's ProcessGroupGloo._Options, with the device above",
    ("hal.backends.npu", "_timeout"): "torch_npu's ProcessGroupHCCL.Options, as torch_npu's own registry builds it",
}
FENCES = ("hal.integrations.vllm.internals", "hal.integrations.verl.internals")


def _is_own(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _written(tree: ast.AST) -> list[tuple[int, ast.AST, str]]:
    """(line, object, private name) of every write of an attribute: assigned (plain, annotated,
    augmented, in a tuple), deleted, or by `setattr` / `delattr` with a constant name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            if _private(node.args[1].value):
                found.append((node.lineno, node.args[0], node.args[1].value))
            continue
        else:
            continue
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and _private(sub.attr):
                    found.append((sub.lineno, sub.value, sub.attr))
    return found


def test_no_module_writes_another_objects_private_state():
    offences = []
    for name, path in _modules().items():
        if name.startswith(FENCES):
            continue
        for line, obj, attr in _written(ast.parse(path.read_text())):
            if not _is_own(obj) and (name, attr) not in HOST_PRIVATE_WRITES:
                offences.append(f"{name}:{line} writes {ast.unparse(obj)}.{attr}")
    assert not offences, "\n".join(offences)


def _classes() -> dict[tuple[str, str], ast.ClassDef]:
    return {
        (name, node.name): node
        for name, path in _modules().items()
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ClassDef)
    }


def _imported_names(modules: dict[str, Path]) -> dict[str, dict[str, tuple[str, str]]]:
    """Per module, each name it imports at top level from a hal module: (that module, the name there)."""
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for name, path in modules.items():
        names = out[name] = {}
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hal"):
                for alias in node.names:
                    names[alias.asname or alias.name] = (node.module, alias.name)
    return out


def test_the_classes_of_one_object_never_write_each_others_private_attributes():
    modules = _modules()
    classes = _classes()
    imported = _imported_names(modules)

    def resolve(module: str, name: str, depth: int = 0) -> tuple[str, str] | None:
        if (module, name) in classes:
            return module, name
        found = imported.get(module, {}).get(name)
        return resolve(*found, depth + 1) if found is not None and depth < 5 else None

    def writes(key: tuple[str, str]) -> set[str]:
        """Private attributes the class's own methods write on `self`."""
        return {attr for line, obj, attr in _written(classes[key]) if isinstance(obj, ast.Name) and obj.id == "self"}

    def family(key: tuple[str, str], seen: set[tuple[str, str]]) -> set[tuple[str, str]]:
        seen.add(key)
        for base in classes[key].bases:
            found = resolve(key[0], base.id) if isinstance(base, ast.Name) else None
            if found is not None and found not in seen:
                family(found, seen)
        return seen

    offences = set()
    for key in classes:
        members = family(key, set())
        writers: dict[str, set[str]] = {}
        for member in members:
            for attr in writes(member):
                writers.setdefault(attr, set()).add(member[0])
        for attr, by in writers.items():
            if len(by) > 1:
                offences.add(f"{key[0]}.{key[1]}: self.{attr} is written by the classes of {sorted(by)}")
    assert not offences, "\n".join(sorted(offences))
