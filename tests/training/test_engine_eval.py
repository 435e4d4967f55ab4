"""engine_eval's figures are the engine's own statistics, summed consistently."""

from __future__ import annotations

import itertools

import pytest

from exactspec.drafters.eagle import EagleDrafter
from exactspec.engine.api import generate
from exactspec.sampling import SamplingParams
from exactspec.training.engine_eval import acceptance, speed
from tests.drafters.test_eagle import make_head
from tests.engine.tiny import tiny_llama

PROMPTS = [[3, 7, 9, 11], [5, 6, 2, 30, 8], [4, 4, 12]]


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_acceptance_sums_the_engines_stats(temperature):
    target = tiny_llama(3)
    drafter = EagleDrafter(make_head(target), target)
    got = acceptance(target, drafter, PROMPTS, temperature=temperature, k=3, max_new_tokens=12)
    gens = generate(target, PROMPTS, drafter=drafter, max_new_tokens=12, num_draft_tokens=3,
                    params=SamplingParams(temperature=temperature, seed=1))
    steps = sum(g.stats.steps for g in gens)
    emitted = sum(g.stats.emitted for g in gens)
    assert (got["rows"], got["steps"], got["emitted"]) == (3, steps, emitted)
    assert got["mean_acceptance_length"] == round(emitted / steps, 3)
    assert 1.0 <= got["mean_acceptance_length"] <= 4.0
    first = got["accept_first_k"]
    assert len(first) == 3 and all(0.0 <= a <= 1.0 for a in first)
    assert all(a >= b for a, b in itertools.pairwise(first))  # a chain: k kept => k-1 kept


def test_speed_reports_each_engine_against_plain():
    target = tiny_llama(3)
    drafter = EagleDrafter(make_head(target), target)
    got = speed(target, drafter, PROMPTS[:2], temperature=1.0, k=2, max_new_tokens=6)
    assert set(got["tok_s"]) == {"plain", "K=2", "auto"}
    assert all(v > 0 for v in got["tok_s"].values())
    for name in ("K=2", "auto"):
        assert got["speedup"][name] == pytest.approx(got["tok_s"][name] / got["tok_s"]["plain"],
                                                     rel=1e-2)
