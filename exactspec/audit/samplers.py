"""The real speculative sampler as an audit `Scheme`, and batched simulation of whole generations.

`Speculative(method, K)` enumerates exactly through `acceptance_law` and draws through `verify`:
the audit checks the library's own code, never a copy of it. Pitfalls (`pitfalls.py`) subclass
it and change one thing each.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from exactspec.audit.exact import StepLaw, draft_blocks, normalise
from exactspec.audit.world import World
from exactspec.sampling import (
    DOMAIN_ACCEPT,
    DOMAIN_DRAFT,
    DOMAIN_RESAMPLE,
    AcceptanceLaw,
    acceptance_law,
    sample_from_weights,
    uniforms,
    verify,
)


@dataclass
class Drafted:
    """K draft tokens per row and the tables verify needs, for a batch of contexts."""

    tokens: torch.Tensor  # [B, K] long: the draft tokens
    uniforms: torch.Tensor  # [B, K] float64: the uniform each draft token was drawn with
    target: torch.Tensor  # [B, K+1, V] float64: p after the context and each draft prefix
    claimed: torch.Tensor | None  # [B, K, V] float64: q handed to verify; None = point mass
    draft: torch.Tensor  # [B, K, V] float64: the distributions the drafts were drawn from


def draft_batch(world: World, lengths: torch.Tensor, ids: torch.Tensor, k: int,
                generator: torch.Generator) -> Drafted:
    """Draw K draft tokens after each context (lengths [B], ids [B]) by inverse CDF of the draft."""
    v, bsz = world.vocab, len(ids)
    u = uniforms(generator, bsz, k, DOMAIN_DRAFT)  # [B, K]
    rows, tokens = [], []
    cur = ids
    for i in range(k):
        rows.append(world.row(lengths + i, cur))
        x = sample_from_weights(world.draft[rows[-1]], u[:, i])  # [B]
        tokens.append(x)
        cur = cur * v + x
    rows.append(world.row(lengths + k, cur))
    table = torch.stack(rows, 1)  # [B, K+1]
    claimed = None if world.claimed is None else world.claimed[table[:, :k]]
    drafts = torch.stack(tokens, 1) if k else torch.zeros(bsz, 0, dtype=torch.long)
    return Drafted(drafts, u, world.target[table], claimed, world.draft[table[:, :k]])


def law_residuals(law: AcceptanceLaw, k: int) -> torch.Tensor:  # [B, K+1, V] float64
    """The normalised law of the extra token for every n = 0 .. K."""
    bsz = law.accept_probs.shape[0]
    return torch.stack([normalise(law.residual(torch.full((bsz,), n, dtype=torch.long)).double())
                        for n in range(k + 1)], 1)


def emitted_tokens(drafts: torch.Tensor, n: torch.Tensor,
                   extra: torch.Tensor) -> torch.Tensor:  # [B, K+1] -1 padded
    """Accepted drafts (the first n), then the extra token, then -1."""
    bsz, k = drafts.shape
    dev = drafts.device
    tokens = torch.full((bsz, k + 1), -1, dtype=torch.long, device=dev)
    keep = torch.arange(k, device=dev)[None, :] < n[:, None]
    tokens[:, :k] = torch.where(keep, drafts, -1)
    tokens[torch.arange(bsz, device=dev), n] = extra
    return tokens


def draw_from_law(law: AcceptanceLaw, generator: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [B, K+1], n [B]
    """Draw n and the extra token from a (possibly wrong) law, as verify does from the real one."""
    bsz = law.accept_probs.shape[0]
    n = sample_from_weights(law.accept_probs, uniforms(generator, bsz, 1, DOMAIN_ACCEPT)[:, 0])
    extra = sample_from_weights(law.residual(n), uniforms(generator, bsz, 1, DOMAIN_RESAMPLE)[:, 0])
    return emitted_tokens(law.draft_tokens.long(), n, extra), n


@dataclass
class Speculative:
    """The library's verifier `method` with K draft tokens drawn from the world's draft.

    ragged=True: after a context of length l and id c the drafter proposes only
    K - (c + l) mod (K + 1) tokens (0 .. K, padded with -1; K at the start), like a
    prompt-lookup drafter that sometimes finds less to copy; the engine passes such rows to verify.
    """

    method: str  # "token" | "block" | "greedy"
    num_draft: int  # K
    ragged: bool = field(default=False, kw_only=True)  # fewer drafts after some contexts
    dtype: torch.dtype = field(default=torch.float64, kw_only=True)  # of p and q given to verify

    @property
    def name(self) -> str:
        return self.method

    def draft_counts(self, lengths: torch.Tensor | int, ids: torch.Tensor) -> torch.Tensor:
        """Number of real drafts after each context [B] (K unless ragged)."""
        if not self.ragged:
            return torch.full_like(ids, self.num_draft)
        return self.num_draft - (ids + lengths) % (self.num_draft + 1)

    def law(self, target: torch.Tensor, tokens: torch.Tensor,
            claimed: torch.Tensor | None) -> AcceptanceLaw:
        """The exact acceptance law; pitfalls wrap it."""
        target, claimed = self.cast(target, claimed)
        return acceptance_law(target, tokens, claimed, method=self.method)

    def cast(self, target: torch.Tensor, claimed: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """p and q in the dtype verify is given (the engine's models give float32)."""
        return target.to(self.dtype), None if claimed is None else claimed.to(self.dtype)

    def verdict(self, drafted: Drafted, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [B, K+1], n [B]
        """One batched draw: the real `verify`."""
        target, claimed = self.cast(drafted.target, drafted.claimed)
        out = verify(target, drafted.tokens, claimed, method=self.method, generator=generator)
        return out.tokens, out.num_accepted

    def step_law(self, world: World, length: int) -> StepLaw:
        """Exact law of one step after every context of `length` tokens (blocks of q = 0 skipped)."""
        k, v = self.num_draft, world.vocab
        blocks = draft_blocks(world, length, k)
        n_ctx, n_blocks = blocks.prob.shape
        counts = self.draft_counts(length, torch.arange(n_ctx))  # [C]
        beyond = torch.arange(k)[None, None, :] >= counts[:, None, None]  # [C, 1, K] padding
        # a short row is one block: its padding positions are enumerated as token 0 only
        canonical = ~(beyond & (blocks.tokens[None] != 0)).any(-1)  # [C, N]
        prob = (torch.where(beyond, 1.0, blocks.picked).prod(-1) * canonical).reshape(-1)
        live = (prob > 0).nonzero()[:, 0]  # blocks the drafter can produce
        tokens = torch.where(beyond, -1, blocks.tokens[None]).reshape(-1, k)[live]
        target = blocks.target.reshape(-1, k + 1, v)[live]
        claimed = None if blocks.claimed is None else blocks.claimed.reshape(-1, k, v)[live]
        law = self.law(target, tokens, claimed)
        joint = torch.zeros(n_ctx * n_blocks, k + 1, dtype=torch.float64)
        joint[live] = prob[live, None] * law.accept_probs
        extra = torch.zeros(n_ctx * n_blocks, k + 1, v, dtype=torch.float64)
        extra[live] = law_residuals(law, k)
        return StepLaw(blocks.tokens, joint.reshape(n_ctx, n_blocks, k + 1),
                       extra.reshape(n_ctx, n_blocks, k + 1, v))

    def draw(self, world: World, lengths: torch.Tensor, ids: torch.Tensor,
             generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft after each context and verify, batched: tokens [B, K+1] -1 padded, n [B]."""
        drafted = draft_batch(world, lengths, ids, self.num_draft, generator)
        if self.ragged:
            counts = self.draft_counts(lengths, ids)  # [B]
            short = torch.arange(self.num_draft)[None, :] >= counts[:, None]
            drafted = replace(drafted, tokens=drafted.tokens.masked_fill(short, -1))
        return self.verdict(drafted, generator)


def simulate(world: World, scheme: Speculative, length: int, rows: int,
             generator: torch.Generator) -> torch.Tensor:  # [rows, length] long
    """Generate `rows` independent sequences of `length` tokens with `scheme`, all batched.

    Each round, every unfinished row runs one speculative step (one batched verify call).
    """
    v = world.vocab
    out = torch.full((rows, length), -1, dtype=torch.long)
    lengths = torch.zeros(rows, dtype=torch.long)
    ids = torch.zeros(rows, dtype=torch.long)
    active = torch.arange(rows)
    while active.numel():
        tokens, n = scheme.draw(world, lengths[active], ids[active], generator)
        start, cur = lengths[active], ids[active]  # [A]
        for j in range(tokens.shape[1]):
            emit = j <= n  # the step emits n + 1 tokens
            write = (emit & (start + j < length)).nonzero()[:, 0]
            out[active[write], start[write] + j] = tokens[write, j]
            cur = torch.where(emit, cur * v + tokens[:, j].clamp(min=0), cur)
        lengths[active] = start + n + 1
        ids[active] = cur
        active = active[lengths[active] < length]
    return out


def sequence_ids(sequences: torch.Tensor, vocab: int) -> torch.Tensor:  # [B] long
    """Base-V id of each row of `sequences` [B, L], matching `output_law`'s indexing."""
    powers = vocab ** torch.arange(sequences.shape[1] - 1, -1, -1)
    return (sequences * powers).sum(-1)
