"""Verification: which draft tokens to keep, and which token to emit after them.

Glossary. p = target distribution, q = draft distribution, both standardized by
`probs_from_logits`. The K **draft tokens** x_1..x_K were drawn from q; the **accepted** tokens are
the draft prefix kept; then one more token is emitted: the **recovered token** (after a rejection,
from a residual distribution) or the **bonus token** (after all drafts were kept, from p).
So each row emits num_accepted + 1 tokens.

Every method is split in two: `acceptance_law` computes, exactly, the law of the number of
accepted tokens n and the (unnormalised) residual the extra token is drawn from given n; `verify`
draws from that law with float64 uniforms. The audit enumerates the law to prove losslessness;
the statistical tests check the draws. The rules live only here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exactspec.sampling.streams import (
    DOMAIN_ACCEPT,
    DOMAIN_RESAMPLE,
    Randomness,
    sample_from_weights,
    uniforms,
)

METHODS = ("token", "block", "greedy")


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

    method: str  # "token" | "block" | "greedy"
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
        if self.method == "greedy":
            top = out.argmax(-1)
            out.zero_()
            out[b, top] = 1.0
            return out
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


def acceptance_law(
    target_probs: torch.Tensor,  # [B, K+1, V]
    draft_tokens: torch.Tensor,  # [B, K] long, -1 padded at the end of a row
    draft_probs: torch.Tensor | None = None,  # [B, K, V] or None (point-mass draft)
    *,
    method: str = "token",
    check: bool = True,
) -> AcceptanceLaw:
    """Validate the inputs and compute the exact law of n (number accepted) for `method`.

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
    if method not in METHODS:  # an opt-in lossy rule ("lenient:L", ...) or a mistake
        from exactspec.sampling.lossy import lossy_law, parse_lossy

        return lossy_law(parse_lossy(method), target_probs, draft_tokens, draft_probs, check=check)
    p, x, q = target_probs, draft_tokens, draft_probs
    lengths = _check_inputs(p, x, q, values=check)
    bsz, k = x.shape
    dev = p.device
    weights = torch.ones(bsz, k + 1, dtype=torch.float64, device=dev)
    if k == 0:
        return AcceptanceLaw(method, torch.ones(bsz, 1, dtype=torch.float64, device=dev),
                             p, x, q, lengths, weights)
    pos = torch.arange(k, device=dev)[None, :]  # [1, K]
    valid = pos < lengths[:, None]  # [B, K]
    xs = x.clamp(min=0)
    p_x = p[:, :k].gather(2, xs[..., None]).squeeze(-1).to(torch.float64)  # [B, K]
    q_x = (torch.ones_like(p_x) if q is None
           else q.gather(2, xs[..., None]).squeeze(-1).to(torch.float64))  # [B, K]

    if q is not None and method != "greedy" and ((q_x <= 0) & valid).any():
        raise ValueError("a draft token has q(x) = 0 under draft_probs: it cannot have been "
                         "sampled from q; pass the exact distribution the draft used")

    if method == "greedy":
        ok = (xs == p[:, :k].argmax(-1)) & valid  # [B, K]
        n = ok.long().cumprod(1).sum(1)
        probs = torch.nn.functional.one_hot(n, k + 1).to(torch.float64)
        return AcceptanceLaw(method, probs, p, x, q, lengths, weights)

    if method == "token":
        a = torch.where(valid, torch.clamp(p_x / q_x, max=1.0), torch.zeros_like(p_x))  # [B, K]
        reach = torch.cat([torch.ones_like(a[:, :1]), a.cumprod(1)], 1)  # [B, K+1] P(n >= i)
        stop = torch.cat([1.0 - a, torch.ones_like(a[:, :1])], 1)  # P(stop at i | reached i)
        return AcceptanceLaw(method, reach * stop, p, x, q, lengths, weights)

    # block verification
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
    return AcceptanceLaw(method, probs, p, x, q, lengths, weights)


def verify(
    target_probs: torch.Tensor,  # [B, K+1, V]
    draft_tokens: torch.Tensor,  # [B, K] long, -1 padded
    draft_probs: torch.Tensor | None = None,  # [B, K, V] or None (point-mass draft)
    *,
    method: str = "token",
    generator: Randomness = None,
    check: bool = True,
) -> Verdict:
    """Keep a prefix of the drafts and emit one more token; lossless for "token" and "block".

    See `acceptance_law` for the formulas. Randomness: one float64 uniform per row picks n from
    its exact law (equivalent in distribution to the per-token coin flips), one more draws the
    extra token by inverse CDF. `generator` is a torch.Generator, one per row, or RowStreams.
    """
    law = acceptance_law(target_probs, draft_tokens, draft_probs, method=method, check=check)
    bsz, k = draft_tokens.shape
    dev = target_probs.device
    if method == "greedy":
        n = law.accept_probs.argmax(-1)
        extra = law.residual(n).argmax(-1)
    else:
        u = uniforms(generator, bsz, 2, DOMAIN_ACCEPT, dev)  # [B, 2]
        n = sample_from_weights(law.accept_probs, u[:, 0])
        v = uniforms(generator, bsz, 1, DOMAIN_RESAMPLE, dev)[:, 0]
        extra = sample_from_weights(law.residual(n), v)
    tokens = torch.full((bsz, k + 1), -1, dtype=torch.long, device=dev)
    if k:
        keep = torch.arange(k, device=dev)[None, :] < n[:, None]
        tokens[:, :k] = torch.where(keep, draft_tokens.long(), -1)
    tokens[torch.arange(bsz, device=dev), n] = extra
    return Verdict(tokens=tokens, num_accepted=n)


def _check_inputs(p: torch.Tensor, x: torch.Tensor, q: torch.Tensor | None,
                  *, values: bool = True) -> torch.Tensor:  # -> lengths [B]
    """Shapes, ids and probabilities; every user mistake becomes a ValueError/TypeError."""
    if not isinstance(p, torch.Tensor) or not p.is_floating_point() or p.dim() != 3:
        raise TypeError("target_probs must be a float tensor [B, K+1, V]")
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.dim() != 2:
        raise TypeError("draft_tokens must be an integer tensor [B, K] (pad short rows with -1)")
    bsz, k1, vocab = p.shape
    if x.shape != (bsz, k1 - 1):
        raise ValueError(f"draft_tokens has shape {tuple(x.shape)}, expected {(bsz, k1 - 1)} "
                         f"for target_probs {tuple(p.shape)} (K+1 target positions for K drafts)")
    if q is not None and (not isinstance(q, torch.Tensor) or q.shape != (bsz, k1 - 1, vocab)):
        got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"draft_probs has shape {got}, expected {(bsz, k1 - 1, vocab)}; "
                         "draft and target must share one vocabulary")
    valid = x >= 0
    lengths = valid.long().sum(1)
    pos = torch.arange(x.shape[1], device=x.device)[None, :]
    if (valid != (pos < lengths[:, None])).any():
        raise ValueError("draft_tokens may hold -1 only as padding at the end of a row")
    if (x < -1).any() or (x >= vocab).any():
        raise ValueError(f"draft token id out of range: ids must be in [0, {vocab}) (-1 = padding)")
    if not values:
        return lengths
    tol = 1e-2 if p.dtype in (torch.float16, torch.bfloat16) else 1e-4
    # only the positions a row uses are checked: target 0..length, draft 0..length-1
    used_p = torch.arange(k1, device=p.device)[None, :] <= lengths[:, None]  # [B, K+1]
    _check_distribution(p, used_p, "target_probs", tol)
    if q is not None:
        _check_distribution(q, valid, "draft_probs", tol)
    return lengths


def _check_distribution(t: torch.Tensor, used: torch.Tensor, name: str, tol: float) -> None:
    """Non-negative, finite, and summing to 1 at the used positions.

    One sum and one min over V: a NaN or inf anywhere in a row makes its sum non-finite.
    """
    sums = t.sum(-1)[used]  # [N]
    if sums.numel() == 0:
        return
    if not torch.isfinite(sums).all():
        raise ValueError(f"{name} contains NaN or inf")
    if (t.amin(-1)[used] < 0).any():
        raise ValueError(f"{name} contains negative probabilities")
    err = (sums.to(torch.float64) - 1.0).abs().max()
    if err > tol:
        raise ValueError(f"{name} rows must sum to 1 (off by {float(err):.3g}, tolerance {tol}); "
                         "pass probabilities from probs_from_logits, not logits")
