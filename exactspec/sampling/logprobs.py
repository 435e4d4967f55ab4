"""The log-probability of a drawn token: one function for the engine's `Generation.logprobs`
and the trainer's `es.token_logprobs`, so both take the same log of the same float.

Two laws can be reported (`LOGPROBS_MODES`): "processed", the standardized distribution the
token was drawn from (after penalties, temperature, top-k/p, min-p: what an RL trainer needs;
0.0 for every token when greedy), and "raw", the model's own distribution, log_softmax of the
raw logits before any sampling transform (what OpenAI's API and vLLM's default report)."""

from __future__ import annotations

import torch


def token_log_probs(p: torch.Tensor,  # [..., V] standardized distributions (float32)
                    tokens: torch.Tensor) -> torch.Tensor:  # [...] long, -1 = padding
    """log p(token) at every position, in p's dtype (-1 padding reads token 0; callers drop
    those entries). Differentiable in p."""
    return p.gather(-1, tokens.clamp(min=0)[..., None]).squeeze(-1).log()


LOGPROBS_MODES = ("processed", "raw")


def raw_log_probs(logits: torch.Tensor  # [..., V] the target's raw logits
                  ) -> torch.Tensor:  # [..., V] float32
    """log_softmax of the raw logits in float32: the model's own distribution, before any
    sampling transform ("raw" logprobs; finite wherever the logits are)."""
    return torch.log_softmax(logits.float(), dim=-1)
