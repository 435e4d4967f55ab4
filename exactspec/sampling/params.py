"""SamplingParams: every knob that shapes the standardized distribution, validated once."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from exactspec.errors import InvalidValue

SEED_LIMIT = 1 << 63  # seeds are ints in [0, SEED_LIMIT): they fit a signed 64-bit integer

@dataclass(frozen=True)
class SamplingParams:
    """How a token is drawn. p and q are both computed from these, by `probs_from_logits`.

    0 means "off" for top_k and min_p, 1.0 for top_p and repetition_penalty.
    """

    temperature: float = 1.0  # 0 means greedy (one-hot at the argmax, ties to the lowest id)
    top_k: int = 0  # keep the k most likely tokens (ties at the k-th value kept); 0 = off
    top_p: float = 1.0  # keep the smallest set reaching this mass (nucleus); 1.0 = off
    min_p: float = 0.0  # drop tokens below min_p * max probability; 0 = off
    repetition_penalty: float = 1.0  # CTRL: logit / r if > 0 else logit * r, prompt + output tokens
    presence_penalty: float = 0.0  # OpenAI: minus this once for every token seen in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    logit_bias: Mapping[int, float] | None = field(default=None)  # token id -> additive bias
    seed: int | None = None  # in [0, 2**63); one shared: row i's stream from (seed, i), per row: its own

    def __post_init__(self) -> None:
        problems = []
        if not _finite(self.temperature) or self.temperature < 0:
            problems.append(f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k={self.top_k!r} must be an int >= 0 (0 = off)")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p!r} must be in (0, 1] (1.0 = off)")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            problems.append(f"min_p={self.min_p!r} must be in [0, 1] (0 = off)")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            problems.append(
                f"repetition_penalty={self.repetition_penalty!r} must be > 0 (1.0 = off)"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not _finite(getattr(self, name)):
                problems.append(f"{name}={getattr(self, name)!r} must be a finite number (0 = off)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < SEED_LIMIT):
            problems.append(f"seed={self.seed!r} must be an int in [0, 2**63) or None (a fresh seed)")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, Mapping):
                problems.append(f"logit_bias must be a mapping token id -> bias, got {type(bias).__name__}")
            else:
                for tok, val in bias.items():
                    if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                        problems.append(f"logit_bias key {tok!r} must be a token id (int >= 0)")
                    if not _finite(val):
                        problems.append(f"logit_bias[{tok!r}]={val!r} must be a finite number")
                # Freeze a private copy so the caller mutating its dict cannot change us.
                object.__setattr__(self, "logit_bias", dict(bias) or None)
        if problems:
            raise InvalidValue("invalid SamplingParams: " + "; ".join(problems))

    def __hash__(self) -> int:
        bias = tuple(sorted(self.logit_bias.items())) if self.logit_bias else None
        return hash((self.temperature, self.top_k, self.top_p, self.min_p,
                     self.repetition_penalty, self.presence_penalty, self.frequency_penalty,
                     bias, self.seed))

    def without_seed(self) -> SamplingParams:
        """The same law with seed None: rows whose params differ only by seed share p's transform."""
        return self if self.seed is None else replace(self, seed=None)

    @property
    def is_greedy(self) -> bool:
        """True when the standardized distribution is a one-hot at the argmax."""
        return self.temperature == 0

    @property
    def uses_history(self) -> bool:
        """True when a penalty is active, so the token history changes the distribution."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
