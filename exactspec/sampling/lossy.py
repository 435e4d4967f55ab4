"""Lossy verification rules, opt-in: more accepted drafts, at a measured price in exactness.

They are chosen with `verify="lenient:L"` or `verify="typical:EPS"` and are never a default.
Each computes an `AcceptanceLaw` like the lossless rules, so the audit enumerates them exactly
(`exactspec.audit.lossy` measures their drift); `verify` draws from it in the same way.
Their method objects (`Lenient`, `Typical`) are in `exactspec.sampling.methods`.

lenient:L (Leviathan et al. 2023, appendix A.5), L in (0, 1]:
    draft i is accepted with a_i = min(1, p_i(x_i) / (L q_i(x_i))), in order; after a
    rejection the recovered token is drawn from norm(max(p - q, 0)) (the residual of the exact
    rule, which is also the one of least TV given these acceptances); the bonus token from p.
    One step emits min(q, p / L) + (1 - sum min(q, p / L)) norm(max(p - q, 0)): exact at L = 1.
    A point-mass draft (q one-hot at x) is accepted with min(1, p(x) / L).
typical:EPS (Medusa, Cai et al. 2024, "typical acceptance"), EPS in (0, 1):
    draft i is accepted iff p_i(x_i) >= min(EPS, sqrt(EPS) exp(-H(p_i))), H the entropy of
    p_i in nats (a deterministic test: q is not consulted); after the first rejection the next
    token is drawn from p_i itself, the bonus token from p. Exact only when p is one-hot
    (greedy decoding), where it accepts exactly the argmax.
"""

from __future__ import annotations

import math

import torch

from exactspec.sampling.chain import AcceptanceLaw, ones, prepare_chain, ratio_law, stop_law


class TypicalLaw(AcceptanceLaw):
    """Typical acceptance: after the first rejection (or all K accepted) the token is from p."""

    def residual(self, n: torch.Tensor) -> torch.Tensor:  # n [B] -> [B, V]
        b = torch.arange(n.shape[0], device=n.device)
        return self.target_probs[b, n]


def lenient_law(lenience: float, name: str, p: torch.Tensor, x: torch.Tensor,
                q: torch.Tensor | None, *, check: bool = True) -> AcceptanceLaw:
    """The exact law of one step of lenient:L (module docstring); p [B, K+1, V], x [B, K]."""
    return ratio_law(p, x, q, check=check, name=name, scale=lenience)


def typical_law(eps: float, name: str, p: torch.Tensor, x: torch.Tensor,
                q: torch.Tensor | None, *, check: bool = True) -> AcceptanceLaw:
    """The exact law of one step of typical:EPS (module docstring); q is not consulted."""
    lengths, valid, _, p_x = prepare_chain(p, x, q, check)
    bsz, k = x.shape
    w = ones(bsz, k, p.device)
    if k == 0:
        return TypicalLaw(name, ones(bsz, 0, p.device), p, x, q, lengths, w)
    pk = p[:, :k].to(torch.float64)  # [B, K, V]
    entropy = -(pk * pk.clamp(min=1e-300).log()).sum(-1)  # [B, K] nats
    threshold = torch.clamp(math.sqrt(eps) * torch.exp(-entropy), max=eps)  # [B, K]
    a = (p_x >= threshold).to(torch.float64)
    a = torch.where(valid, a, torch.zeros_like(a))
    return TypicalLaw(name, stop_law(a), p, x, q, lengths, w)
