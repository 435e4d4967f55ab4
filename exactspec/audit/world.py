"""Small "worlds" to audit on: context-dependent target and draft distributions, tabulated.

A world gives, for every context (the tokens generated so far) up to some length, the target
distribution p and the draft distribution q over a tiny vocabulary. Tables are flat tensors: row
`offset(l) + id` holds the context of length l whose tokens, read as a base-V number, give `id`.
Both the exact enumeration (`exact.py`) and the batched simulation (`samplers.py`) read them.

Three draft tables are kept apart on purpose: `draft` is what the draft tokens are really drawn
from; `claimed` is what is handed to `verify` as q. In a correct world they are the same tensor;
the "q is not what the draft was sampled from" pitfalls make them differ. A point-mass world has
a one-hot `draft` and `claimed = None` (verify gets `draft_probs=None`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from exactspec.sampling import SamplingParams, probs_from_logits


def offset(vocab: int, length: int) -> int:
    """Row of the first context of `length` tokens: sum of vocab**l for l < length."""
    return (vocab**length - 1) // (vocab - 1)


@dataclass(frozen=True)
class World:
    """Target and draft distributions after every context of length 0 .. depth-1."""

    name: str  # short label for reports
    vocab: int  # V, at least 2
    depth: int  # contexts of length 0 .. depth-1 are tabulated
    target: torch.Tensor  # [S, V] float64: p after each context, S = offset(V, depth)
    draft: torch.Tensor  # [S, V] float64: the distribution draft tokens are drawn from
    claimed: torch.Tensor | None  # [S, V] float64: the q passed to verify; None = point mass

    def __post_init__(self) -> None:
        rows = offset(self.vocab, self.depth)
        assert self.target.shape == (rows, self.vocab), self.target.shape
        assert self.draft.shape == (rows, self.vocab), self.draft.shape
        assert self.claimed is None or self.claimed.shape == (rows, self.vocab)

    @property
    def point_mass(self) -> bool:
        """True when drafts are deterministic proposals (verify gets draft_probs=None)."""
        return self.claimed is None

    def row(self, length: torch.Tensor | int, ids: torch.Tensor) -> torch.Tensor:  # [...] long
        """Table rows of contexts given by their length and base-V id."""
        if isinstance(length, int):
            return ids + offset(self.vocab, length)
        assert int(length.max()) < self.depth, "context longer than the world's tables"
        v = self.vocab
        return ids + (v ** length - 1) // (v - 1)

    def level(self, table: torch.Tensor, length: int) -> torch.Tensor:  # [V**length, V]
        """The rows of `table` for every context of exactly `length` tokens."""
        start = offset(self.vocab, length)
        return table[start:start + self.vocab**length]

    def with_claimed(self, claimed: torch.Tensor, name: str) -> World:
        """The same world, but verify is told q = `claimed` (a pitfall when it differs)."""
        return World(name, self.vocab, self.depth, self.target, self.draft, claimed)


def _contexts(vocab: int, length: int) -> torch.Tensor:  # [V**length, length] long
    """Every context of `length` tokens, row i being the base-V digits of i."""
    ids = torch.arange(vocab**length)
    powers = vocab ** torch.arange(length - 1, -1, -1)
    return (ids[:, None] // powers[None, :]) % vocab


def _random_dist(rows: int, vocab: int, gen: torch.Generator, zeros: float) -> torch.Tensor:
    """Peaked random distributions [rows, V]; each entry is 0 with probability `zeros`."""
    d = torch.rand(rows, vocab, generator=gen, dtype=torch.float64) ** 3 + 1e-3
    if zeros > 0:
        drop = torch.rand(rows, vocab, generator=gen) < zeros
        keep = torch.randint(vocab, (rows,), generator=gen)  # never drop every token
        drop[torch.arange(rows), keep] = False
        d = d.masked_fill(drop, 0.0)
    return d / d.sum(-1, keepdim=True)


def _one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:  # [rows, V] float64
    return torch.nn.functional.one_hot(tokens, vocab).to(torch.float64)


def random_world(vocab: int, depth: int, seed: int, *, zeros: float = 0.0,
                 draft: str = "sampled", name: str | None = None) -> World:
    """Independent random p and q after every context.

    draft: "sampled" (q is a distribution the drafts are drawn from), "point_mass" (a fixed
    proposal per context, like an n-gram drafter) or "disjoint" (p and q live on disjoint
    supports, so every draft is rejected).
    """
    gen = torch.Generator().manual_seed(seed)
    rows = offset(vocab, depth)
    p = _random_dist(rows, vocab, gen, zeros)
    if draft == "sampled":
        q = _random_dist(rows, vocab, gen, zeros)
        return World(name or "random p/q", vocab, depth, p, q, q)
    if draft == "point_mass":  # often p's mode, sometimes not (like an n-gram guess)
        noisy = p + 0.5 * torch.rand(rows, vocab, generator=gen, dtype=torch.float64)
        q = _one_hot(noisy.argmax(-1), vocab)
        return World(name or "point-mass drafts", vocab, depth, p, q, None)
    if draft == "disjoint":
        order = torch.rand(rows, vocab, generator=gen).argsort(-1)  # random split per context
        cut = torch.randint(1, vocab, (rows, 1), generator=gen)
        in_p = torch.zeros(rows, vocab, dtype=torch.bool).scatter_(
            1, order, torch.arange(vocab)[None, :].expand(rows, -1) < cut)
        raw = torch.rand(rows, vocab, generator=gen, dtype=torch.float64) + 0.1
        p = raw.masked_fill(~in_p, 0.0)
        q = raw.masked_fill(in_p, 0.0)
        p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
        return World(name or "disjoint supports", vocab, depth, p, q, q)
    raise ValueError(f"unknown draft kind {draft!r}; use sampled, point_mass or disjoint")


def positional_world(target: torch.Tensor, draft: torch.Tensor | None,
                     name: str = "per-position p/q") -> World:
    """A world whose p and q depend only on the position, not on the tokens before it.

    target [D, V] and draft [D, V] (or None with one-hot rows for a point-mass drafter) give
    the distributions at positions 0 .. D-1: the "given per-position p and q" case.
    """
    depth, vocab = target.shape
    reps = torch.tensor([vocab**length for length in range(depth)])
    p = target.to(torch.float64).repeat_interleave(reps, 0)  # [S, V]
    if draft is None:
        q = _one_hot(p.argmax(-1), vocab)
        return World(name, vocab, depth, p, q, None)
    q = draft.to(torch.float64).repeat_interleave(reps, 0)
    return World(name, vocab, depth, p, q, q)


def random_logits(vocab: int, depth: int, seed: int,
                  agreement: float = 0.7) -> tuple[torch.Tensor, torch.Tensor]:
    """Random target and draft logits [S, V] per context; the draft's partly copy the target's."""
    gen = torch.Generator().manual_seed(seed)
    rows = offset(vocab, depth)
    target = 2.0 * torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    noise = 2.0 * torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    return target, agreement * target + (1 - agreement) * noise


def standardize(logits: torch.Tensor, vocab: int, depth: int, params: SamplingParams,
                prompt: tuple[int, ...] = ()) -> torch.Tensor:  # [S, V] float64
    """probs_from_logits after every context, with the prompt + context as the token history."""
    out = []
    for length in range(depth):
        ctx = _contexts(vocab, length)  # [N, length]
        prev = torch.cat([torch.tensor(prompt, dtype=torch.long).expand(len(ctx), -1), ctx], 1)
        rows = logits[offset(vocab, length):offset(vocab, length + 1)]
        out.append(probs_from_logits(rows, params, prev_tokens=prev, prompt_len=len(prompt)))
    return torch.cat(out).to(torch.float64)


def folded_world(vocab: int, depth: int, params: SamplingParams, seed: int, *,
                 prompt: tuple[int, ...] = (1, 0, 1), name: str | None = None) -> World:
    """p and q from random logits, both standardized by probs_from_logits with `params`.

    Penalties see the prompt and the context, so p and q really depend on the history.
    """
    target_logits, draft_logits = random_logits(vocab, depth, seed)
    p = standardize(target_logits, vocab, depth, params, prompt)
    q = standardize(draft_logits, vocab, depth, params, prompt)
    return World(name or "folded params", vocab, depth, p, q, q)


def logits_table(forward: Callable[[torch.Tensor], torch.Tensor], prompt: Sequence[int],
                 vocab: int, depth: int, chunk: int = 4096) -> torch.Tensor:  # [S, V] float64
    """A model's next-token logits after prompt + every context of length < depth.

    forward(ids [N, T] long) -> logits [N, T, V], e.g. `lambda ids: model(ids).logits` for a
    transformers causal LM. One pass over every context of length depth - 1 gives all shorter
    contexts too (their rows are prefixes of those sequences).
    """
    longest = _contexts(vocab, depth - 1)  # [V**(depth-1), depth-1]
    ids = torch.cat([torch.tensor(list(prompt), dtype=torch.long).expand(len(longest), -1),
                     longest], 1)
    with torch.no_grad():
        logits = torch.cat([forward(ids[i:i + chunk]).to(torch.float64)
                            for i in range(0, len(ids), chunk)])  # [N, T, V]
    out = []
    for length in range(depth):
        rows = torch.arange(vocab**length) * vocab ** (depth - 1 - length)  # c followed by 0s
        out.append(logits[rows, len(prompt) - 1 + length])
    return torch.cat(out)


def model_world(target_logits: torch.Tensor, draft_logits: torch.Tensor, vocab: int, depth: int,
                params: SamplingParams, prompt: Sequence[int], name: str = "models") -> World:
    """p and q standardized from two models' logits tables (see `logits_table`)."""
    p = standardize(target_logits, vocab, depth, params, tuple(prompt))
    q = standardize(draft_logits, vocab, depth, params, tuple(prompt))
    return World(name, vocab, depth, p, q, q)


def target_law(world: World, length: int, *, greedy: bool = False) -> torch.Tensor:
    """Exact law [V**length] float64 of the first `length` tokens sampled from the target alone.

    greedy=True gives the one-hot law of argmax decoding (ties to the lowest id).
    """
    assert length < world.depth + 1
    v = world.vocab
    law = torch.ones(1, dtype=torch.float64)
    for pos in range(length):
        p = world.level(world.target, pos)  # [V**pos, V]
        if greedy:
            p = _one_hot(p.argmax(-1), v)
        law = (law[:, None] * p).reshape(-1)
    return law
