"""The drafter Protocol: what the engine needs from anything that proposes draft tokens.

A drafter is stateful over one batch of rows. The engine calls, in order:

    drafter.begin(context, target)            # a new batch; prompts are in `context`
    loop:
        tokens, q = drafter.propose(context, num_tokens)
        ... the target verifies; `context` gains the emitted tokens ...
        drafter.select(rows)                  # when some rows finished: keep these rows

`propose` returns draft_tokens [B, K] (K = max(num_tokens), rows padded with -1 at the end,
fewer tokens than asked allowed, including none) and draft_probs [B, K, V], the exact
distribution q each token was drawn from, or None for a point-mass draft. Rollback needs no
hook: at the next `propose` the context shows what was kept, and a drafter with its own cache
keeps only the prefix that agrees with it. Randomness comes from `context.streams`, domain
`DOMAIN_DRAFT + j` for draft position j, so the draft never reuses the verifier's uniforms.

A drafter that reads the target's features (EAGLE-style heads) declares a `hidden_layers`
attribute (a tuple of indices into transformers' `hidden_states`); the engine then fills
`DraftContext.hidden` from the target's own prefill and verification forwards, at no extra cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from exactspec.sampling import RowStreams, SamplingParams


@dataclass
class DraftContext:
    """The rows being generated, as the engine sees them before a step."""

    tokens: torch.Tensor  # [B, T] long: prompt then emitted tokens, padded with -1 at the end
    lengths: torch.Tensor  # [B] long: real tokens per row
    prompt_lengths: torch.Tensor  # [B] long: leading tokens that are prompt (for penalties)
    params: SamplingParams  # the same parameters the target's p is standardized with
    streams: RowStreams  # one random stream per row, advanced once per engine step
    # [B, T, F] target features aligned with `tokens`, only for drafters with `hidden_layers`:
    # hidden[b, i] = the target's hidden states at token i for transformers' `hidden_states`
    # indices in drafter.hidden_layers, concatenated; valid for i < lengths[b] - 1 (the last
    # token has not been through the target yet). None for other drafters.
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class TargetInfo:
    """What a drafter may check against the target before drafting for it."""

    vocab_size: int  # width of the target's logits
    tokenizer: object | None  # the target's tokenizer, when known
    model: object | None = None  # the target's transformers model (heads share its embeddings)


@runtime_checkable
class Drafter(Protocol):
    """Anything with these three methods can draft for the engine (see the module docstring)."""

    def begin(self, context: DraftContext, target: TargetInfo) -> None:
        """Start a new batch of rows; raise ValueError if this drafter cannot serve `target`."""

    def propose(
        self, context: DraftContext, num_tokens: torch.Tensor  # [B] long, >= 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [B, K] long -1 padded, [B, K, V] | None
        """Up to num_tokens[b] draft tokens per row, and the q they were drawn from."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` ([R] long indices into the current batch), in that order."""


def history(context: DraftContext, extra: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's tokens followed by `extra` ([B, J] long, -1 padded): [B, T'] -1 padded.

    The penalties' token history when drawing after `extra`; rows stay -1 padded at the end.
    """
    if extra is None or extra.shape[1] == 0:
        return context.tokens
    b, j = extra.shape
    width = int(context.lengths.max()) + j
    out = torch.full((b, width), -1, dtype=torch.long, device=context.tokens.device)
    t = min(width, context.tokens.shape[1])
    out[:, :t] = context.tokens[:, :t]
    idx = context.lengths[:, None] + torch.arange(j, device=out.device)  # [B, J]
    out.scatter_(1, idx, extra.to(out.device))
    return out


def prefix_history(hist: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """hist [B, T] with positions >= ends [B, ...] set to -1: [B, ..., T].

    For a distribution at draft position i, the history is the context plus drafts before i.
    """
    pos = torch.arange(hist.shape[1], device=hist.device)
    extra_dims = ends.dim() - 1
    h = hist.reshape(hist.shape[0], *([1] * extra_dims), hist.shape[1])
    return h.masked_fill(pos >= ends[..., None], -1)


def empty_proposal(
    num_tokens: torch.Tensor, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, K] all -1, [B, K, V] zeros
    """The (drafts, q) pair a drafter fills in for `num_tokens` ([B], K = its max): no token
    drafted yet, q = 0 everywhere."""
    b = num_tokens.shape[0]
    k = int(num_tokens.max()) if b else 0
    drafts = torch.full((b, k), -1, dtype=torch.long, device=device)
    return drafts, torch.zeros(b, k, vocab, dtype=torch.float32, device=device)
