"""The reference loop with a random EAGLE head: greedy speculative == greedy plain, bit for bit."""

from __future__ import annotations

import torch

from exactspec.drafters.eagle import EagleDrafter
from exactspec.sampling import SamplingParams
from exactspec.training.simulate import SimStats, simulate
from tests.drafters.test_eagle import make_head
from tests.engine.tiny import tiny_llama


def test_greedy_speculative_equals_plain_greedy():
    target = tiny_llama(3)
    prompt = [3, 7, 9, 11, 4]
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(20):
            tokens.append(int(target(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    stats = SimStats()
    got = simulate(target, EagleDrafter(make_head(target), target), prompt,
                   SamplingParams(temperature=0.0), max_new_tokens=20, k=4, seed=0, eos=[],
                   stats=stats, method="token")
    assert got[:20] == tokens[len(prompt):]
    assert stats.steps >= 1 and stats.emitted + 1 >= 20  # the first token is drawn before
