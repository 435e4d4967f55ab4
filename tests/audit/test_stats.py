"""The chi-square test itself, and statistical checks of the real `verify` draws.

Statistical tests here use fixed seeds and the false-alarm rate alpha = 1e-6 per test (the
threshold is chi2.isf(alpha, dof) on bins pooled to expect >= 5 counts), so a correct verifier
fails one of them with probability about 1e-6 per test. Their power against each pitfall is
shown in test_pitfalls.py.
"""

import pytest
import torch

from exactspec.audit import (
    ALPHA,
    Speculative,
    chi_square,
    folded_world,
    output_law,
    power,
    random_world,
    simulate,
    target_law,
)
from exactspec.audit.samplers import sequence_ids
from exactspec.audit.stats import bincount, pool_bins, samples_for_power
from exactspec.sampling import SamplingParams

V, K, L = 4, 2, 4  # vocabulary, drafts per step, generated tokens compared (256 outcomes)
SAMPLES = 60_000  # sequences per check: about 230 per outcome on average


def test_pooling_keeps_every_group_above_five():
    expected = torch.tensor([0.0, 0.5, 1.0, 2.0, 3.0, 50.0, 100.0, 0.2])
    group = pool_bins(expected)
    assert group[0] == -1  # zero probability: not a bin, an impossible outcome
    sizes = torch.zeros(int(group.max()) + 1).index_add_(0, group[1:], expected[1:])
    assert bool((sizes >= 5).all())
    assert group[5] != group[6]  # big bins stay alone


def test_impossible_outcome_rejects():
    probs = torch.tensor([0.5, 0.5, 0.0])
    result = chi_square(torch.tensor([500.0, 499.0, 1.0]), probs)
    assert result.rejected and result.impossible == 1 and result.p_value == 0.0


def test_single_possible_outcome():
    probs = torch.tensor([0.0, 1.0, 0.0])
    assert not chi_square(torch.tensor([0.0, 100.0, 0.0]), probs).rejected
    assert chi_square(torch.tensor([1.0, 99.0, 0.0]), probs).rejected


def test_bad_alpha():
    with pytest.raises(ValueError, match="alpha"):
        chi_square(torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.5]), alpha=0.0)


def test_false_alarm_rate_is_about_alpha():
    """Under the null, the test rejects about alpha of the time (here alpha = 0.05)."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(40, generator=gen, dtype=torch.float64) ** 2
    probs /= probs.sum()
    rejects = 0
    for _ in range(400):
        draws = torch.multinomial(probs, 2000, replacement=True, generator=gen)
        rejects += chi_square(bincount(draws, 40), probs, alpha=0.05).rejected
    assert 5 <= rejects <= 40  # Binomial(400, 0.05): mean 20, sd 4.4


def test_power_grows_with_samples():
    null = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    alt = torch.tensor([0.27, 0.23, 0.25, 0.25], dtype=torch.float64)
    assert power(null, alt, 1000) < 0.01 < 0.99 < power(null, alt, 200_000)
    n = samples_for_power(null, alt, target=0.99)
    assert power(null, alt, n) >= 0.99 > power(null, alt, int(n * 0.9))


def _check(world, method, *, seed, greedy=False, rows=SAMPLES):
    seqs = simulate(world, Speculative(method, K), L, rows, torch.Generator().manual_seed(seed))
    return chi_square(bincount(sequence_ids(seqs, V), V**L), target_law(world, L, greedy=greedy),
                      alpha=ALPHA)


WORLDS = {
    "random": lambda: random_world(V, L + K, 1),
    "zeros": lambda: random_world(V, L + K, 2, zeros=0.4),
    "point-mass": lambda: random_world(V, L + K, 3, draft="point_mass"),
    "folded": lambda: folded_world(V, L + K, SamplingParams(temperature=0.8, top_p=0.9,
                                                            repetition_penalty=1.2), 5),
}


@pytest.mark.parametrize("name", list(WORLDS))
@pytest.mark.parametrize("method", ["token", "block"])
def test_verify_draws_match_the_target(name, method):
    """Batched verify draws of whole generations pass the chi-square test at alpha = 1e-6."""
    result = _check(WORLDS[name](), method, seed=11)
    assert result.dof > 20  # a real test, not a degenerate one
    assert not result.rejected, result


def test_greedy_draws_are_argmax_decoding():
    result = _check(WORLDS["random"](), "greedy", seed=12, greedy=True, rows=5000)
    assert not result.rejected and result.impossible == 0


def test_simulation_matches_enumeration_of_a_wrong_sampler():
    """The simulator and the enumerator agree even when the sampler is not lossless."""
    from exactspec.audit.pitfalls import ResidualFromTarget, WrongResidual

    world = random_world(V, L + K, 1)
    scheme = WrongResidual("token", K, ResidualFromTarget, "resample from p")
    seqs = simulate(world, scheme, L, SAMPLES, torch.Generator().manual_seed(13))
    law = output_law(world, scheme, L)
    assert not chi_square(bincount(sequence_ids(seqs, V), V**L), law).rejected
