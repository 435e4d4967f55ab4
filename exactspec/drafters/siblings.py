"""How a tree node's children are drawn from its q: i.i.d., without replacement, or the top-k
(deterministic point masses). Shared by the fixed trees (tree_draft.py) and the dynamic ones
(dynamic_tree.py)."""

from __future__ import annotations

import torch

from exactspec.sampling import sample_from_weights


def choose_children(q: torch.Tensor, logits: torch.Tensor, count: int, kind: str,
                    u: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:  # [B, count], -1
    """`count` children per row from q [B, V] (logits [B, V] rank the top-k of greedy rows).

    iid: inverse CDF of q with each column of u [B, count]; without_replacement: the same from
    q without the children drawn before (a row out of mass leaves the rest -1); deterministic:
    the top-k of q's support (greedy rows [B] bool: q's argmax, then the logits' order).
    """
    bsz, vocab = q.shape
    if kind == "deterministic":
        key = torch.where(q > 0, q.double(), -torch.inf)
        key = torch.where(greedy[:, None], torch.where(q > 0, torch.inf, logits.double()), key)
        top = key.topk(min(count, vocab), dim=-1)
        out = torch.where(top.values > -torch.inf, top.indices, -1)
        return torch.cat([out, out.new_full((bsz, count - out.shape[1]), -1)], 1)
    out = torch.full((bsz, count), -1, dtype=torch.long, device=q.device)
    left = q.clone()
    for j in range(count):
        live = left.sum(-1) > 0
        x = sample_from_weights(left, u[:, j])
        out[:, j] = torch.where(live, x, -1)
        if kind == "without_replacement":
            left.scatter_(1, x[:, None], 0.0)
    return out
