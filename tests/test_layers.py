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
LIBRARY = ["hal", "hal.backends", "hal.kernels", "hal.sync", "hal.integrations", "hal.offload", "hal.procs", "hal.engine_processes", "hal.env"]


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
        "import hal.integrations, hal.sync\n"
        "for pkg in (hal.integrations, hal.sync):\n"
        "    for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + '.'):\n"
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
