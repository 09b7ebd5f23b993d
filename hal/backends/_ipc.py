"""Reading and writing IPC handles as plain JSON data, shared by the backends.

A handle crosses a process boundary (over a process group, from the trainer to an
engine), so the receiver treats it as untrusted input: every field is checked for
type and range before any memory is touched, and the first bad field raises
`ValueError` naming it. Nothing here unpickles, evaluates or imports anything a handle
names. Bytes travel as lower-case hex strings; dtypes as torch attribute names
(`"bfloat16"`), looked up in an allow-list, never with `getattr` on arbitrary text.
"""

from __future__ import annotations

import string
from typing import Any, NoReturn, Sequence

import torch

# Dtypes a handle may name: the torch attribute name -> the dtype. Names missing from this
# torch build are left out. Only plain (non-quantized, non-complex-half) dtypes that a
# weight tensor or a byte bucket can have.
_DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
)
IPC_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}

# Upper bounds that keep a hostile handle from asking for absurd work before it fails.
MAX_DIMS = 64  # torch tensors have at most 64 dimensions
INT64_MAX = 2**63 - 1  # sizes, offsets and strides are int64 in torch
MAX_HEX_BYTES = 4096  # a CUDA IPC memory handle is 64 bytes; expandable segments send a little more

_HEX_DIGITS = frozenset(string.hexdigits.lower())


def dtype_name(dtype: torch.dtype, *, operation: str) -> str:
    """The allow-listed name of `dtype` (`torch.bfloat16` -> `"bfloat16"`), or ValueError."""
    name = str(dtype).removeprefix("torch.")
    if IPC_DTYPES.get(name) is not dtype:
        raise ValueError(f"{operation}: dtype {dtype} cannot travel in an IPC handle; allowed: {', '.join(IPC_DTYPES)}")
    return name


def to_hex(data: bytes | None) -> str | None:
    return None if data is None else bytes(data).hex()


class HandleReader:
    """Checked access to the fields of one handle; every error names the field.

    Use one reader per handle: read every field the format has, then call `done()`, which
    refuses fields the format does not have (a handle is exactly its format, nothing more).
    """

    def __init__(self, handle: Any, *, backend: str, kind: str) -> None:
        self._where = f"import_ipc on backend {backend!r}"
        if not isinstance(handle, dict):
            raise ValueError(f"{self._where}: handle must be a dict (JSON object), got {type(handle).__name__}")
        for key in handle:
            if not isinstance(key, str):
                raise ValueError(f"{self._where}: handle has a non-str key {key!r}")
        self._handle = handle
        self._read: set[str] = set()
        found = self.text("kind")
        if found != kind:
            self.fail("kind", f"is {found!r}, expected {kind!r} (a handle from another backend?)")

    def fail(self, field: str, problem: str) -> NoReturn:
        raise ValueError(f"{self._where}: handle field {field!r} {problem}")

    def _get(self, field: str) -> Any:
        if field not in self._handle:
            self.fail(field, "is missing")
        self._read.add(field)
        return self._handle[field]

    def text(self, field: str, *, max_len: int = 255) -> str:
        value = self._get(field)
        if not isinstance(value, str):
            self.fail(field, f"must be a str, got {type(value).__name__}")
        if len(value) > max_len:
            self.fail(field, f"is {len(value)} characters long, at most {max_len} allowed")
        return value

    def integer(self, field: str, *, minimum: int = 0, maximum: int = INT64_MAX) -> int:
        return self._check_int(field, self._get(field), minimum, maximum)

    def _check_int(self, field: str, value: Any, minimum: int, maximum: int) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            self.fail(field, f"must be an int, got {type(value).__name__} {value!r}")
        if value < minimum:
            self.fail(field, f"must be >= {minimum}, got {value}")
        if value > maximum:
            self.fail(field, f"must be <= {maximum}, got {value}")
        return value

    def integers(self, field: str) -> tuple[int, ...]:
        """A list of non-negative ints (a shape or a stride) of at most MAX_DIMS entries."""
        value = self._get(field)
        if not isinstance(value, list):
            self.fail(field, f"must be a list of ints, got {type(value).__name__}")
        if len(value) > MAX_DIMS:
            self.fail(field, f"has {len(value)} entries, at most {MAX_DIMS} allowed")
        return tuple(self._check_int(f"{field}[{i}]", item, 0, INT64_MAX) for i, item in enumerate(value))

    def flag(self, field: str, *, nullable: bool = False) -> bool | None:
        value = self._get(field)
        if value is None and nullable:
            return None
        if not isinstance(value, bool):
            self.fail(field, f"must be a bool, got {type(value).__name__}")
        return value

    def hex_bytes(self, field: str, *, nullable: bool = False) -> bytes | None:
        value = self._get(field)
        if value is None and nullable:
            return None
        if not isinstance(value, str):
            self.fail(field, f"must be a hex str{' or None' if nullable else ''}, got {type(value).__name__}")
        if len(value) > 2 * MAX_HEX_BYTES:
            self.fail(field, f"holds more than {MAX_HEX_BYTES} bytes")
        if len(value) % 2 or not set(value) <= _HEX_DIGITS:
            self.fail(field, "is not lower-case hex with an even number of digits")
        return bytes.fromhex(value)

    def dtype(self, field: str = "dtype") -> torch.dtype:
        name = self.text(field, max_len=32)
        if name not in IPC_DTYPES:
            self.fail(field, f"names no allowed dtype: {name!r} (allowed: {', '.join(IPC_DTYPES)})")
        return IPC_DTYPES[name]

    def done(self) -> None:
        extra = sorted(set(self._handle) - self._read)
        if extra:
            self.fail(extra[0], "is not part of this handle format")


def view_extent(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements from a view's first element to one past its last (0 for an empty view)."""
    if any(d == 0 for d in shape):
        return 0
    return 1 + sum((d - 1) * s for d, s in zip(shape, stride))


def check_view(reader: HandleReader, shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int,
               byte_offset: int, storage_nbytes: int, *, offset_field: str, size_field: str) -> None:
    """The view `(shape, stride)` at `byte_offset` lies inside `storage_nbytes` bytes."""
    if len(shape) != len(stride):
        reader.fail("stride", f"has {len(stride)} entries for a shape of {len(shape)}")
    if byte_offset > storage_nbytes:
        reader.fail(offset_field, f"puts the view at byte {byte_offset}, past the {storage_nbytes} bytes of {size_field}")
    if byte_offset % itemsize:
        reader.fail(offset_field, f"puts the view at byte {byte_offset}, not a multiple of the element size {itemsize}")
    end = byte_offset + view_extent(shape, stride) * itemsize
    if end > storage_nbytes:
        reader.fail(
            "shape",
            f"{list(shape)} with stride {list(stride)} at byte {byte_offset} reaches byte {end}, "
            f"past the {storage_nbytes} bytes of {size_field}",
        )
