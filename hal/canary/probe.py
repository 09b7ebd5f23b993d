"""The canary's probe: the token sequences the trainer and each engine score."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

# A drawn probe's shape unless the user sets one: 4 x 16 tokens. On a CPU the trainer's
# forward costs about its FLOPs, 2 x parameters per token, so a probe of a hundred tokens
# or more costs the 0.5B model over a tenth of a sync at every 10th (docs/canary.md,
# "Cost"); on an accelerator a longer probe costs milliseconds.
PROBE_SEQUENCES, PROBE_LENGTH = 4, 16


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
