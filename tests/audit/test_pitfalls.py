"""Every pitfall of the seeds is caught: exact TV > 0 and the chi-square test fails (power).

The sample size is justified, not tuned: for each pitfall the exact law of its output is known,
so the power of the alpha = 1e-6 chi-square test at SAMPLES draws is computed (noncentral
chi-square) and must be at least 1 - 1e-6 before the draws are made; then the test must reject.
"""

import pytest
import torch

from exactspec.audit import (
    output_law,
    pitfalls,
    positional_world,
    simulate,
    target_law,
    tv_distance,
)
from exactspec.audit.pitfalls import (
    AbsoluteResidual,
    ResidualFromTarget,
    SharedUniforms,
    WrongResidual,
)
from exactspec.audit.samplers import Speculative, sequence_ids
from exactspec.audit.stats import bincount, chi_square, power
from exactspec.audit.world import World

V, K, L = 4, 2, 4
SAMPLES = 20_000  # enough: every pitfall's power here is > 1 - 1e-6 (asserted below)
PITFALLS = {p.name: p for p in pitfalls(V, L + K, K)}


def test_every_seed_pitfall_is_present():
    assert set(PITFALLS) == {"resample from p", "|p - q| residual", "temperature mismatch",
                             "unfiltered q", "shared uniforms"}


def assert_caught(pit, vocab: int, length: int = L, samples: int = SAMPLES) -> None:
    """Pitfall `pit` (its world's vocabulary `vocab`) is caught over `length`-token generations:
    its exact law is off the target's, the test's power at `samples` draws is > 1 - 1e-6, and the
    chi-square test on that many draws rejects (tests/audit/test_trees.py uses it too)."""
    target = target_law(pit.world, length)
    law = output_law(pit.world, pit.scheme, length)
    assert tv_distance(law, target) > 0.01  # exact: the output is not the target's
    assert power(target, law, samples) > 1 - 1e-6  # the sample size below suffices
    seqs = simulate(pit.world, pit.scheme, length, samples, torch.Generator().manual_seed(3))
    counts = bincount(sequence_ids(seqs, vocab), vocab**length)
    assert chi_square(counts, target).rejected  # the statistical test catches it
    assert not chi_square(counts, law).rejected  # ... and the draws follow the pitfall's law


@pytest.mark.parametrize("name", list(PITFALLS))
def test_pitfall_is_caught(name):
    assert_caught(PITFALLS[name], V)


CAT_DOG_FISH = positional_world(torch.tensor([[0.6, 0.3, 0.1]] * 2, dtype=torch.float64),
                                torch.tensor([[0.4, 0.5, 0.1]] * 2, dtype=torch.float64))


@pytest.mark.parametrize(("scheme", "expected"), [
    # seed 000, section 8 Q1: P(cat) = 0.4 + 0.2 * 0.6 = 0.52, not 0.6
    (WrongResidual("token", 1, ResidualFromTarget, "from p"), [0.52, 0.36, 0.12]),
    # Q2: |p - q| = (0.2, 0.2, 0) puts 0.1 of the rejected mass on dog
    (WrongResidual("token", 1, AbsoluteResidual, "|p-q|"), [0.5, 0.4, 0.1]),
    # u in dog's CDF interval [0.4, 0.9) is accepted only below 0.6: P(dog, accept) = 0.2
    (SharedUniforms("token", 1), [0.7, 0.2, 0.1]),
])
def test_cat_dog_fish_pitfalls_by_hand(scheme, expected):
    law = output_law(CAT_DOG_FISH, scheme, 1)
    assert law.tolist() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_q_is_wrong_but_only_exact_enumeration_sees_it(dtype):
    """q from half-precision logits drawn, float32 q claimed: exactly wrong (TV > 0), but far
    below what a 20,000-sample chi-square can detect, which is why exactness needs the exact
    audit and why the engine standardizes every q from the very logits it sampled with."""
    from exactspec.audit.pitfalls import half_precision_world

    world = half_precision_world(V, L + K, 105, dtype=dtype)
    step_tv = float((world.draft - world.claimed).abs().sum(-1).max() / 2)
    target = target_law(world, L)
    law = output_law(world, Speculative("token", K), L)
    seq_tv = tv_distance(law, target)
    assert step_tv > 1e-5 and seq_tv > 1e-6  # exactly wrong (float64 enumeration)
    assert power(target, law, SAMPLES) < 0.01  # invisible to the statistical test
    # the same world with the q it was really drawn from is exact again
    fixed = World("half, claimed as drawn", V, L + K, world.target, world.draft, world.draft)
    assert tv_distance(output_law(fixed, Speculative("token", K), L), target_law(fixed, L)) < 1e-12
