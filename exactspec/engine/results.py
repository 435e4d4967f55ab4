"""What `generate` returns: the tokens, the text, their log-probabilities, and step statistics."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields


def mean_acceptance_length(emitted: int, steps: int) -> float:
    """Tokens emitted per target forward, the recovered / bonus token included: 1.0 for plain
    decoding, at most K+1; 0.0 before any step. The one definition (engine, bench, training)."""
    return emitted / steps if steps else 0.0


def add_counts(a: list[int], b: list[int]) -> list[int]:
    """Per-position counts of two rows (or runs) summed, the shorter list read as zeros past
    its end: the one place per-position counts are added."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


@dataclass
class GenerationStats:
    """How one row's generation went. Every target forward is one step.

    mean_acceptance_length counts the recovered / bonus token: it is tokens emitted per target
    forward, 1.0 for plain decoding, at most K+1.
    """

    steps: int = 0  # target forwards (verification steps) for this row
    drafted: int = 0  # draft tokens proposed to this row
    accepted: int = 0  # draft tokens the verifier kept
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: steps with draft i kept
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: steps with a draft i
    emitted: int = 0  # tokens in token_ids
    seconds: float = 0.0  # wall time from the start of the row's batch to the row's end
    prefill_seconds: float = 0.0  # of which: the batch's prompt prefill
    # Of `seconds`, per step of the batch while this row was in it (perf_counter deltas):
    draft_seconds: float = 0.0  # the drafter's propose
    target_seconds: float = 0.0  # the target's forward over the last token and the drafts
    verify_seconds: float = 0.0  # standardize (probs_from_logits) + verify / sample

    def record_step(self, drafted: int, accepted: int, emitted: int, draft_seconds: float,
                    target_seconds: float, verify_seconds: float, seconds: float) -> None:
        """Add one target forward: drafts proposed / kept in it, the row's tokens so far, the
        step's timings and the seconds since the batch started."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        for counts, n in ((self.accepted_per_position, accepted),
                          (self.drafted_per_position, drafted)):
            counts += [0] * max(0, n - len(counts))
            for pos in range(n):
                counts[pos] += 1
        self.emitted = emitted
        self.draft_seconds += draft_seconds
        self.target_seconds += target_seconds
        self.verify_seconds += verify_seconds
        self.seconds = seconds

    def merge(self, other: GenerationStats) -> GenerationStats:
        """These statistics and `other`'s summed, field by field (per-position counts by
        position): the totals of a request's choices, a call's rows or a run's batches.
        Seconds are summed too, so a total's rates are per row-second."""
        out = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        for name in ("accepted_per_position", "drafted_per_position"):
            out[name] = add_counts(getattr(self, name), getattr(other, name))
        return GenerationStats(**out)

    @staticmethod
    def total(stats: Iterable[GenerationStats]) -> GenerationStats:
        """Every one of `stats` merged (an empty total when there is none)."""
        out = GenerationStats()
        for st in stats:
            out = out.merge(st)
        return out

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per target forward, the recovered / bonus token included."""
        return mean_acceptance_length(self.emitted, self.steps)

    @property
    def other_seconds(self) -> float:
        """Bookkeeping: seconds not spent in prefill, draft, target forward or verify."""
        return max(0.0, self.seconds - self.prefill_seconds - self.draft_seconds
                   - self.target_seconds - self.verify_seconds)

    @property
    def tokens_per_second(self) -> float:
        """emitted / seconds: the row's own rate within its batch."""
        return self.emitted / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        """Fields and derived rates, JSON-ready."""
        out = asdict(self)
        out.update(
            acceptance_rate=self.acceptance_rate,
            mean_acceptance_length=self.mean_acceptance_length,
            tokens_per_second=self.tokens_per_second,
            other_seconds=self.other_seconds,
        )
        return out

    def summary(self) -> str:
        """One line for logs and the CLI."""
        line = (f"{self.emitted} tokens in {self.seconds:.2f} s ({self.tokens_per_second:.1f} tok/s), "
                f"{self.steps} target steps, {self.mean_acceptance_length:.2f} tokens/step")
        if self.drafted:
            line += f", acceptance {self.accepted}/{self.drafted} = {self.acceptance_rate:.1%}"
        return line


@dataclass
class Generation:
    """One row's output. token_ids holds generated tokens only (an EOS that ended it included)."""

    token_ids: list[int]  # generated tokens, never the prompt
    text: str | None  # decoded without special tokens, cut before a stop string; None without tokenizer
    # log p of each token: under the target's standardized distribution (logprobs_mode
    # "processed", the default) or the model's own log_softmax ("raw"); None unless asked
    logprobs: list[float] | None
    stats: GenerationStats  # steps, acceptance, timing
    finish_reason: str = "length"  # "eos" | "stop" (a stop string) | "length" (max_new_tokens)
    # True when every token is distributed exactly as the target samples it; False when an
    # opt-in lossy verify rule ("lenient:L", "typical:EPS") or an uncertified callable decided
    lossless: bool = True
    # per token, the top_logprobs most likely (token id, log p) of its position under the
    # same law as `logprobs`, most likely first; None unless top_logprobs > 0
    top_logprobs: list[list[tuple[int, float]]] | None = None
