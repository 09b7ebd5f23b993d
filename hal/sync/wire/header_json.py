"""A sync header as JSON on the wire: its limits, the dtype names, and the reading that
refuses hostile input while it parses, before a hostile value is ever built (the header
itself is hal.sync.wire.header.SyncHeader).
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from types import MappingProxyType
from typing import Any, Mapping

import torch

from hal.sync.wire.auth import WIRE_PROTOCOL
from hal.sync.errors import HeaderError
from hal.sync.spec import TensorSpec

HEADER_PROTOCOL = WIRE_PROTOCOL
"""Wire format version; bumped whenever the header's keys or their meaning change (3: the
proof covers the receivers' challenge, `Transport.challenge`; 4: a piece's checksum pads its
last partial word, hal.kernels.verify)."""

MAX_SPECS = 2**17
"""Most tensors one sync may carry (131,072): 1.3 times a DeepSeek-V3-sized MoE (about
100,000 tensors with their scales). What a header may cost a receiver derives from it
(below): the largest real header these limits allow costs about 1.5 s and 180 MiB to
decode, and a hostile one no more (tests/sync/wire/test_header.py, the costs); twice the
tensors would cost twice that."""

# What one spec holds on the wire, on average over MAX_SPECS of them: `["name",[d0,d1,d2,d3],"dtype"],`
# is 2 arrays, 4 quotes and, with up to 4 dimensions, 6 commas, in about 100 bytes (a
# DeepSeek-V3 name has 60 characters); the header's own keys and values add a few of each.
_SPEC_BYTES = 256
_SPEC_COUNTS = {"[{": 2, '"': 4, ",": 6}
_COUNTED = {"[{": "'[' and '{' (arrays and objects)", '"': "quotes (two a string)", ",": "commas (one a value)"}
_HEAD_COUNTS = 64

MAX_HEADER_BYTES = MAX_SPECS * _SPEC_BYTES
"""Largest encoded header either side accepts (32 MiB): what MAX_SPECS specs of 256 bytes take."""

MAX_HEADER_COUNTS: Mapping[str, int] = MappingProxyType({c: MAX_SPECS * n + _HEAD_COUNTS for c, n in _SPEC_COUNTS.items()})
"""How many of these characters a header may hold: what MAX_SPECS specs hold (`check_counts`).
What JSON parsing builds is bounded by these, not by the length: every value but the first
in an array or object follows a comma, every array and object opens with a bracket, every
string with a quote; 32 MiB of `[],` would be 11 million lists, 0.8 GiB of Python objects."""

MAX_NAME_CHARS = 1024
MAX_DIMS = 32
MAX_DIM = 2**48
MAX_TENSOR_BYTES = 2**48
MIN_BUCKET_BYTES = 4096  # as SyncConfig: smaller buckets make no sense and stress the plan
MAX_BUCKET_BYTES = 2**40
MAX_VERSION = 2**63  # exclusive: versions fit an int64 on every side
DIGEST_CHARS = 24  # hal.sync.plan.buckets.plan_key keeps this many hex characters
AUTH_CHARS = 64  # hex of an HMAC-SHA256

# No valid header holds a number longer than this (2**63 has 19 digits). Checked before
# Python converts the literal: conversion of a long digit string is quadratic, and the
# interpreter's own digit limit can be switched off.
_MAX_NUMBER_CHARS = 24
_MAX_QUOTE = 100

_WIRE_DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)

WIRE_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {name: dtype for name in _WIRE_DTYPE_NAMES if isinstance(dtype := getattr(torch, name, None), torch.dtype)}
)
"""Wire name -> dtype of every dtype a sync may carry (those this torch lacks are left out)."""

_DTYPE_OF: dict[str, torch.dtype] = dict(WIRE_DTYPES)  # a plain dict: looked up once per spec
NAME_OF: dict[torch.dtype, str] = {dtype: name for name, dtype in WIRE_DTYPES.items()}
ITEMSIZE: dict[torch.dtype, int] = {dtype: dtype.itemsize for dtype in WIRE_DTYPES.values()}
_HEX = {n: re.compile(f"[0-9a-f]{{{n}}}") for n in (DIGEST_CHARS, AUTH_CHARS)}
KEYS = ("protocol", "version", "specs", "bucket_bytes", "segment_bytes", "verify", "digest", "delta", "delta_base", "auth")


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of `dtype` (its torch attribute name, e.g. "bfloat16")."""
    try:
        return NAME_OF[dtype]
    except (KeyError, TypeError):  # TypeError: not hashable, so not a dtype either
        raise ValueError(f"dtype {quote(dtype)} cannot travel in a sync; supported: {', '.join(WIRE_DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype whose wire name is `name`."""
    dtype = WIRE_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"unknown dtype name {quote(name)}; valid names: {', '.join(WIRE_DTYPES)}")
    return dtype


# -- checks shared by construction and decoding --------------------------------------------


def char_counts(text: str) -> dict[str, int]:
    """How many of each of MAX_HEADER_COUNTS's characters `text` holds (inside strings too)."""
    return {chars: sum(text.count(c) for c in chars) for chars in MAX_HEADER_COUNTS}


def check_counts(found: Mapping[str, int]) -> None:
    """Refuse a header whose `char_counts` exceed what a header of MAX_SPECS tensors holds: a
    cheap look before JSON parsing, which would build an object for each of them. Counted
    inside strings too, so names that hold these characters count against the bound; it
    is on the whole header, so only one of nearly MAX_SPECS tensors of more than 4
    dimensions or such names on average comes near it."""
    for chars, n in found.items():
        limit = MAX_HEADER_COUNTS[chars]
        if n > limit:
            raise HeaderError(
                f"header holds {n} {_COUNTED[chars]}; a header of at most {MAX_SPECS} tensors holds at most {limit} "
                f"({_SPEC_COUNTS[chars]} per tensor): refused unparsed"
            )


def check_int(field: str, value: Any, lo: int | None = None, hi: int | None = None, expected: str = "an int") -> None:
    if type(value) is not int:  # exactly int: a bool or a float is a different value on the wire
        raise HeaderError(f"header field {field!r}: expected {expected}, got {describe(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise HeaderError(f"header field {field!r}: {quote(value)} is outside [{_bound(lo)}, {_bound(hi)}]")


def check_hex(field: str, value: Any, chars: int, alternative: str = "") -> None:
    if not isinstance(value, str) or not _HEX[chars].fullmatch(value):
        expected = f"{chars} lowercase hex characters{alternative}"
        raise HeaderError(f"header field {field!r}: expected {expected}, got {describe(value)}")


def check_spec(i: int, name: Any, shape: Any, dtype: Any) -> None:
    # Runs once per tensor on every sync, up to a million times: messages are built only on failure.
    problem = _spec_problem(name, shape, dtype)
    if problem is not None:
        raise HeaderError(f"{_where(i, name)}: {problem}")


def _where(i: int, name: Any) -> str:
    return f"header field 'specs[{i}]'" + (f" ({quote(name)})" if isinstance(name, str) and name else "")


def _spec_problem(name: Any, shape: Any, dtype: Any) -> str | None:
    if not isinstance(name, str) or not name:
        return f"name must be a non-empty string, got {describe(name)}"
    if len(name) > MAX_NAME_CHARS:
        return f"name of {len(name)} characters, at most {MAX_NAME_CHARS} are allowed"
    if "\0" in name:
        return "name contains NUL"
    if not name.isascii():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: not text, cannot travel as UTF-8
            return "name is not valid Unicode (it holds a lone surrogate)"
    if type(shape) is not tuple:
        return f"shape must be a sequence of ints, got {describe(shape)}"
    if len(shape) > MAX_DIMS:
        return f"shape has {len(shape)} dimensions, at most {MAX_DIMS} are allowed"
    for d in shape:
        if type(d) is not int or d < 0 or d > MAX_DIM:
            return f"shape dimensions must be ints in [0, 2**48], got {describe(d)}"
    itemsize = ITEMSIZE.get(dtype) if isinstance(dtype, torch.dtype) else None
    if itemsize is None:
        return f"dtype {quote(dtype)} cannot travel in a sync; supported: {', '.join(WIRE_DTYPES)}"
    if math.prod(shape) * itemsize > MAX_TENSOR_BYTES:  # at most 32 dims of 2**48: a small bignum
        return f"shape {quote(shape)} of {NAME_OF[dtype]} holds more than {MAX_TENSOR_BYTES} bytes"
    return None


class _LastSpecs:
    """The last spec tuple that passed every check, and the JSON list it was decoded from.

    Every sync of a training job carries the same tensors, and checking a few hundred of
    them costs milliseconds per sync; a list equal to the last one decoded (compared as
    plain JSON values, so nothing hostile gets past) reuses its checked tuple.
    """

    def __init__(self) -> None:
        self.raw: list | None = None
        self.specs: tuple[TensorSpec, ...] | None = None
        self.text: str | None = None  # the JSON text of `raw` as a header carried it

    def remember(self, raw: list | None, specs: tuple[TensorSpec, ...]) -> None:
        if raw is not None or self.specs is not specs:
            self.raw = raw
            self.text = None
        self.specs = specs


validated = _LastSpecs()

# Spec tuples that passed every check, by identity (a plan's tuple is the same object every
# sync of a layout), the tuple kept so its id stays its own: the last few, so that senders
# of two layouts in one process (or a sender beside a receiver) do not check anew each sync.
_checked: dict[int, tuple] = {}
_CHECKED_KEPT = 8


def specs_checked(specs: tuple[TensorSpec, ...]) -> bool:
    return _checked.get(id(specs)) is specs


def remember_checked(specs: tuple[TensorSpec, ...]) -> None:
    if len(_checked) >= _CHECKED_KEPT and id(specs) not in _checked:
        _checked.pop(next(iter(_checked)))  # the oldest
    _checked[id(specs)] = specs
# Where the specs start in a header this module encoded: `{"protocol":P,"version":V,"specs":`.
# JSON strings cannot hold an unescaped quote, so this prefix is the structure it looks like.
SPECS_AT = re.compile(r'\{"protocol":[0-9]+,"version":[0-9]+,"specs":')
SPECS_END = '],"bucket_bytes":'  # and where they end (hal.sync.wire.header.SyncHeader._decode)
# The JSON text of the last few spec tuples encoded, by the tuple's identity (a plan's, so
# the same object every sync of a layout): (tuple, text), kept with the tuple so its id
# stays its own. More than one: a process may run senders of two layouts (a transport that
# sends buckets whole beside one that cuts segments) and must not encode anew for each.
_encoded: dict[int, tuple[tuple, str, dict[str, int]]] = {}  # with the text's `char_counts`
_ENCODED_KEPT = 8


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def specs_text(specs: tuple[TensorSpec, ...]) -> tuple[str, dict[str, int]]:
    """The specs' JSON text and its `char_counts`, made once per tuple."""
    kept = _encoded.get(id(specs))
    if kept is not None and kept[0] is specs:
        return kept[1], kept[2]
    text = dumps([[s.name, list(s.shape), NAME_OF[s.dtype]] for s in specs])
    if len(_encoded) >= _ENCODED_KEPT:
        _encoded.pop(next(iter(_encoded)))  # the oldest
    _encoded[id(specs)] = (specs, text, char_counts(text))
    return text, _encoded[id(specs)][2]


def decode_specs(raw: Any) -> tuple[TensorSpec, ...]:
    if validated.raw is not None and type(raw) is list and raw == validated.raw and _same_types(raw, validated.raw):
        return validated.specs  # type: ignore[return-value]
    specs = _decode_new_specs(raw)
    validated.remember(raw, specs)
    remember_checked(specs)
    return specs


def _same_types(a: list, b: list) -> bool:
    """`==` treats True as 1 and 1.0 as 1: equal lists must also hold values of equal types."""
    for x, y in zip(a, b):
        if type(x[1]) is not list or type(y[1]) is not list:
            return False
        if any(type(d) is not int for d in x[1]) or type(x[0]) is not str or type(x[2]) is not str:
            return False
    return True


def _decode_new_specs(raw: Any) -> tuple[TensorSpec, ...]:
    if not isinstance(raw, list):
        raise HeaderError(f"header field 'specs': expected a list of [name, shape, dtype], got {describe(raw)}")
    if len(raw) > MAX_SPECS:
        raise HeaderError(f"header field 'specs': {len(raw)} tensors, at most {MAX_SPECS} are allowed")
    specs = []
    seen: set[str] = set()
    trusted = TensorSpec.trusted
    for i, entry in enumerate(raw):
        if not isinstance(entry, list) or len(entry) != 3:
            raise HeaderError(f"header field 'specs[{i}]': expected [name, shape, dtype], got {describe(entry)}")
        name, shape, dtype = entry
        torch_dtype = _DTYPE_OF.get(dtype) if isinstance(dtype, str) else None
        if torch_dtype is None:
            raise HeaderError(f"{_where(i, name)}: dtype {quote(dtype)} is not one of {', '.join(WIRE_DTYPES)}")
        if isinstance(shape, list):
            shape = tuple(shape)
        # checked here, more strictly than TensorSpec would (it coerces true to 1 and 2.5 to
        # 2), so the spec is built without its checks: a header may hold MAX_SPECS of them
        check_spec(i, name, shape, torch_dtype)
        if name in seen:
            raise HeaderError(f"header field 'specs[{i}]': name {quote(name)} appears twice")
        seen.add(name)
        specs.append(trusted(name, shape, torch_dtype))
    return tuple(specs)


# -- json hooks: refuse while parsing, before a hostile value is ever built ----------------


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise HeaderError(f"header repeats the key {quote(key)}")
            seen.add(key)
    return obj


def refuse_constant(name: str) -> Any:
    raise HeaderError(f"header holds {name}, which is not a JSON number (no header field takes it)")


def parse_int(literal: str) -> int:
    if len(literal) > _MAX_NUMBER_CHARS:
        raise HeaderError(
            f"header holds an integer of {len(literal)} characters ({quote(literal)}): no header field takes one that large"
        )
    return int(literal)


def parse_float(literal: str) -> float:
    if len(literal) > _MAX_NUMBER_CHARS:
        raise HeaderError(f"header holds a number of {len(literal)} characters ({quote(literal)}): no header field takes one")
    return float(literal)  # kept so the field that holds it is named in the error


# -- messages ---------------------------------------------------------------------------


def protocol_message(protocol: int) -> str:
    return (
        f"header protocol {quote(protocol)}; this verl-hal speaks {HEADER_PROTOCOL}: "
        "mismatched verl-hal versions on trainer and engine?"
    )


_repr = reprlib.Repr()
_repr.maxlevel = 3
_repr.maxstring = _MAX_QUOTE
_repr.maxother = _MAX_QUOTE
_repr.maxlong = 40
for _attr in ("maxtuple", "maxlist", "maxdict", "maxset", "maxfrozenset"):
    setattr(_repr, _attr, 6)


def quote(value: Any) -> str:
    """repr of `value`, at most about _MAX_QUOTE characters, whatever its size."""
    if type(value) is int and value.bit_length() > 128:
        return f"<int of {value.bit_length()} bits>"  # repr of a huge int is slow, or refused past the digit limit
    try:
        text = _repr.repr(value)
    except Exception:  # a foreign object's __repr__ may raise anything; never hide the real error behind it
        return f"<{type(value).__name__}>"
    return text if len(text) <= _MAX_QUOTE else text[: _MAX_QUOTE - 3] + "..."


def describe(value: Any) -> str:
    if value is None:
        return "null"
    return f"{type(value).__name__} {quote(value)}"


def _bound(value: int | None) -> str:
    if value is None:
        return "..."
    for exp in (63, 48, 40):
        if value in (2**exp, 2**exp - 1):
            return f"2**{exp}" + ("" if value == 2**exp else " - 1")
    return str(value)


def reason(exc: BaseException) -> str:
    text = str(exc)
    text = text if len(text) <= _MAX_QUOTE else text[: _MAX_QUOTE - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
