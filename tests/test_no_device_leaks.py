"""Device branches live in hal/backends/ only, and `import hal` has no side effects.

The scan reads code, not prose: comments and docstrings may name `torch.cuda` to explain
why the code does not; attribute access, imports, and string literals (the way a module
is imported by name, or a collective backend chosen) may not.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from tests.conftest import run_python

HAL_DIR = Path(__file__).resolve().parent.parent / "hal"
ALLOWED_DIR = HAL_DIR / "backends"

DEVICE_MODULES = {"cuda", "npu"}  # torch.<these>
COLLECTIVE_NAMES = {"nccl", "hccl"}
FORBIDDEN_IN_STRINGS = ("torch_npu", "torch.cuda", "torch.npu")


def _docstring_ids(tree: ast.AST) -> set[int]:
    # Any bare string statement is prose: module/class/function docstrings and attribute docs.
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def device_leaks(source: str, filename: str = "<source>") -> list[str]:
    """Every device-specific reference in `source`, as 'file:line: what'."""
    tree = ast.parse(source, filename)
    prose = _docstring_ids(tree)
    found = []

    def hit(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "torch" and node.attr in DEVICE_MODULES:
                hit(node, f"torch.{node.attr}")
        elif isinstance(node, ast.Name) and node.id == "torch_npu":
            hit(node, "torch_npu")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch_npu" or alias.name in {"torch.cuda", "torch.npu"}:
                    hit(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] == "torch_npu" or module in {"torch.cuda", "torch.npu"}:
                hit(node, f"from {module} import ...")
            elif module == "torch" and any(alias.name in DEVICE_MODULES for alias in node.names):
                hit(node, "from torch import cuda/npu")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            text = node.value
            if text.strip().lower() in COLLECTIVE_NAMES:
                hit(node, f"string {text!r}")
            # A module named by string (import_module, find_spec); not a longer identifier
            # that merely contains the name, such as verl's "is_torch_npu_available".
            for needle in FORBIDDEN_IN_STRINGS:
                if text == needle or text.startswith(needle + "."):
                    hit(node, f"string naming {needle!r}")
    return found


def hal_sources() -> list[Path]:
    return sorted(p for p in HAL_DIR.rglob("*.py") if ALLOWED_DIR not in p.parents)


def test_scan_covers_the_package():
    names = {p.relative_to(HAL_DIR).as_posix() for p in hal_sources()}
    assert {"__init__.py", "backend.py", "device.py", "cli.py"} <= names
    assert not any(name.startswith("backends/") for name in names)


def test_no_device_specific_code_outside_backends():
    leaks = []
    for path in hal_sources():
        leaks += device_leaks(path.read_text(), str(path.relative_to(HAL_DIR.parent)))
    assert not leaks, "device-specific code outside hal/backends/ (ask hal.current() instead):\n" + "\n".join(leaks)


@pytest.mark.parametrize(
    ("snippet", "what"),
    [
        ("import torch\ntorch.cuda.synchronize()\n", "torch.cuda"),
        ("import torch\nx = torch.npu\n", "torch.npu"),
        ("import torch_npu\n", "import torch_npu"),
        ("from torch_npu.contrib import transfer_to_npu\n", "from torch_npu.contrib import"),
        ("from torch import cuda\n", "from torch import cuda/npu"),
        ("import torch.cuda\n", "import torch.cuda"),
        ("import importlib\nimportlib.import_module('torch_npu')\n", "string naming 'torch_npu'"),
        ("importlib.util.find_spec('torch_npu.contrib')\n", "string naming 'torch_npu'"),
        ('dist.init_process_group("nccl")\n', "string 'nccl'"),
        ("dist.init_process_group('hccl')\n", "string 'hccl'"),
        ("BACKEND = 'HCCL'\n", "string 'HCCL'"),
        ("def f(torch_npu):\n    return torch_npu\n", "torch_npu"),
    ],
)
def test_scan_catches(snippet, what):
    leaks = device_leaks(snippet)
    assert leaks, f"the scan missed {what!r} in {snippet!r}"
    assert any(what in leak for leak in leaks), leaks


@pytest.mark.parametrize(
    "snippet",
    [
        '"""Never calls torch.cuda or "nccl" directly."""\n',
        "# torch.cuda would be wrong here\nx = 1\n",
        "def f():\n    '''uses torch_npu through the backend'''\n",
        "backend = hal.current().dist_backend\n",
        "name = 'nccl_bucket_size'\n",  # a longer name that merely contains it
        "__all__ = ['is_torch_npu_available']\n",
    ],
)
def test_scan_allows_prose_and_backend_questions(snippet):
    assert device_leaks(snippet) == []


def test_import_hal_has_no_side_effects():
    result = run_python(
        """
        import sys
        before = set(sys.modules)
        import hal
        new = set(sys.modules) - before
        optional = sorted(m for m in new if m.split(".")[0] in {"torch_npu", "vllm", "transformers", "peft"})
        backends = sorted(m for m in new if m.startswith("hal.backends."))
        import torch
        import json
        print(json.dumps([optional, backends, torch.cuda.is_initialized(), hal.device._resolved is None]))
        """,
        env={"VERL_DEVICE": "npu"},  # resolving at import would try torch_npu
    )
    assert result.returncode == 0, result.stderr
    optional, backends, cuda_initialized, unresolved = json.loads(result.stdout)
    assert optional == [], f"`import hal` imported optional libraries: {optional}"
    assert backends == [], f"`import hal` imported backend modules: {backends}"
    assert cuda_initialized is False
    assert unresolved is True
