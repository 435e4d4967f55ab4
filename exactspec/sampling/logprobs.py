"""The log-probability of a drawn token: one function for the engine's `Generation.logprobs`
and the trainer's `es.token_logprobs`, so both take the same log of the same float."""

from __future__ import annotations

import torch


def token_log_probs(p: torch.Tensor,  # [..., V] standardized distributions (float32)
                    tokens: torch.Tensor) -> torch.Tensor:  # [...] long, -1 = padding
    """log p(token) at every position, in p's dtype (-1 padding reads token 0; callers drop
    those entries). Differentiable in p."""
    return p.gather(-1, tokens.clamp(min=0)[..., None]).squeeze(-1).log()
