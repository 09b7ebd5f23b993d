"""The settings of verl's checkpoint engine "hal": verl's `bucket_size` and `engine_kwargs["hal"]` as a `SyncConfig`.

verl passes `bucket_size` (`update_weights_bucket_megabytes`) and the mapping
`engine_kwargs["hal"]`, whose keys are the `SyncConfig` fields (`bucket_bytes`,
`segment_bytes`, `bypass_cpu`, `wire_dtype`, `verify`, `timeout_s`, `delta`) plus the
engine's own (`ENGINE_SETTINGS`): `transport`, `senders` (who sends, in hal.sync's words:
`gather` or `all`; `master` is taken as the former name of `gather`) and `canary`
(`CanarySettings`, `canary_settings`; not given: on, in "log" mode, at the first update and
every 100th after it; null or false: off). `delta` is true (`DeltaConfig()`), false, or a
mapping of `DeltaConfig` fields (`{"anchor_every": 16, "choose": "time"}`). Any other key is
refused naming the valid ones (`is_master` is verl's). verl's default bucket size (2048 MiB)
means "hal sizes the buckets" (from free device memory); any other value is the bucket
size. Imports no verl.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hal.sync import DeltaConfig, SyncConfig
from hal.sync.config import ALL, GATHER
from hal.canary import DEFAULT, CanaryConfig, Probe, default_config
from hal.sync.wire import WIRE_DTYPES, dtype_from_name

# verl's default `update_weights_bucket_megabytes` (CheckpointEngineConfig, verl 0.9.1):
# a bucket size of exactly this many MiB means the user left it alone, and hal sizes the
# buckets from free device memory instead.
VERL_DEFAULT_BUCKET_MEGABYTES = 2048
# This engine's own settings in engine_kwargs["hal"], beside SyncConfig's fields.
TRANSPORT_CHOICES = ("auto", "broadcast", "ipc", "hierarchical")
# Which trainer ranks send (hal.sync.SENDING): "gather" (trainer rank 0, verl's master, sends
# what verl's generator gathers; the others gather with it) or "all" (every trainer rank
# sends its own FSDP2 shard over a sync group of its own with every rollout worker; nothing
# is gathered). Not "one": every rank of verl's trainer is called to send.
SENDERS_CHOICES = (GATHER, ALL)
# The names a `senders` value had before hal.sync's one vocabulary, still taken (docs/verl.md).
FORMER_SENDERS = {"master": GATHER}
ENGINE_SETTINGS = {
    "transport": "how bytes travel: " + " | ".join(TRANSPORT_CHOICES) + " (default auto)",
    "senders": "which trainer ranks send: " + " | ".join(SENDERS_CHOICES) + " (default gather; master: its former name)",
    "canary": "the runtime-state canary after an update: a mapping of mode, every, seed, tolerance, ...; "
              "not given: on, in log mode, every 100th update from the first; null or false: off (docs/canary.md)",
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


def senders_setting(value: Any) -> str:
    """engine_kwargs["hal"]["senders"] in hal.sync's words: one of `SENDERS_CHOICES`, or a
    former name of one (`FORMER_SENDERS`); ValueError naming the valid ones otherwise."""
    if isinstance(value, str) and value in FORMER_SENDERS:
        return FORMER_SENDERS[value]
    return choice("senders", value, SENDERS_CHOICES)


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


# ---- the canary (docs/canary.md, "verl's checkpoint engine") ---------------------------------
@dataclass(frozen=True, slots=True)
class CanarySettings:
    """`engine_kwargs["hal"]["canary"]`: the canary of hal.canary after each completed
    update, as the checkpoint engine "hal" runs it (hal.integrations.verl.canary).

    `config` is the `CanaryConfig` of the mapping's `CanaryConfig` fields; `engine_logprobs`
    and `timeout_s` are the engine's own; `by_default` says that nothing was configured."""

    config: CanaryConfig
    """mode ("off", "log", "enforce"), every, seed, sequences, length, vocab_size, probe
    (a list of token-id lists), tolerance, calibrate."""
    engine_logprobs: str | None = None
    """"package.module:function", called on each rollout worker as `function(server_adapter,
    sequences)` for the engine's log-probs of the probe (a list per sequence, one value per
    token after the first; None: this worker does not answer, e.g. a TP rank other than its
    replica's first); may return an awaitable. None: the server adapter's own
    `prompt_logprobs(sequences)` method."""
    timeout_s: float | None = None
    """Bound on each of the canary's waits (the engines' answer included); None: `timeout_s`
    of the sync."""
    by_default: bool = False
    """Not configured (no `canary` in engine_kwargs['hal']): the default canary
    (`hal.canary.policy.Canary.default()`), which checks what it can and never fails an update."""

    @property
    def enabled(self) -> bool:
        return self.config.mode != "off"


CANARY_ENGINE_FIELDS = ("engine_logprobs", "timeout_s")


def canary_settings(value: Any) -> CanarySettings:
    """engine_kwargs["hal"]["canary"]: `DEFAULT` (not given: the default canary), None/false
    (off), a mapping of `CanaryConfig` fields plus `engine_logprobs` and `timeout_s`, or a
    `CanarySettings`; ValueError naming the bad field otherwise."""
    if isinstance(value, CanarySettings):
        return value
    where = "checkpoint engine 'hal': engine_kwargs['hal'].canary"
    if value is DEFAULT:
        return CanarySettings(default_config(), by_default=True)
    if value is None or value is False:
        return CanarySettings(CanaryConfig(mode="off"))
    if isinstance(value, CanaryConfig):
        return CanarySettings(value)
    config_fields = [f.name for f in dataclasses.fields(CanaryConfig)]
    valid = config_fields + list(CANARY_ENGINE_FIELDS)
    if not hasattr(value, "keys"):  # (OmegaConf's DictConfig is a mapping too)
        raise ValueError(f"{where} must be a mapping of {', '.join(valid)} (or false); got {value!r}")
    unknown = sorted(str(k) for k in value.keys() if k not in valid)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")
    values = {k: value[k] for k in value.keys()}
    probe = values.get("probe")
    if probe is not None and not isinstance(probe, Probe):
        try:
            values["probe"] = Probe.of([list(seq) for seq in probe])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}.probe must be a list of token-id lists: {exc}") from None
    hook = values.pop("engine_logprobs", None)
    if hook is not None and (not isinstance(hook, str) or hook.count(":") != 1 or not all(hook.split(":"))):
        raise ValueError(f"{where}.engine_logprobs must be 'package.module:function', got {hook!r}")
    timeout = values.pop("timeout_s", None)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"{where}.timeout_s must be None or a positive number of seconds, got {timeout!r}")
    try:
        config = CanaryConfig(**values)
    except ValueError as exc:  # "CanaryConfig.every must be an int >= 1, got 0": name the field as the user wrote it
        message = str(exc)
        field = message.split(" ", 1)[0].removeprefix("CanaryConfig.")
        raise ValueError(f"{where}.{field}: {message}") from None
    return CanarySettings(config, engine_logprobs=hook, timeout_s=float(timeout) if timeout is not None else None)
