"""What one canary check found: each engine's log-probs against the trainer's
(`compare`, `EngineCanary`), the record that goes into a sync's result (`CanaryReport`),
and the error "enforce" raises (`CanaryError`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import torch
from hal.canary.probe import Probe


class CanaryError(RuntimeError):
    """An engine computes other log-probs than the trainer on the canary's probe (or could
    not compute them). The sync itself completed: the engine holds the new version's bytes;
    `report` says what each engine computed, `result` is the sync's result when a sync
    raised it."""

    def __init__(self, message: str, *, report: "CanaryReport | None" = None) -> None:
        super().__init__(message)
        self.report = report
        self.result: Any = None
        """The sync's own result (its metrics, the engines' versions), set by the sync that raised."""


# ---- the comparison ------------------------------------------------------------------------------
@dataclass(slots=True)
class EngineCanary:
    """What one engine computed on the probe, against the trainer."""

    engine: str
    max_abs: float | None = None
    """Largest |Δ log-prob| over the probe (inf where either side is not finite)."""
    mean_abs: float | None = None
    """Mean |Δ log-prob| over the probe's scored tokens."""
    sequence: int | None = None
    """The worst token's sequence (index into the probe)."""
    position: int | None = None
    """The worst token's position in its sequence (>= 1: the first token is not scored)."""
    token: int | None = None
    """The worst token's id."""
    trainer_logprob: float | None = None
    engine_logprob: float | None = None
    tokens: int = 0
    """How many log-probs were compared."""
    seconds: float | None = None
    """The engine's time to compute the probe (as the trainer saw it)."""
    error: str | None = None
    """Why this engine computed nothing (an engine that cannot, a refused request); None otherwise."""
    passed: bool = False

    def describe(self, tolerance: float) -> str:
        if self.error is not None:
            return f"engine {self.engine!r} computed no log-probs on the canary's probe: {self.error}"
        return (
            f"engine {self.engine!r}: max |Δ log-prob| {self.max_abs:.3g} at sequence {self.sequence}, position {self.position} "
            f"(token {self.token}: trainer {self.trainer_logprob:.4f}, engine {self.engine_logprob:.4f}), tolerance {tolerance:.3g}; "
            f"mean |Δ| {self.mean_abs:.3g} over {self.tokens} tokens"
        )


def compare(engine: str, probe: Probe, reference: Sequence[Sequence[float]], got: Sequence[Sequence[float]]) -> EngineCanary:
    """|Δ| of `got` (one engine's log-probs of the probe) against the trainer's `reference`;
    a value that is not finite on one side only (a NaN logit) counts as an infinite Δ."""
    _check_shape("the trainer's", probe, reference)
    _check_shape(f"engine {engine!r}'s", probe, got)
    ref = torch.tensor([x for row in reference for x in row], dtype=torch.float64)
    eng = torch.tensor([x for row in got for x in row], dtype=torch.float64)
    delta = (ref - eng).abs()
    same = (ref == eng) | (torch.isnan(ref) & torch.isnan(eng))
    delta = torch.where(same, torch.zeros_like(delta), delta)
    delta = torch.where(torch.isnan(delta), torch.full_like(delta, math.inf), delta)
    worst = int(torch.argmax(delta))
    sequence, position = _locate(probe, worst)
    return EngineCanary(
        engine=engine,
        max_abs=float(delta[worst]),
        mean_abs=float(delta.mean()),
        sequence=sequence,
        position=position,
        token=probe.sequences[sequence][position],
        trainer_logprob=float(ref[worst]),
        engine_logprob=float(eng[worst]),
        tokens=int(delta.numel()),
    )


def _check_shape(whose: str, probe: Probe, logprobs: Sequence[Sequence[float]]) -> None:
    if len(logprobs) != len(probe.sequences):
        raise ValueError(f"canary: {whose} log-probs cover {len(logprobs)} sequences, the probe has {len(probe.sequences)}")
    for n, (row, seq) in enumerate(zip(logprobs, probe.sequences)):
        if len(row) != len(seq) - 1:
            raise ValueError(f"canary: {whose} log-probs of sequence {n}: {len(row)} values, expected {len(seq) - 1}")


def _locate(probe: Probe, flat: int) -> tuple[int, int]:
    for n, seq in enumerate(probe.sequences):
        if flat < len(seq) - 1:
            return n, flat + 1
        flat -= len(seq) - 1
    raise IndexError(flat)


# ---- the record --------------------------------------------------------------------------------
@dataclass(slots=True)
class CanaryReport:
    """One check of every engine, as it goes into the sync's result (`SyncResult.canary`)."""

    version: int
    mode: str
    tolerance: float
    """The max |Δ| an engine may show (after calibration, when calibrated)."""
    dtype: str
    """The least precise dtype among trainer, wire and engine, which set the tolerance."""
    calibrated: bool = False
    """The tolerance was tightened from what this check saw (its first check)."""
    engines: dict[str, EngineCanary] = field(default_factory=dict)
    probe_tokens: int = 0
    """Log-probs per side (the probe's tokens less one per sequence)."""
    reference_s: float | None = None
    """The trainer's forward on the probe."""
    seconds: float = 0.0
    """The whole check, from its start until every engine answered and all were compared."""

    @property
    def fired(self) -> bool:
        """An engine differs by more than the tolerance, or computed nothing."""
        return any(not e.passed for e in self.engines.values())

    @property
    def max_abs(self) -> float | None:
        values = [e.max_abs for e in self.engines.values() if e.max_abs is not None]
        return max(values) if values else None

    @property
    def mean_abs(self) -> float | None:
        values = [e.mean_abs for e in self.engines.values() if e.mean_abs is not None]
        return max(values) if values else None

    def message(self) -> str:
        """What `CanaryError` says: each engine that fired, with the probe position and the Δ."""
        failed = [e.describe(self.tolerance) for e in self.engines.values() if not e.passed]
        return (
            f"canary at version {self.version}: the engine computes other log-probs than the trainer on the probe "
            f"(the bytes landed; what the engine computes with does not match them; tolerance from {self.dtype}"
            f"{', calibrated' if self.calibrated else ''}): " + "; ".join(failed)
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fired"] = self.fired
        out["max_abs"] = self.max_abs
        out["mean_abs"] = self.mean_abs
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CanaryReport":
        """The report `as_dict` wrote (what another trainer rank was told)."""
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        fields["engines"] = {name: EngineCanary(**e) for name, e in dict(data.get("engines") or {}).items()}
        return cls(**fields)

    def as_metrics(self, prefix: str = "canary/") -> dict[str, float]:
        """Numbers only, for a trainer's metrics (verl merges these into a step's)."""
        out = {f"{prefix}fired": float(self.fired), f"{prefix}tolerance": self.tolerance, f"{prefix}seconds": self.seconds}
        if self.max_abs is not None:
            out[f"{prefix}max_abs"] = self.max_abs
        if self.mean_abs is not None:
            out[f"{prefix}mean_abs"] = self.mean_abs
        return out
