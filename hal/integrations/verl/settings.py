"""The settings of verl's checkpoint engine "hal": verl's `bucket_size` and `engine_kwargs["hal"]` as a `SyncConfig`.

`engine_kwargs["hal"]` takes the `SyncConfig` fields (`bucket_bytes`, `segment_bytes`,
`bypass_cpu`, `wire_dtype`, `verify`, `timeout_s`, `delta`) plus the engine's own
(`ENGINE_SETTINGS`: `transport`, `senders`); anything else is refused naming the valid
ones. Imports no verl.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hal.sync import DeltaConfig, SyncConfig
from hal.sync.header_json import WIRE_DTYPES, dtype_from_name

# verl's default `update_weights_bucket_megabytes` (CheckpointEngineConfig, verl 0.9.1):
# a bucket size of exactly this many MiB means the user left it alone, and hal sizes the
# buckets from free device memory instead.
VERL_DEFAULT_BUCKET_MEGABYTES = 2048
# This engine's own settings in engine_kwargs["hal"], beside SyncConfig's fields.
TRANSPORT_CHOICES = ("auto", "broadcast", "ipc", "hierarchical")
# Which trainer ranks send: "master" (trainer rank 0 sends what verl's generator gathers;
# the others gather with it) or "all" (every trainer rank sends its own FSDP2 shard over a
# sync group of its own with every rollout worker; nothing is gathered).
SENDERS_CHOICES = ("master", "all")
ENGINE_SETTINGS = {
    "transport": "how bytes travel: " + " | ".join(TRANSPORT_CHOICES) + " (default auto)",
    "senders": "which trainer ranks send: " + " | ".join(SENDERS_CHOICES) + " (default master)",
    "is_master": "set by verl on trainer rank 0 (the rank that sends)",
}
# SyncConfig fields this engine does not take, and why (docs/verl.md, "Not supported yet").
UNSUPPORTED_SETTINGS: dict[str, str] = {}


def sync_config_from(bucket_size: int, settings: dict[str, Any]) -> SyncConfig:
    """The `SyncConfig` for verl's `bucket_size` (bytes) and `engine_kwargs["hal"]` settings
    (already without this engine's own keys); ValueError naming an unknown setting."""
    refused = sorted(set(settings) & set(UNSUPPORTED_SETTINGS))
    if refused:
        raise ValueError(f"checkpoint engine 'hal': setting {refused[0]!r} is not supported: {UNSUPPORTED_SETTINGS[refused[0]]}")
    fields = [f.name for f in dataclasses.fields(SyncConfig) if f.name not in UNSUPPORTED_SETTINGS]
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise ValueError(
            f"checkpoint engine 'hal': unknown setting(s) {', '.join(map(repr, unknown))} in "
            f"engine_kwargs['hal']; valid: the SyncConfig fields {', '.join(fields)}, and "
            f"{', '.join(sorted(ENGINE_SETTINGS))}"
        )
    values = dict(settings)
    wire = values.get("wire_dtype")
    if isinstance(wire, str):
        try:
            values["wire_dtype"] = dtype_from_name(wire.strip())
        except ValueError:
            raise ValueError(
                f"checkpoint engine 'hal': wire_dtype {wire!r} is not a torch dtype name (e.g. 'bfloat16'); "
                f"valid: {', '.join(WIRE_DTYPES)}"
            ) from None
    if "delta" in values:
        values["delta"] = delta_config(values["delta"])
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0:
        raise ValueError(f"checkpoint engine 'hal': bucket_size must be a positive int of bytes, got {bucket_size!r}")
    if bucket_size != VERL_DEFAULT_BUCKET_MEGABYTES << 20:
        given = values.get("bucket_bytes")
        if given is not None and given != bucket_size:
            raise ValueError(
                f"checkpoint engine 'hal': update_weights_bucket_megabytes says {bucket_size >> 20} MiB "
                f"({bucket_size} bytes) but engine_kwargs['hal'].bucket_bytes says {given}: set one"
            )
        values["bucket_bytes"] = bucket_size
    return SyncConfig(**values)


def delta_config(value: Any) -> DeltaConfig | None:
    """engine_kwargs["hal"]["delta"]: true, false/None, a mapping of DeltaConfig fields, or a DeltaConfig."""
    if value is None or value is False:
        return None
    if value is True:
        return DeltaConfig()
    if isinstance(value, DeltaConfig):
        return value
    fields = [f.name for f in dataclasses.fields(DeltaConfig)]
    if not hasattr(value, "keys"):  # (OmegaConf's DictConfig is a mapping too)
        raise ValueError(f"checkpoint engine 'hal': delta must be true, false or a mapping of {', '.join(fields)}; got {value!r}")
    unknown = sorted(set(value.keys()) - set(fields))
    if unknown:
        raise ValueError(f"checkpoint engine 'hal': unknown delta setting(s) {', '.join(map(repr, unknown))}; valid: {', '.join(fields)}")
    return DeltaConfig(**{k: value[k] for k in value.keys()})


def choice(setting: str, value: Any, choices: tuple[str, ...]) -> str:
    """One of the engine's own word settings (`transport`, `senders`); ValueError naming it otherwise."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"checkpoint engine 'hal': {setting} must be one of {', '.join(choices)}, got {value!r}")
    return value


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float | int]:
    """The sync's metrics as verl merges them into a step's: numbers only (verl averages
    them), dicts flattened (`segments_by_encoding/dense`), words and Nones left out."""
    out: dict[str, float | int] = {}
    for key, value in metrics.items():
        if key == "plan_reused":
            continue
        if isinstance(value, dict):
            out.update({f"checkpoint_engine/hal/{key}/{k}": v for k, v in value.items() if isinstance(v, (int, float))})
        elif isinstance(value, (int, float)):  # (bools too: delta)
            out[f"checkpoint_engine/hal/{key}"] = value
    return out
