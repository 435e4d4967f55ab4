"""A history whose shape does not match the logits is refused naming both shapes (issue 26: the
README's `[B, T]` history met a raw torch broadcast error)."""

from __future__ import annotations

import pytest
import torch

from exactspec.errors import InvalidValue
from exactspec.sampling import SamplingParams, probs_from_logits

PENALTY = SamplingParams(repetition_penalty=1.1)


def test_a_flat_history_for_per_position_logits_names_both_shapes():
    logits = torch.randn(2, 4, 10)  # [B, K+1, V]
    with pytest.raises(InvalidValue, match=r"prev_tokens has shape \[2, 6\], but logits of "
                       r"shape \[2, 4, 10\] need \[2, 4, T\]"):
        probs_from_logits(logits, PENALTY, prev_tokens=torch.zeros(2, 6, dtype=torch.long))


def test_the_shapes_the_error_suggests_are_accepted_and_agree():
    logits = torch.randn(2, 4, 10)
    history = torch.tensor([[1, 2, 3, -1], [4, 4, 5, 6]])  # [B, T]
    shared = probs_from_logits(logits, PENALTY, prev_tokens=history[:, None, :])  # [B, 1, T]
    full = probs_from_logits(logits, PENALTY, prev_tokens=history[:, None, :].expand(2, 4, 4))
    assert torch.equal(shared, full)
    assert not torch.equal(shared, probs_from_logits(logits, SamplingParams()))  # it penalised
