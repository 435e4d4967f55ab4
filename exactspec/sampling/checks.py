"""Input checks shared by the verification rules: shapes, ids, and that probabilities are
probabilities. Every user mistake becomes an InvalidValue / InvalidType naming the fix."""

from __future__ import annotations

import torch

from exactspec.errors import InvalidType, InvalidValue


def tolerance(p: torch.Tensor) -> float:
    """How far from 1 a row of `p`'s dtype may sum (half precisions round more)."""
    return 1e-2 if p.dtype in (torch.float16, torch.bfloat16) else 1e-4


def check_distribution(t: torch.Tensor, used: torch.Tensor, name: str) -> None:
    """Finite, non-negative, and summing to 1 at the `used` positions (t [..., V], used [...]).

    One sum and one min over V: a NaN or inf anywhere in a row makes its sum non-finite.
    """
    sums = t.sum(-1)[used]  # [N]
    if sums.numel() == 0:
        return
    if not torch.isfinite(sums).all():
        raise InvalidValue(f"{name} contains NaN or inf")
    if (t.amin(-1)[used] < 0).any():
        raise InvalidValue(f"{name} contains negative probabilities")
    tol = tolerance(t)
    err = (sums.to(torch.float64) - 1.0).abs().max()
    if err > tol:
        raise InvalidValue(f"{name} rows must sum to 1 (off by {float(err):.3g}, tolerance "
                           f"{tol}); pass probabilities from probs_from_logits, not logits")


def check_chain_inputs(p: torch.Tensor, x: torch.Tensor, q: torch.Tensor | None,
                       *, values: bool = True) -> torch.Tensor:  # -> lengths [B]
    """A chain's p [B, K+1, V], drafts x [B, K] (-1 padded) and q [B, K, V] or None: shapes,
    ids and (when `values`) the probabilities of every used position."""
    if not isinstance(p, torch.Tensor) or not p.is_floating_point() or p.dim() != 3:
        raise InvalidType("target_probs must be a float tensor [B, K+1, V]")
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.dim() != 2:
        raise InvalidType("draft_tokens must be an integer tensor [B, K] (pad short rows with -1)")
    bsz, k1, vocab = p.shape
    if x.shape != (bsz, k1 - 1):
        raise InvalidValue(f"draft_tokens has shape {tuple(x.shape)}, expected {(bsz, k1 - 1)} "
                           f"for target_probs {tuple(p.shape)} (K+1 target positions for K drafts)")
    if q is not None and (not isinstance(q, torch.Tensor) or q.shape != (bsz, k1 - 1, vocab)):
        got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise InvalidValue(f"draft_probs has shape {got}, expected {(bsz, k1 - 1, vocab)}; "
                           "draft and target must share one vocabulary")
    valid = x >= 0
    lengths = valid.long().sum(1)
    pos = torch.arange(x.shape[1], device=x.device)[None, :]
    if (valid != (pos < lengths[:, None])).any():
        raise InvalidValue("draft_tokens may hold -1 only as padding at the end of a row")
    if (x < -1).any() or (x >= vocab).any():
        raise InvalidValue(f"draft token id out of range: ids must be in [0, {vocab}) "
                           "(-1 = padding)")
    if not values:
        return lengths
    # only the positions a row uses are checked: target 0..length, draft 0..length-1
    used_p = torch.arange(k1, device=p.device)[None, :] <= lengths[:, None]  # [B, K+1]
    check_distribution(p, used_p, "target_probs")
    if q is not None:
        check_distribution(q, valid, "draft_probs")
    return lengths


def draft_q_at(p_x: torch.Tensor, q: torch.Tensor | None, xs: torch.Tensor,
               valid: torch.Tensor) -> torch.Tensor:  # [B, K] float64
    """q(x_i) of each draft ([B, K] float64; ones for a point-mass draft); refuses a draft
    token that q gives no mass (it cannot have been drawn from q)."""
    if q is None:
        return torch.ones_like(p_x)
    q_x = q.gather(2, xs[..., None]).squeeze(-1).to(torch.float64)  # [B, K]
    if ((q_x <= 0) & valid).any():
        raise InvalidValue("a draft token has q(x) = 0 under draft_probs: it cannot have been "
                           "sampled from q; pass the exact distribution the draft used")
    return q_x
