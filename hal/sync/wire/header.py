"""The per-sync header: what the sending rank tells every receiver before any tensor byte.

It crosses a process boundary, so it travels as explicit JSON and is never unpickled: a
receiver that unpickles what a peer sends runs whatever that peer chose. `decode` treats
its input as hostile: anything malformed, truncated, oversize or of another protocol
raises `HeaderError` naming what is wrong, in time and memory bounded by
`MAX_HEADER_BYTES`, and no other exception gets out.

    challenge = transport.channel.challenge()                              # every rank
    data = SyncHeader.from_plan(plan, version=step, token=token, challenge=challenge).encode()  # trainer
    header = SyncHeader.decode(data)                                       # each engine worker
    check_auth(header, engine_token, challenge)                            # hal.sync.wire.auth

What decoding may cost derives from the most tensors a sync may carry (`MAX_SPECS`): at
most `MAX_HEADER_BYTES`, and, counted before any parse, no more arrays, strings and commas
than that many specs hold (`check_counts`), so that parsing builds no more objects than a
real header of that size would: about 1.5 s and 180 MiB at worst. Before these counts,
64 MiB of tiny JSON arrays cost 1.6 GiB and 8 s of parsing (issue 25). Authentication is
checked after decoding, since the proof travels in the header.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import json
from dataclasses import dataclass
from hal.sync.wire.auth import auth_proof
from hal.sync.errors import HeaderError
from hal.sync.wire.header_json import (  # noqa: F401 - the wire's limits and names, re-exported
    ITEMSIZE,
    KEYS,
    NAME_OF,
    SPECS_AT,
    SPECS_END,
    AUTH_CHARS,
    DIGEST_CHARS,
    HEADER_PROTOCOL,
    MAX_BUCKET_BYTES,
    MAX_DIM,
    MAX_DIMS,
    MAX_HEADER_BYTES,
    MAX_HEADER_COUNTS,
    MAX_NAME_CHARS,
    MAX_SPECS,
    MAX_TENSOR_BYTES,
    MAX_VERSION,
    MIN_BUCKET_BYTES,
    WIRE_DTYPES,
    check_hex,
    check_int,
    check_spec,
    decode_specs,
    describe,
    dumps,
    parse_float,
    parse_int,
    protocol_message,
    quote,
    reason,
    refuse_constant,
    specs_text,
    unique_keys,
    validated,
    char_counts,
    check_counts,
    dtype_from_name,
    dtype_name,
    remember_checked,
    specs_checked,
)
from hal.sync.spec import TensorSpec

if TYPE_CHECKING:  # annotations only: the plan (hal.sync.plan) sits above this layer
    from hal.sync.plan.buckets import BucketPlan




@dataclass(frozen=True, kw_only=True, slots=True)
class SyncHeader:
    """What a sync carries, checked on construction: build one only from valid values."""

    protocol: int = HEADER_PROTOCOL
    """Wire format version; must equal HEADER_PROTOCOL."""

    version: int
    """Weight version of this sync, 0 <= version < 2**63."""

    specs: tuple[TensorSpec, ...]
    """Every tensor of the sync, in bucket-plan order; names unique."""

    bucket_bytes: int
    """Bucket size the plan was built with, 4096 <= bucket_bytes <= 2**40."""

    segment_bytes: int | None
    """Segment size the plan was built with (None: a bucket travels whole), else 4096 <= s <= 2**40."""

    verify: bool
    """Whether buckets carry checksums."""

    digest: str
    """The sender's bucket-plan digest (hal.sync.plan.buckets.plan_key): 24 lowercase hex characters."""

    delta: bool = False
    """The sender keeps the bytes of its last complete sync (delta sync on): receivers keep
    theirs too, so that later syncs can carry only what changed."""

    delta_base: int | None = None
    """Segments of this sync may carry only what changed since weight version `delta_base`
    (receivers refuse unless they hold exactly that version); None: every segment is whole."""

    auth: str | None = None
    """HMAC proof that the sender knows the engine's token (see `auth_proof`), or None."""

    def __post_init__(self) -> None:
        check_int("protocol", self.protocol)
        if self.protocol != HEADER_PROTOCOL:
            raise HeaderError(protocol_message(self.protocol))
        check_int("version", self.version, 0, MAX_VERSION - 1)
        if type(self.specs) is not tuple:
            raise HeaderError(f"header field 'specs': expected a tuple of TensorSpec, got {describe(self.specs)}")
        if len(self.specs) > MAX_SPECS:
            raise HeaderError(f"header field 'specs': {len(self.specs)} tensors, at most {MAX_SPECS} are allowed")
        if not specs_checked(self.specs):  # every sync of a job sends the same tensors: check them once
            seen: set[str] = set()
            for i, spec in enumerate(self.specs):
                if not isinstance(spec, TensorSpec):
                    raise HeaderError(f"header field 'specs[{i}]': expected a TensorSpec, got {describe(spec)}")
                check_spec(i, spec.name, spec.shape, spec.dtype)
                if spec.name in seen:
                    raise HeaderError(f"header field 'specs[{i}]': name {quote(spec.name)} appears twice")
                seen.add(spec.name)
            remember_checked(self.specs)
        check_int("bucket_bytes", self.bucket_bytes, MIN_BUCKET_BYTES, MAX_BUCKET_BYTES)
        if self.segment_bytes is not None:
            check_int("segment_bytes", self.segment_bytes, MIN_BUCKET_BYTES, MAX_BUCKET_BYTES, "an int or null")
        if type(self.verify) is not bool:
            raise HeaderError(f"header field 'verify': expected a bool, got {describe(self.verify)}")
        check_hex("digest", self.digest, DIGEST_CHARS)
        if type(self.delta) is not bool:
            raise HeaderError(f"header field 'delta': expected a bool, got {describe(self.delta)}")
        if self.delta_base is not None:
            check_int("delta_base", self.delta_base, 0, MAX_VERSION - 1, "an int or null")
            if not self.delta:
                raise HeaderError("header field 'delta_base': set although 'delta' is false")
        if self.auth is not None:
            check_hex("auth", self.auth, AUTH_CHARS, " or null")

    @classmethod
    def from_plan(
        cls, plan: BucketPlan, *, version: int, token: str | None = None, challenge: str | None = None,
        delta: bool = False, delta_base: int | None = None,
    ) -> SyncHeader:
        """The header announcing `plan` as weight `version`, with a proof of `token` over
        this sync's `challenge` (`Transport.challenge`) when a token is given."""
        if token is not None and challenge is None:
            raise ValueError("SyncHeader.from_plan: a token needs this sync's challenge (Transport.challenge()) to prove")
        auth = None if token is None else auth_proof(token, version=version, digest=plan.digest, challenge=challenge)
        return cls(
            version=version,
            specs=plan.specs,
            bucket_bytes=plan.bucket_bytes,
            segment_bytes=plan.segment_bytes,
            verify=plan.verify,
            digest=plan.digest,
            delta=delta,
            delta_base=delta_base,
            auth=auth,
        )

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors (not counting padding or checksums)."""
        return sum(s.nbytes for s in self.specs)

    def encode(self) -> bytes:
        """Compact UTF-8 JSON, the same bytes for equal headers; HeaderError past MAX_HEADER_BYTES.

        Keys in a fixed order, `specs` third: a receiver that has checked the same specs
        text before skips parsing it (`_decode`), and the sender encodes it once per spec
        tuple (a job sends the same tensors every sync: thousands for an MoE model)."""
        head = {"protocol": self.protocol, "version": self.version}
        rest = {
            "bucket_bytes": self.bucket_bytes,
            "segment_bytes": self.segment_bytes,
            "verify": self.verify,
            "digest": self.digest,
            "delta": self.delta,
            "delta_base": self.delta_base,
            "auth": self.auth,
        }
        # ensure_ascii=False: names travel as UTF-8, not \u escapes; __post_init__ refused
        # names that are not valid Unicode, so this always encodes.
        specs, specs_counts = specs_text(self.specs)
        around = dumps(head)[:-1] + ',"specs":', "," + dumps(rest)[1:]
        data = (around[0] + specs + around[1]).encode("utf-8")
        if len(data) > MAX_HEADER_BYTES:
            raise HeaderError(
                f"header of {len(data)} bytes ({len(self.specs)} tensors) exceeds MAX_HEADER_BYTES ({MAX_HEADER_BYTES}): "
                "receivers would refuse it"
            )
        # the specs' counts were taken once with their text; the rest is a few hundred bytes
        rest_counts = char_counts(around[0] + around[1])
        try:
            check_counts({c: n + rest_counts[c] for c, n in specs_counts.items()})
        except HeaderError as exc:
            raise HeaderError(f"header of {len(self.specs)} tensors: {exc}; receivers would refuse it") from None
        return data

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> SyncHeader:
        """The header in `data`, as sent by a peer; HeaderError (only) for anything else."""
        try:
            return cls._decode(data)
        except HeaderError:
            raise
        except (ValueError, TypeError, RecursionError, OverflowError, MemoryError) as exc:
            # ValueError covers json.JSONDecodeError and UnicodeDecodeError
            raise HeaderError(f"unreadable sync header: {reason(exc)}") from None

    @classmethod
    def _decode(cls, data: bytes | bytearray | memoryview) -> SyncHeader:
        if isinstance(data, memoryview):
            size = data.nbytes
        elif isinstance(data, (bytes, bytearray)):
            size = len(data)
        else:
            raise HeaderError(f"header must be bytes, bytearray or memoryview, got {type(data).__name__}")
        # before anything else: a hostile peer must not make us parse gigabytes
        if size > MAX_HEADER_BYTES:
            raise HeaderError(f"header of {size} bytes exceeds MAX_HEADER_BYTES ({MAX_HEADER_BYTES}); refused unread")
        if size == 0:
            raise HeaderError("header is empty")
        try:
            text = bytes(data).decode("utf-8") if isinstance(data, memoryview) else data.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad = exc.object[exc.start : exc.start + 1]
            raise HeaderError(f"header is not valid UTF-8: byte {exc.start} ({bad!r}): {exc.reason}") from None
        known = validated.specs if validated.text is not None else None
        prefix = SPECS_AT.match(text)
        if known is not None and prefix is not None and text.startswith(validated.text, prefix.end()):
            # the same specs text as the last one checked: parse the rest only
            end = prefix.end() + len(validated.text)
            text = text[: prefix.end()] + "null" + text[end:]
        else:
            known = None
        check_counts(char_counts(text))  # what parsing `text` would build, before it is built
        try:
            obj = json.loads(
                text,
                object_pairs_hook=unique_keys,
                parse_constant=refuse_constant,
                parse_int=parse_int,
                parse_float=parse_float,
            )
        except json.JSONDecodeError as exc:
            raise HeaderError(f"header is not JSON: {exc.msg} at character {exc.pos}") from None
        except RecursionError:
            raise HeaderError("header nests arrays or objects too deeply to be a sync header") from None
        if not isinstance(obj, dict):
            raise HeaderError(f"header must be one JSON object, got {describe(obj)}")
        # protocol first: a peer of another protocol may have other keys, and this is what to tell the user
        if "protocol" not in obj:
            raise HeaderError("header has no 'protocol' key: not a verl-hal sync header, or mismatched verl-hal versions?")
        check_int("protocol", obj["protocol"])
        if obj["protocol"] != HEADER_PROTOCOL:
            raise HeaderError(protocol_message(obj["protocol"]))
        unknown = [k for k in obj if k not in KEYS]
        if unknown:
            shown = ", ".join(quote(k) for k in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            raise HeaderError(f"header has unknown key(s) {shown}")
        missing = [k for k in KEYS if k not in obj]
        if missing:
            raise HeaderError(f"header is missing key(s) {', '.join(repr(k) for k in missing)}")
        if known is not None:
            if obj["specs"] is not None:  # (cannot be: "null" stands where the text was)
                raise HeaderError("header field 'specs': unreadable")
            obj["specs"] = known
            return cls(**obj)
        obj["specs"] = decode_specs(obj["specs"])
        header = cls(**obj)
        if prefix is not None and validated.specs is header.specs:
            # remember the specs' text as it came, for the next sync's header (`encode` puts
            # bucket_bytes after them). Where it ends: a `],"bucket_bytes":` reads so only
            # there, in a header whose every field passed: inside a string each quote is
            # escaped, and no field after the specs holds an array.
            end = text.find(SPECS_END, prefix.end())
            if end >= 0:
                validated.text = text[prefix.end() : end + 1]
        return header


__all__ = [
    "HEADER_PROTOCOL",
    "MAX_HEADER_BYTES",
    "MAX_HEADER_COUNTS",
    "MAX_SPECS",
    "WIRE_DTYPES",
    "SyncHeader",
    "dtype_from_name",
    "dtype_name",
]

