"""Proofs that a trainer knows an engine's token, which never travels itself.

`auth_proof` goes in every sync's header, over that sync's challenge (drawn afresh by the
ranks for each header: hal.sync.wire.channel), so a header seen once is never accepted again;
`init_proof` goes with the request that makes an engine join a trainer's group.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from hal.sync.errors import AuthError

# The sync protocol's version, bound into every proof (a proof made for another protocol is
# no proof here) and announced in every header (hal.sync.wire.header_json.HEADER_PROTOCOL).
# 4: a piece's checksum pads its last partial word instead of weighing its tail bytes one
# by one, so that a bucket's checksums are computed all at once (hal.kernels.checksums).
# 5: a piece followed by padding gets a segment of its own between long runs of other
# pieces (hal.sync.plan.buckets.segment_bucket): the same plan digest, other segments.
WIRE_PROTOCOL = 5


def auth_proof(token: str, *, version: int, digest: str, challenge: str) -> str:
    """Hex HMAC-SHA256 keyed by `token` over this sync's protocol, version, plan digest and
    challenge.

    The token itself never travels. Binding the proof to version and digest keeps a proof
    seen on the wire from vouching for a different sync; binding it to the challenge, which
    the receivers draw afresh for every header (`Transport.challenge`), keeps a header seen
    once from being accepted again, in this group or in any later one.
    """
    if not isinstance(token, str):
        raise TypeError(f"auth token must be a str, got {type(token).__name__}")
    message = f"verl-hal-sync|{WIRE_PROTOCOL}|{version}|{digest}|{challenge}".encode("utf-8")
    return hmac.new(token.encode("utf-8"), message, hashlib.sha256).hexdigest()


def check_auth(header: "SyncHeader", token: str | None, challenge: str) -> None:  # noqa: F821 - hal.sync.wire.header's, which imports this module
    """Refuse `header` with AuthError unless it proves knowledge of `token` for this sync's
    `challenge` (token None: an open engine)."""
    if token is None:
        return
    if header.auth is None:
        raise AuthError("the trainer presented no token, but this engine requires one")
    expected = auth_proof(token, version=header.version, digest=header.digest, challenge=challenge)
    if not hmac.compare_digest(expected, header.auth):  # constant time: leaks no prefix of the proof
        raise AuthError("the trainer's token does not match this engine's, or the header was not made for this sync (a replay)")


def init_proof(token: str, **fields: str | int | float | None) -> str:
    """Hex HMAC-SHA256 keyed by `token` over every field of one init request (the
    rendezvous's address, port and group size, and the settings the engine takes from
    it: rank offset, transport, wire dtype, timeout): what a trainer shows an engine
    before the engine joins its group. A proof seen on the way therefore cannot send the
    engine to another trainer, nor change how it joins."""
    if not isinstance(token, str):
        raise TypeError(f"auth token must be a str, got {type(token).__name__}")
    bound = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    message = f"verl-hal-init|{WIRE_PROTOCOL}|{bound}".encode("utf-8")
    return hmac.new(token.encode("utf-8"), message, hashlib.sha256).hexdigest()


def check_init_proof(token: str | None, proof: str | None, **fields: str | int | float | None) -> None:
    """Refuse with AuthError, before any connection is made, a trainer that does not prove
    it knows `token` for exactly these init `fields` (None: an open engine accepts anyone)."""
    if token is None:
        return
    if proof is None:
        raise AuthError("the trainer presented no token, but this engine requires one (set VERL_HAL_SYNC_TOKEN on the trainer)")
    expected = init_proof(token, **fields)
    # isascii first: compare_digest raises TypeError on a non-ASCII str, which is no refusal
    if not isinstance(proof, str) or not proof.isascii() or not hmac.compare_digest(expected, proof):
        raise AuthError(
            "the trainer's token does not match this engine's (VERL_HAL_SYNC_TOKEN differs), "
            "or the init request was changed on the way"
        )
