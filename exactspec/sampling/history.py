"""Token histories for the penalties: what a distribution at a position has seen so far.

The repetition / presence / frequency penalties read the tokens before a position, so p and q at
draft position i are standardized with the row's context plus the drafts before i. These
helpers build those histories, batched; they are sampling (they decide the law), not drafting.
"""

from __future__ import annotations

import torch


def history(
    tokens: torch.Tensor,  # [B, T] long: each row's tokens, -1 padded at the end
    lengths: torch.Tensor,  # [B] long: real tokens per row
    extra: torch.Tensor | None = None,  # [B, J] long, -1 padded: tokens drawn after them
) -> torch.Tensor:  # [B, T'] long, -1 padded at the end
    """Each row's tokens followed by `extra`: the penalties' history when drawing after it."""
    if extra is None or extra.shape[1] == 0:
        return tokens
    b, j = extra.shape
    width = int(lengths.max()) + j
    out = torch.full((b, width), -1, dtype=torch.long, device=tokens.device)
    t = min(width, tokens.shape[1])
    out[:, :t] = tokens[:, :t]
    idx = lengths[:, None] + torch.arange(j, device=out.device)  # [B, J]
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
