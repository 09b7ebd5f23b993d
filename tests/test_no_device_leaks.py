"""Device branches live in hal/backends/ only, and `import hal` has no side effects.

The scan reads code, not prose. What counts as code:

- attribute access and calls: `torch.cuda`, `torch.npu`, `torch.version.cuda` /
  `torch.version.hip`, the tensor methods `.cuda()` / `.npu()` and the flags `.is_cuda`
  / `.is_npu`; `torch_npu` as a name or imported; `import torch.cuda`,
  `from torch import cuda`;
- `get_device_module(...)` called with a literal device name;
- a string literal whose *whole* value (stripped, any case) is a device or collective
  spec: device and library names, indices, joined by `:` and `,`, with at least one of
  cuda, npu, nccl, hccl in it: `"cuda"`, `"NPU"`, `"cuda:0"`, `"npu:1"`, `"hccl"`,
  `"cuda:nccl,cpu:gloo"`. That covers `torch.device("cuda")`, `.to("npu")`,
  `device="cuda"`, `init_process_group("nccl")` and `getattr(torch, "npu")`;
- in an f-string, a literal piece that is such a spec once the `:`/`,` next to the
  placeholders is trimmed: `f"cuda:{index}"`, `f"{dev}:nccl,cpu:gloo"`;
- a string naming a device module for import: `"torch_npu"`, `"torch.cuda"`, `"torch_npu.x"`.

What counts as prose, and is allowed: docstrings and other bare string statements,
comments, and any string in which the name is only part of a longer text, such as an
error or log message (`"tensor is on cuda:0, expected cpu"`, `f"{x} on npu failed"`) or
a longer identifier (`"nccl_bucket_size"`, `"is_torch_npu_available"`).

One narrow allowance, for hal/compat/verl.py only (verl's API is about one device by
nature, e.g. `is_npu_available`): a device-name literal compared with `==` / `!=`
against an attribute named `device_type` (`backend.device_type == "npu"`). Nothing else
in that file is exempt, not even `device_type in ("cuda", "npu")`.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from tests.conftest import run_python

HAL_DIR = Path(__file__).resolve().parent.parent / "hal"
ALLOWED_DIR = HAL_DIR / "backends"
# The backend contract beside the backends (interface.py and its parts): device-neutral, scanned like the rest.
CONTRACT = {ALLOWED_DIR / name for name in ("interface.py", "hooks.py", "runtime.py", "types.py")}
# Files that may compare `<x>.device_type` with a device name (see the module docstring).
DEVICE_TYPE_COMPARISONS_ALLOWED = {HAL_DIR / "compat" / "verl.py"}

DEVICE_MODULES = {"cuda", "npu"}  # torch.<these>, <tensor>.<these>()
DEVICE_FLAGS = {"is_cuda", "is_npu"}  # <tensor>.<these>
TORCH_VERSION_FIELDS = {"cuda", "hip"}  # torch.version.<these>
SPECIFIC_NAMES = {"cuda", "npu", "nccl", "hccl"}
GENERIC_NAMES = {"cpu", "gloo"}  # may appear in a spec beside a specific name
FORBIDDEN_IN_STRINGS = ("torch_npu", "torch.cuda", "torch.npu")

_TOKEN = rf"(?:{'|'.join(sorted(SPECIFIC_NAMES | GENERIC_NAMES))}|\d+)"
_SPEC = re.compile(rf"{_TOKEN}(?:[:,]{_TOKEN})*", re.IGNORECASE)


def _is_device_spec(text: str) -> bool:
    """`text` is only device/library names and indices joined by ':' or ',', one of them specific."""
    text = text.strip()
    if not _SPEC.fullmatch(text):
        return False
    return any(token.lower() in SPECIFIC_NAMES for token in re.split(r"[:,]", text))


def _prose_ids(tree: ast.AST) -> set[int]:
    # Any bare string statement is prose: module/class/function docstrings and attribute docs.
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def _allowed_comparison_ids(tree: ast.AST) -> set[int]:
    """Literals compared with ==/!= against an attribute named device_type."""
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare) or not all(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
            continue
        operands = [node.left, *node.comparators]
        if not any(isinstance(o, ast.Attribute) and o.attr == "device_type" for o in operands):
            continue
        allowed |= {id(o) for o in operands if isinstance(o, ast.Constant) and isinstance(o.value, str)}
    return allowed


def device_leaks(source: str, filename: str = "<source>", *, allow_device_type_comparisons: bool = False) -> list[str]:
    """Every device-specific reference in `source`, as 'file:line: what'."""
    tree = ast.parse(source, filename)
    skip = _prose_ids(tree)
    if allow_device_type_comparisons:
        skip |= _allowed_comparison_ids(tree)
    f_string_pieces = {
        id(value)
        for node in ast.walk(tree)
        if isinstance(node, ast.JoinedStr)
        for value in node.values
        if isinstance(value, ast.Constant)
    }
    found = []

    def hit(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            if isinstance(base, ast.Name) and base.id == "torch" and node.attr in DEVICE_MODULES:
                hit(node, f"torch.{node.attr}")
            elif (
                isinstance(base, ast.Attribute)
                and base.attr == "version"
                and isinstance(base.value, ast.Name)
                and base.value.id == "torch"
                and node.attr in TORCH_VERSION_FIELDS
            ):
                hit(node, f"torch.version.{node.attr}")
            elif node.attr in DEVICE_FLAGS:
                hit(node, f".{node.attr}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in DEVICE_MODULES and not (
                isinstance(func.value, ast.Name) and func.value.id == "torch"
            ):
                hit(node, f".{func.attr}()")
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "get_device_module" and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str) and _is_device_spec(first.value):
                    hit(node, f"get_device_module({first.value!r})")
                    skip.add(id(first))
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

    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
            continue
        text = node.value
        if id(node) in f_string_pieces:
            if _is_device_spec(text.strip(":,")) and not text[:1].isspace() and not text[-1:].isspace():
                hit(node, f"f-string piece {text!r}")
            continue
        if _is_device_spec(text):
            hit(node, f"string {text!r}")
        # A module named by string (import_module, find_spec); not a longer identifier
        # that merely contains the name, such as verl's "is_torch_npu_available".
        for needle in FORBIDDEN_IN_STRINGS:
            if text == needle or text.startswith(needle + "."):
                hit(node, f"string naming {needle!r}")
    return found


def hal_sources() -> list[Path]:
    return sorted(p for p in HAL_DIR.rglob("*.py") if ALLOWED_DIR not in p.parents or p in CONTRACT)


def scan_hal() -> list[str]:
    leaks = []
    for path in hal_sources():
        leaks += device_leaks(
            path.read_text(),
            str(path.relative_to(HAL_DIR.parent)),
            allow_device_type_comparisons=path in DEVICE_TYPE_COMPARISONS_ALLOWED,
        )
    return leaks


def test_scan_covers_the_package():
    names = {p.relative_to(HAL_DIR).as_posix() for p in hal_sources()}
    assert {"__init__.py", "backends/interface.py", "device.py", "cli.py", "compat/verl.py"} <= names
    assert {name for name in names if name.startswith("backends/")} == {p.relative_to(HAL_DIR).as_posix() for p in CONTRACT}
    assert all(path.exists() for path in DEVICE_TYPE_COMPARISONS_ALLOWED)


def test_no_device_specific_code_outside_backends():
    leaks = scan_hal()
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
        # device modules by name
        ('torch.get_device_module("cuda").synchronize()\n', "get_device_module('cuda')"),
        ("module = torch.get_device_module('npu')\n", "get_device_module('npu')"),
        ("from torch import get_device_module\nget_device_module('cuda:1')\n", "get_device_module('cuda:1')"),
        ("module = getattr(torch, 'npu')\n", "string 'npu'"),
        # device names used as code
        ('x = torch.device("cuda")\n', "string 'cuda'"),
        ("y = x.to('npu')\n", "string 'npu'"),
        ('t = torch.empty(4, device="cuda")\n', "string 'cuda'"),
        ('DEVICE = "cuda:0"\n', "string 'cuda:0'"),
        ("device = 'npu:1'\n", "string 'npu:1'"),
        ("device = ' NPU '\n", "string ' NPU '"),
        ('dist.init_process_group("cuda:nccl,cpu:gloo")\n', "string 'cuda:nccl,cpu:gloo'"),
        ('device = f"cuda:{rank}"\n', "f-string piece 'cuda:'"),
        ('spec = f"{device}:hccl,cpu:gloo"\n', "f-string piece ':hccl,cpu:gloo'"),
        ('if backend.device_type == "cuda":\n    pass\n', "string 'cuda'"),  # no allowance by default
        ('t = x.cuda()\n', ".cuda()"),
        ("t = x.npu(1)\n", ".npu()"),
        ("on_gpu = x.is_cuda\n", ".is_cuda"),
        ("built = torch.version.cuda\n", "torch.version.cuda"),
        ("rocm = torch.version.hip is not None\n", "torch.version.hip"),
    ],
)
def test_scan_catches(snippet, what):
    leaks = device_leaks(snippet)
    assert leaks, f"the scan missed {what!r} in {snippet!r}"
    assert any(what in leak for leak in leaks), leaks


@pytest.mark.parametrize(
    ("snippet", "what"),
    [
        ('if backend.device_type in ("cuda", "npu"):\n    pass\n', "string 'cuda'"),  # only == / !=
        ('if tensor.device.type == "cuda":\n    pass\n', "string 'cuda'"),  # not device_type
        ('if backend.device_type == "cuda":\n    x = torch.device("cuda")\n', "2: string 'cuda'"),
        ('ok = backend.device_type == "npu"\nm = torch.get_device_module("npu")\n', "get_device_module('npu')"),
        ('name = "cuda"\nok = backend.device_type == name\n', "string 'cuda'"),
    ],
)
def test_device_type_allowance_is_narrow(snippet, what):
    leaks = device_leaks(snippet, allow_device_type_comparisons=True)
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
        "module = torch.get_device_module(hal.current().device_type)\n",
        "x = torch.device('cpu')\n",
        "group = dist.new_group(backend='gloo')\n",
        # prose: the name is part of a longer message
        'raise ValueError(f"tensor is on {t.device}, expected cuda")\n',
        'raise RuntimeError("copy to cuda:0 failed")\n',
        'logger.info("running on npu %s", index)\n',
        'message = f"{count} tensors on npu"\n',
        'message = f"{name} cuda"\n',  # a piece with a space is a word in a sentence
        "KEY = 'CUDA_VISIBLE_DEVICES'\n",
    ],
)
def test_scan_allows_prose_and_backend_questions(snippet):
    assert device_leaks(snippet) == []


@pytest.mark.parametrize(
    "snippet",
    [
        'ok = backend.device_type == "cuda"\n',
        'ok = "npu" != hal.current().device_type\n',
        'ok = hal.current().device_type == "npu" and flag\n',
    ],
)
def test_device_type_allowance(snippet):
    assert device_leaks(snippet, allow_device_type_comparisons=True) == []
    assert device_leaks(snippet) != []


def test_import_hal_has_no_side_effects():
    result = run_python(
        """
        import sys
        before = set(sys.modules)
        import hal
        new = set(sys.modules) - before
        optional = sorted(m for m in new if m.split(".")[0] in {"torch_npu", "vllm", "transformers", "peft"})
        contract = {"hal.backends.interface", "hal.backends.hooks", "hal.backends.runtime", "hal.backends.types"}
        backends = sorted(m for m in new if m.startswith("hal.backends.") and m not in contract)
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
