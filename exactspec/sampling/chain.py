"""The exact rules for a chain of drafts: token, block and greedy verification.

Glossary. p = target distribution, q = draft distribution, both standardized by
`probs_from_logits`. The K **draft tokens** x_1..x_K were drawn from q; the **accepted** tokens are
the draft prefix kept; then one more token is emitted: the **recovered token** (after a rejection,
from a residual distribution) or the **bonus token** (after all drafts were kept, from p).
So each row emits num_accepted + 1 tokens.

Every rule is split in two: a law function computes, exactly, the law of the number of accepted
tokens n and the (unnormalised) residual the extra token is drawn from given n (`AcceptanceLaw`);
`AcceptanceLaw.draw` draws from that law with float64 uniforms. The audit enumerates the law to
prove losslessness; the statistical tests check the draws. Which rule a method name means is
`exactspec.sampling.methods`; the lossy rules are in `exactspec.sampling.lossy`.

token (Leviathan et al. 2023, Chen et al. 2023): draft i is accepted with
    a_i = min(1, p_i(x_i) / q_i(x_i)), in order, stopping at the first rejection:
    P(n) = a_1 ... a_n (1 - a_{n+1}), P(K) = a_1 ... a_K.
    After a rejection at position n+1 the recovered token is drawn from
    norm(max(p_{n+1} - q_{n+1}, 0)); after K acceptances the bonus token from p_{K+1}.
block (Sun et al. 2024, arXiv 2403.10444, Algorithm 2): weights w_0 = 1,
    w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i));
    h_i = s_i / (s_i + 1 - w_i) with s_i = sum_x max(w_i p_{i+1}(x) - q_{i+1}(x), 0) for i < K
    (0/0 read as 0), h_K = w_K; n = the largest i with eta_i < h_i (0 if none), so
    P(n = i) = h_i prod_{j > i} (1 - h_j). The extra token comes from
    norm(max(w_n p_{n+1} - q_{n+1}, 0)) if n < K, else from p_{K+1}.
greedy: accept while x_i == argmax p_i (ties to the lowest id); emit argmax p_{n+1}.
A point-mass draft (draft_probs None) has q = one-hot at x.
`check=False` skips the O(B K V) validation of the probabilities (shapes and ids are always
checked); the engine uses it for distributions it made itself with probs_from_logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exactspec.sampling.checks import check_chain_inputs, draft_q_at
from exactspec.sampling.streams import (
    DOMAIN_ACCEPT,
    DOMAIN_RESAMPLE,
    Randomness,
    sample_from_weights,
    uniforms,
)


@dataclass
class Verdict:
    """What verification kept. Each row emits num_accepted + 1 tokens."""

    tokens: torch.Tensor  # [B, K+1] long: accepted drafts, then the recovered/bonus token, then -1
    num_accepted: torch.Tensor  # [B] long: how many draft tokens were kept

    @property
    def num_emitted(self) -> torch.Tensor:  # [B]
        return self.num_accepted + 1


@dataclass
class AcceptanceLaw:
    """The exact law of one verification step, given the drafts.

    accept_probs[b, n] = P(exactly n drafts accepted). Given n, the emitted token is drawn from
    `residual(n)` normalised; if that residual has no mass left (possible only through rounding,
    since a rejection needs some p(x) > q(x)), the target distribution p at that position is used,
    which is what exact arithmetic would give in the limit.
    """

    method: str  # the method's name: "token" | "block" | "greedy" | "lenient:0.5" ...
    accept_probs: torch.Tensor  # [B, K+1] float64, rows sum to 1
    target_probs: torch.Tensor  # [B, K+1, V]
    draft_tokens: torch.Tensor  # [B, K] long, -1 padded
    draft_probs: torch.Tensor | None  # [B, K, V] or None for a point-mass draft
    lengths: torch.Tensor  # [B] long: real draft tokens per row
    weights: torch.Tensor  # [B, K+1] float64: block verification's p_i (all ones otherwise)

    def residual(self, n: torch.Tensor) -> torch.Tensor:  # n [B] -> [B, V], unnormalised
        """Weights of the extra token after n accepted drafts (bonus when n == length).

        Computed in the dtype of the probabilities (float32 subtraction of two probabilities is
        exact to a relative 6e-8 of the result); the draw's cumulative sum is float64.
        """
        b = torch.arange(n.shape[0], device=n.device)
        out = self.target_probs[b, n]  # [B, V] a copy: advanced indexing
        rows = (n < self.lengths).nonzero().squeeze(-1)  # rows where a draft was rejected at n
        if rows.numel() == 0:
            return out
        n_r = n[rows]
        p_r = out[rows]  # [R, V]
        if self.draft_probs is None:  # point mass: q is one-hot at x, the residual is p without x
            res = p_r.clone()
            res[torch.arange(rows.numel(), device=n.device), self.draft_tokens[rows, n_r]] = 0.0
        else:  # norm(max(w * p - q, 0)); w == 1 for token-level verification
            w = self.weights[rows, n_r].to(p_r.dtype)[:, None]  # [R, 1]
            res = (w * p_r - self.draft_probs[rows, n_r]).clamp_(min=0.0)
        empty = res.sum(-1) <= 0
        out[rows] = torch.where(empty[:, None], p_r, res)
        return out

    def choose(self, generator: Randomness) -> tuple[torch.Tensor, torch.Tensor]:  # [B], [B]
        """n and the extra token: one float64 uniform picks n from its exact law (equivalent
        in distribution to the per-token coin flips), one more draws the extra token by
        inverse CDF."""
        bsz, dev = self.accept_probs.shape[0], self.accept_probs.device
        u = uniforms(generator, bsz, 2, DOMAIN_ACCEPT, dev)  # [B, 2]
        n = sample_from_weights(self.accept_probs, u[:, 0])
        v = uniforms(generator, bsz, 1, DOMAIN_RESAMPLE, dev)[:, 0]
        return n, sample_from_weights(self.residual(n), v)

    def draw(self, generator: Randomness = None) -> Verdict:
        """The drafts kept and the extra token, as a Verdict."""
        n, extra = self.choose(generator)
        x = self.draft_tokens
        bsz, k = x.shape
        dev = x.device
        tokens = torch.full((bsz, k + 1), -1, dtype=torch.long, device=dev)
        if k:
            keep = torch.arange(k, device=dev)[None, :] < n[:, None]
            tokens[:, :k] = torch.where(keep, x.long(), -1)
        tokens[torch.arange(bsz, device=dev), n] = extra
        return Verdict(tokens=tokens, num_accepted=n)


class GreedyLaw(AcceptanceLaw):
    """Greedy verification: n and the extra token are certain (no uniform is drawn)."""

    def residual(self, n: torch.Tensor) -> torch.Tensor:  # n [B] -> [B, V] one-hot at argmax
        b = torch.arange(n.shape[0], device=n.device)
        out = self.target_probs[b, n]  # [B, V] a copy
        top = out.argmax(-1)
        out.zero_()
        out[b, top] = 1.0
        return out

    def choose(self, generator: Randomness) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.accept_probs.argmax(-1)
        b = torch.arange(n.shape[0], device=n.device)
        return n, self.target_probs[b, n].argmax(-1)  # the hot index of residual(n)


def prepare_chain(p, x, q, check):
    """Validated inputs and the common tensors: lengths [B], valid [B, K], p(x) [B, K] f64."""
    lengths = check_chain_inputs(p, x, q, values=check)
    k = x.shape[1]
    valid = torch.arange(k, device=p.device)[None, :] < lengths[:, None]  # [B, K]
    xs = x.clamp(min=0)
    p_x = p[:, :k].gather(2, xs[..., None]).squeeze(-1).to(torch.float64)  # [B, K]
    return lengths, valid, xs, p_x


def ones(bsz: int, k: int, dev) -> torch.Tensor:  # [B, K+1] float64
    return torch.ones(bsz, k + 1, dtype=torch.float64, device=dev)


def stop_law(a: torch.Tensor) -> torch.Tensor:  # a [B, K] f64 -> [B, K+1] f64
    """P(n) for in-order acceptances a_i, stopping at the first rejection:
    P(n) = a_1 ... a_n (1 - a_{n+1})."""
    reach = torch.cat([torch.ones_like(a[:, :1]), a.cumprod(1)], 1)  # [B, K+1] P(n >= i)
    stop = torch.cat([1.0 - a, torch.ones_like(a[:, :1])], 1)  # P(stop at i | reached i)
    return reach * stop


def token_law(p: torch.Tensor, x: torch.Tensor, q: torch.Tensor | None, *,
              check: bool = True, name: str = "token") -> AcceptanceLaw:
    """Token-level verification (module docstring); p [B, K+1, V], x [B, K], q [B, K, V]."""
    return ratio_law(p, x, q, check=check, name=name)


def ratio_law(p: torch.Tensor, x: torch.Tensor, q: torch.Tensor | None, *, check: bool,
              name: str, scale: float = 1.0) -> AcceptanceLaw:
    """Drafts accepted in order with a_i = min(1, p_i(x_i) / (scale q_i(x_i))), stopping at
    the first rejection: token-level verification at scale 1 (lossless; 1.0 * q is q to the
    bit), the opt-in lossy lenient:L at scale L. p [B, K+1, V], x [B, K], q [B, K, V]."""
    lengths, valid, xs, p_x = prepare_chain(p, x, q, check)
    bsz, k = x.shape
    w = ones(bsz, k, p.device)
    if k == 0:
        return AcceptanceLaw(name, ones(bsz, 0, p.device), p, x, q, lengths, w)
    q_x = draft_q_at(p_x, q, xs, valid)
    a = torch.clamp(p_x / (scale * q_x), max=1.0)  # [B, K]
    a = torch.where(valid, a, torch.zeros_like(a))
    return AcceptanceLaw(name, stop_law(a), p, x, q, lengths, w)


def greedy_law(p: torch.Tensor, x: torch.Tensor, q: torch.Tensor | None, *,
               check: bool = True) -> AcceptanceLaw:
    """Greedy verification (module docstring); q is not consulted."""
    lengths, valid, xs, _ = prepare_chain(p, x, q, check)
    bsz, k = x.shape
    w = ones(bsz, k, p.device)
    if k == 0:
        return GreedyLaw("greedy", ones(bsz, 0, p.device), p, x, q, lengths, w)
    ok = (xs == p[:, :k].argmax(-1)) & valid  # [B, K]
    n = ok.long().cumprod(1).sum(1)
    probs = torch.nn.functional.one_hot(n, k + 1).to(torch.float64)
    return GreedyLaw("greedy", probs, p, x, q, lengths, w)


def block_law(p: torch.Tensor, x: torch.Tensor, q: torch.Tensor | None, *,
              check: bool = True, name: str = "block") -> AcceptanceLaw:
    """Block verification (module docstring); p [B, K+1, V], x [B, K], q [B, K, V] or None."""
    lengths, valid, xs, p_x = prepare_chain(p, x, q, check)
    bsz, k = x.shape
    dev = p.device
    weights = ones(bsz, k, dev)
    if k == 0:
        return AcceptanceLaw(name, ones(bsz, 0, dev), p, x, q, lengths, weights)
    q_x = draft_q_at(p_x, q, xs, valid)
    for i in range(1, k + 1):
        weights[:, i] = torch.clamp(weights[:, i - 1] * p_x[:, i - 1] / q_x[:, i - 1], max=1.0)
    h = torch.zeros(bsz, k + 1, dtype=torch.float64, device=dev)  # h[:, 0] unused
    for i in range(1, k):
        w_i = weights[:, i]
        if q is None:  # one-hot q at x_{i+1}: s_i = w_i (1 - p_{i+1}(x_{i+1})) since w_i p <= 1
            s = w_i * (1.0 - p_x[:, i])
        else:
            s = (w_i[:, None].to(p.dtype) * p[:, i] - q[:, i]).clamp_(min=0.0).sum(-1)
            s = s.to(torch.float64)
        den = s + (1.0 - w_i)
        h[:, i] = torch.where(den > 0, s / den.clamp(min=1e-300), torch.zeros_like(s))
    rows = torch.arange(bsz, device=dev)
    last = lengths.clamp(min=1)
    h[rows, last] = weights[rows, last]  # h at the row's last draft is w_len
    h = torch.where(torch.arange(k + 1, device=dev)[None, :] <= lengths[:, None], h,
                    torch.zeros_like(h))
    h[:, 0] = 1.0  # n = 0 if no later position is chosen
    # P(n = i) = h_i * prod_{j > i} (1 - h_j)
    tail = torch.flip(torch.cumprod(torch.flip(1.0 - h[:, 1:], [1]), 1), [1])  # prod_{j >= i}
    after = torch.cat([tail[:, 1:], torch.ones_like(tail[:, :1])], 1)  # prod_{j > i}, i = 1..K
    probs = torch.cat([tail[:, :1], h[:, 1:] * after], 1)  # [B, K+1]
    return AcceptanceLaw(name, probs, p, x, q, lengths, weights)
