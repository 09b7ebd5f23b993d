"""What a LoRA sync sends, and the peft names the engine expects.

One pure function, `decide_lora_sync`, says what travels on a sync: the base weights,
the adapter weights, or the merged weights (base with the adapter folded in). The
rule, from the public record:

* No adapter: the whole model is trained, so every sync sends every weight.
* Adapter merged on the trainer: every sync sends the merged weights; the base alone
  never travels (the engine has no adapter to apply).
* Adapter kept separate: the adapter travels on every sync. The base travels on the
  first sync and whenever the engine has lost it, and at no other time. The engine
  loses its weights when it sleeps at level 2 with `free_cache_engine` on, so with that
  configuration the base goes on every sync (verl 3461: skipping it left the engine
  serving garbage); with level 0 or 1, or with `free_cache_engine` off, the engine keeps
  the base and resending it is waste (verl PR 5147: 26% of step time). Skipping the
  whole sync because the engine does not sleep is never right: the adapter changed
  (verl 4248).

`BaseWeightTracker` keeps the one bit of history the rule needs (`base_sent`).

The peft helpers (hal.sync.lora.peft, re-exported here) read a `peft.PeftModel` by its
parameter names only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "SLEEP_LEVELS",
    "LoraSyncDecision",
    "decide_lora_sync",
    "BaseWeightTracker",
    "PEFT_PREFIX",
    "base_weight_name",
    "adapter_weight_name",
    "base_tensors",
    "adapter_tensors",
    "merged_tensors",
    "MergedSource",
    "adapter_config",
    "adapter_specs",
]

# vLLM's sleep levels: 0 pauses scheduling and keeps everything; 1 moves the weights to
# host memory and drops the KV cache; 2 discards weights and KV cache.
SLEEP_LEVELS = (0, 1, 2)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraSyncDecision:
    """What one sync sends. At least one of the three is True."""

    send_base: bool
    """Send the base model's weights under the engine's names (with no adapter: the whole model)."""
    send_adapter: bool
    """Send the adapter's weights (lora_A / lora_B under the names peft saves)."""
    send_merged: bool
    """Send the weights with the adapter folded in, under the engine's base names."""
    reason: str
    """Why, in one sentence, for logs."""

    @property
    def parts(self) -> tuple[str, ...]:
        """The parts that travel, in sending order: a subset of ("base", "adapter", "merged")."""
        return tuple(
            name for name, on in (("base", self.send_base), ("adapter", self.send_adapter), ("merged", self.send_merged)) if on
        )


def decide_lora_sync(
    *,
    has_adapter: bool,
    adapter_merged: bool,
    sleep_level: int,
    free_cache_engine: bool,
    base_sent: bool,
) -> LoraSyncDecision:
    """Decide what a sync sends. Pure: the same inputs always give the same decision.

    :param has_adapter: the trainer trains a LoRA adapter (a peft model).
    :param adapter_merged: the adapter is merged into the base weights for the engine
        (verl's `lora.merge=True`); needs `has_adapter`.
    :param sleep_level: the engine's sleep level between rollouts (0, 1 or 2, as vLLM's
        `LLM.sleep(level=...)`).
    :param free_cache_engine: the engine is put to sleep between rollouts at all (verl's
        `rollout.free_cache_engine`); when False it never frees anything.
    :param base_sent: the base weights have been sent since the engine last lost them
        (False before the first sync, and after the engine reports it freed its weights).
    """
    for name, value in (
        ("has_adapter", has_adapter),
        ("adapter_merged", adapter_merged),
        ("free_cache_engine", free_cache_engine),
        ("base_sent", base_sent),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"decide_lora_sync: {name} must be a bool, got {value!r}")
    if isinstance(sleep_level, bool) or sleep_level not in SLEEP_LEVELS:
        raise ValueError(f"decide_lora_sync: sleep_level must be one of {SLEEP_LEVELS}, got {sleep_level!r}")
    if adapter_merged and not has_adapter:
        raise ValueError("decide_lora_sync: adapter_merged=True needs has_adapter=True (there is nothing to merge)")

    if not has_adapter:
        return LoraSyncDecision(send_base=True, send_adapter=False, send_merged=False, reason="no adapter: the whole model is trained, every sync sends all weights")
    if adapter_merged:
        return LoraSyncDecision(
            send_base=False, send_adapter=False, send_merged=True, reason="adapter merged on the trainer: every sync sends the merged weights, never the base alone"
        )
    engine_frees_weights = free_cache_engine and sleep_level == 2
    if not base_sent:
        return LoraSyncDecision(
            send_base=True, send_adapter=True, send_merged=False, reason="the engine does not hold the base weights (first sync, or it lost them): base and adapter"
        )
    if engine_frees_weights:
        return LoraSyncDecision(
            send_base=True, send_adapter=True, send_merged=False, reason="sleep level 2 with free_cache_engine discards the weights while asleep: base and adapter"
        )
    if not free_cache_engine:
        why = "free_cache_engine is off, the engine never frees its weights"
    elif sleep_level == 1:
        why = "sleep level 1 keeps the base weights in host memory"
    else:
        why = "sleep level 0 keeps the weights on the device"
    return LoraSyncDecision(send_base=False, send_adapter=True, send_merged=False, reason=f"{why}: adapter only")


@dataclass(slots=True)
class BaseWeightTracker:
    """The history `decide_lora_sync` needs, kept for one engine.

        tracker = BaseWeightTracker(has_adapter=True, sleep_level=1, free_cache_engine=True)
        decision = tracker.decide()
        ...send decision.parts...
        tracker.sent(decision)
        tracker.engine_lost_weights()     # when the engine reports it freed its weights
    """

    has_adapter: bool
    """The trainer trains a LoRA adapter."""
    sleep_level: int
    """The engine's sleep level (0, 1 or 2)."""
    free_cache_engine: bool
    """The engine sleeps between rollouts."""
    adapter_merged: bool = False
    """Send merged weights instead of base + adapter."""
    base_sent: bool = field(default=False)
    """The engine holds the base weights we sent (False until the first sync completes)."""

    def decide(self) -> LoraSyncDecision:
        return decide_lora_sync(
            has_adapter=self.has_adapter,
            adapter_merged=self.adapter_merged,
            sleep_level=self.sleep_level,
            free_cache_engine=self.free_cache_engine,
            base_sent=self.base_sent,
        )

    def sent(self, decision: LoraSyncDecision) -> None:
        """Record a sync that completed with `decision`."""
        if decision.send_base:
            self.base_sent = True
        elif decision.send_merged:
            self.base_sent = False  # the engine holds merged weights, not the pure base

    def engine_lost_weights(self) -> None:
        """The engine freed its weights (it said so, or it slept at level 2 with freeing)."""
        self.base_sent = False


# The peft helpers (hal.sync.lora.peft), re-exported: the policy above and the names below are
# what a LoRA sync needs, and users import both from here.
from hal.sync.lora.peft import (  # noqa: E402
    PEFT_PREFIX,
    MergedSource,
    adapter_config,
    adapter_specs,
    adapter_tensors,
    adapter_weight_name,
    base_tensors,
    base_weight_name,
    merged_tensors,
)
