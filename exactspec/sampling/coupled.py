"""Coupled verification: the draft and the target draw from one uniform per output position.

Every output position i of a row has one float64 uniform u_i, a function of the row's seed and i
alone (`RowStreams.at_positions`). The target's own draw there is t_i = F_p_i^{-1}(u_i), the
inverse CDF of p_i in token-id order, exactly plain decoding's draw (`sample_from_weights`); a
sampled drafter draws x_i = F_q_i^{-1}(u_i) with the same uniform. Verification keeps x_i while
x_i == t_i and emits t at the first mismatch (or t after the last draft, the bonus token):

    tokens = t_0 .. t_n, n = the number of leading i with x_i == t_i.

The emitted tokens are t, whatever was drafted: plain decoding's sample itself, so the method
is exact by construction, and since p at a position is the same float32 number at every width
(batch invariance), the same seed gives the same text at every draft length, with or without
speculation. The drafts only decide how many t's one target forward confirms; a drafter that
draws otherwise (or a point mass) stays exact, it is only accepted less often.

The law (for `verify` / `acceptance_law` and the audit, which see the drafts but not u): with
I_r(t) = [F_r(t-1), F_r(t)) the interval of token t under r's normalised CDF, given x_i the
uniform u_i is uniform on I_q(x_i), so draft i is accepted with
    a_i = |I_p(x_i) ∩ I_q(x_i)| / |I_q(x_i)|   (point mass: I_q = [0, 1), a_i = p_i(x_i)),
P(n) = a_1 ... a_n (1 - a_{n+1}) as for token verification, and after a rejection at x the
extra token t has weight |I_p(t) ∩ I_q(x)| for t != x (0 at x); after K acceptances it is p.
"""

from __future__ import annotations

import torch

from exactspec.sampling.chain import AcceptanceLaw, Verdict, ones, prepare_chain, stop_law
from exactspec.sampling.checks import draft_q_at
from exactspec.sampling.streams import sample_from_weights


def coupled_verdict(
    p: torch.Tensor,  # [B, K+1, V] standardized target distributions
    x: torch.Tensor,  # [B, K] long draft tokens, -1 padded
    u: torch.Tensor | None,  # [B, K+1] float64: the uniforms of those output positions
) -> Verdict:
    """The target's draws t_i = F_p_i^{-1}(u_i), kept up to the first draft that differs.

    u None: every p is a one-hot (temperature 0), so t is its hot index whatever the uniform.
    """
    bsz, width, vocab = p.shape
    k = width - 1
    if x.shape != (bsz, k):
        raise ValueError(f"draft_tokens must be [{bsz}, {k}] for target_probs "
                         f"{tuple(p.shape)}, got {tuple(x.shape)}")
    if u is None:
        t = p.argmax(-1)  # [B, K+1]
    else:
        if u.shape != (bsz, width):
            raise ValueError(f"uniforms must be [{bsz}, {width}], got {tuple(u.shape)}")
        t = sample_from_weights(p.reshape(-1, vocab), u.reshape(-1)).view(bsz, width)
    same = x.to(t.device) == t[:, :k]  # [B, K]; a -1 pad never equals a token
    n = same.long().cumprod(1).sum(1)  # [B]
    keep = torch.arange(width, device=t.device)[None, :] <= n[:, None]
    return Verdict(tokens=torch.where(keep, t, -1), num_accepted=n)


def _intervals(r: torch.Tensor  # [..., V]
               ) -> tuple[torch.Tensor, torch.Tensor]:  # lo, hi [..., V] float64
    """Each token's interval [F(t-1), F(t)) under r's CDF in token-id order, normalised as
    `sample_from_weights` normalises (float64 cumulative sum over its total)."""
    cdf = r.to(torch.float64).cumsum(-1)
    cdf = cdf / cdf[..., -1:]
    return torch.cat([torch.zeros_like(cdf[..., :1]), cdf[..., :-1]], -1), cdf


class CoupledLaw(AcceptanceLaw):
    """The law of coupled verification given the drafts (module docstring)."""

    def residual(self, n: torch.Tensor) -> torch.Tensor:  # n [B] -> [B, V] float64
        """After a rejection at position n: the target's draw with u uniform on I_q(x) minus
        I_p(x), weight |I_p(t) ∩ I_q(x)| for t != x; the bonus token's p after all K."""
        b = torch.arange(n.shape[0], device=n.device)
        out = self.target_probs[b, n].to(torch.float64)  # [B, V]
        rows = (n < self.lengths).nonzero().squeeze(-1)
        if rows.numel() == 0:
            return out
        n_r = n[rows]
        xs = self.draft_tokens[rows, n_r]  # [R]
        lo_p, hi_p = _intervals(out[rows])  # [R, V]
        if self.draft_probs is None:
            lo_q, hi_q = torch.zeros_like(lo_p[:, :1]), torch.ones_like(lo_p[:, :1])
        else:
            lo, hi = _intervals(self.draft_probs[rows, n_r])
            lo_q, hi_q = lo.gather(1, xs[:, None]), hi.gather(1, xs[:, None])  # [R, 1]
        res = (torch.minimum(hi_p, hi_q) - torch.maximum(lo_p, lo_q)).clamp_(min=0.0)
        res[torch.arange(rows.numel(), device=n.device), xs] = 0.0
        empty = res.sum(-1) <= 0  # only through rounding: p, the limit of exact arithmetic
        out[rows] = torch.where(empty[:, None], out[rows], res)
        return out


def coupled_law(p: torch.Tensor, x: torch.Tensor, q: torch.Tensor | None, *,
                check: bool = True) -> CoupledLaw:
    """Coupled verification's law given the drafts (module docstring); p [B, K+1, V],
    x [B, K], q [B, K, V] or None (point mass)."""
    lengths, valid, xs, p_x = prepare_chain(p, x, q, check)
    bsz, k = x.shape
    w = ones(bsz, k, p.device)
    if k == 0:
        return CoupledLaw("coupled", ones(bsz, 0, p.device), p, x, q, lengths, w)
    lo_p, hi_p = (v.gather(2, xs[..., None]).squeeze(-1) for v in _intervals(p[:, :k]))
    if q is None:
        lo_q, hi_q = torch.zeros_like(lo_p), torch.ones_like(hi_p)
    else:
        draft_q_at(p_x, q, xs, valid)  # refuses a draft token q gives no mass
        lo_q, hi_q = (v.gather(2, xs[..., None]).squeeze(-1) for v in _intervals(q))
    width = hi_q - lo_q  # [B, K] q(x), normalised
    both = (torch.minimum(hi_p, hi_q) - torch.maximum(lo_p, lo_q)).clamp(min=0.0)
    a = torch.where(valid & (width > 0), both / width.clamp(min=1e-300), torch.zeros_like(both))
    return CoupledLaw("coupled", stop_law(a.clamp(max=1.0)), p, x, q, lengths, w)
