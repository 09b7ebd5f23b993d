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

from hal.canary.forward import dtype_of, module_logprobs, vocab_size_of
from hal.canary.policy import Canary, CanaryConfig, DEFAULT, DEFAULT_EVERY, TOLERANCES, as_canary, default_config
from hal.canary.probe import Probe
from hal.canary.report import CanaryError, CanaryReport

__all__ = [
    "Canary",
    "CanaryConfig",
    "CanaryError",
    "CanaryReport",
    "DEFAULT",
    "DEFAULT_EVERY",
    "Probe",
    "TOLERANCES",
    "as_canary",
    "default_config",
    "dtype_of",
    "module_logprobs",
    "vocab_size_of",
]
