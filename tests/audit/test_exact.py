"""Exact enumeration: token and block verification are lossless over whole generations.

These are exact checks (no sampling): the law of the first L generated tokens, enumerated over
every draft block and accept/reject path, equals the target's to float64 rounding. L = K + 2,
so the comparison spans several speculative steps (block verification is only lossless at the
sequence level).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exactspec.audit import (
    Speculative,
    expected_accepted,
    output_law,
    positional_world,
    random_world,
    target_law,
    tv_distance,
)

EXACT = 1e-12  # float64 rounding only


@st.composite
def distribution(draw, vocab):
    """A probability vector with zeros allowed (at least one positive entry)."""
    values = draw(st.lists(st.one_of(st.just(0.0), st.floats(0.01, 1.0)),
                           min_size=vocab, max_size=vocab))
    if sum(values) == 0:
        values[draw(st.integers(0, vocab - 1))] = 1.0
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum()


@st.composite
def positional_case(draw):
    """Per-position p and q, V in 2..4, K in 1..3, depth L + K with L = K + 2."""
    vocab, k = draw(st.integers(2, 4)), draw(st.integers(1, 3))
    depth = 2 * k + 2
    p = torch.stack([draw(distribution(vocab)) for _ in range(depth)])
    q = torch.stack([draw(distribution(vocab)) for _ in range(depth)])
    return positional_world(p, q), k


@settings(max_examples=60, deadline=None)
@given(positional_case())
def test_token_and_block_lossless_per_position(case):
    world, k = case
    target = target_law(world, k + 2)
    for method in ("token", "block"):
        law = output_law(world, Speculative(method, k), k + 2)
        assert tv_distance(law, target) < EXACT, method
        assert float(law.sum()) == pytest.approx(1.0, abs=EXACT)


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(2, 4), k=st.integers(1, 3), seed=st.integers(0, 2**31),
       zeros=st.sampled_from([0.0, 0.3, 0.6]),
       draft=st.sampled_from(["sampled", "point_mass", "disjoint"]), ragged=st.booleans())
def test_token_and_block_lossless_context_dependent(vocab, k, seed, zeros, draft, ragged):
    """p and q depend on every earlier token; drafts sampled, point-mass, or disjoint from p;
    ragged: some contexts get fewer than K drafts (rows padded with -1), including none."""
    length = k + 2
    world = random_world(vocab, length + k, seed, zeros=zeros, draft=draft)
    target = target_law(world, length)
    for method in ("token", "block"):
        law = output_law(world, Speculative(method, k, ragged=ragged), length)
        assert tv_distance(law, target) < EXACT


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("draft", ["sampled", "point_mass", "disjoint"])
def test_largest_case(draft, ragged):
    """V = 4, K = 3, L = 5 (1024 outcomes over up to 5 steps), every kind of draft."""
    world = random_world(4, 8, seed=11, zeros=0.25, draft=draft)
    target = target_law(world, 5)
    for method in ("token", "block"):
        law = output_law(world, Speculative(method, 3, ragged=ragged), 5)
        assert tv_distance(law, target) < EXACT


@pytest.mark.parametrize("length", [1, 2, 3, 4, 5])
def test_every_prefix_length(length):
    """The first L tokens match for short L too (L <= K + 1 ends inside the first step)."""
    world = random_world(3, length + 3, seed=7, zeros=0.3)
    for method in ("token", "block"):
        law = output_law(world, Speculative(method, 3), length)
        assert tv_distance(law, target_law(world, length)) < EXACT


@settings(max_examples=25, deadline=None)
@given(vocab=st.integers(2, 4), k=st.integers(1, 3), seed=st.integers(0, 2**31),
       draft=st.sampled_from(["sampled", "point_mass", "disjoint"]))
def test_greedy_equals_argmax_decoding(vocab, k, seed, draft):
    """Greedy verification emits exactly the argmax-decoded sequence, whatever the drafts."""
    world = random_world(vocab, k + 2 + k, seed, zeros=0.3, draft=draft)
    law = output_law(world, Speculative("greedy", k, ragged=seed % 2 == 1), k + 2)
    assert tv_distance(law, target_law(world, k + 2, greedy=True)) < EXACT


@settings(max_examples=400, deadline=None)
@given(vocab=st.integers(2, 4), k=st.integers(1, 3), seed=st.integers(0, 2**31),
       zeros=st.sampled_from([0.0, 0.3]), draft=st.sampled_from(["sampled", "point_mass"]))
def test_block_accepts_at_least_as_many_as_token(vocab, k, seed, zeros, draft):
    """Exact E[accepted drafts per step]: block >= token on the same p, q, after every context."""
    world = random_world(vocab, 1 + k + 1, seed, zeros=zeros, draft=draft)
    for length in (0, 1):
        block = expected_accepted(world, Speculative("block", k), length)
        token = expected_accepted(world, Speculative("token", k), length)
        assert bool((block >= token - EXACT).all()), (block - token).min()


def test_block_strictly_better_somewhere():
    """The inequality is not vacuous: on random p/q with K = 3 block accepts more on average."""
    world = random_world(4, 5, seed=0)
    block = expected_accepted(world, Speculative("block", 3))
    token = expected_accepted(world, Speculative("token", 3))
    assert float(block[0]) > float(token[0]) + 1e-3


def test_cat_dog_fish_one_step():
    """Seed 000's example: P(accept) = 0.8 and P(output = x) = p(x) for K = 1."""
    p = torch.tensor([[0.6, 0.3, 0.1]] * 3, dtype=torch.float64)
    q = torch.tensor([[0.4, 0.5, 0.1]] * 3, dtype=torch.float64)
    world = positional_world(p, q)
    law = output_law(world, Speculative("token", 1), 1)
    assert law.tolist() == pytest.approx([0.6, 0.3, 0.1], abs=EXACT)
    assert float(expected_accepted(world, Speculative("token", 1))[0]) == pytest.approx(0.8,
                                                                                       abs=EXACT)


def test_enumeration_is_not_the_target_in_disguise():
    """Plain drafting (always accept q's token) is enumerated as q, not as p."""
    p = torch.tensor([[0.6, 0.3, 0.1]] * 3, dtype=torch.float64)
    q = torch.tensor([[0.4, 0.5, 0.1]] * 3, dtype=torch.float64)
    world = positional_world(p, q)
    # verify told the target IS the draft: every draft accepted, output law = q
    fake = positional_world(q, q)
    fake = type(world)("q as target", 3, 3, fake.target, world.draft, world.claimed)
    law = output_law(fake, Speculative("token", 1), 1)
    assert law.tolist() == pytest.approx([0.4, 0.5, 0.1], abs=EXACT)


@settings(max_examples=20, deadline=None)
@given(vocab=st.integers(2, 4), k=st.integers(1, 3), seed=st.integers(0, 2**31),
       draft=st.sampled_from(["sampled", "point_mass"]))
def test_float32_probabilities_lossless_to_rounding(vocab, k, seed, draft):
    """The engine hands verify float32 p and q: lossless up to float32 rounding (~1e-8)."""
    world = random_world(vocab, 2 * k + 2, seed, zeros=0.3, draft=draft)
    target = target_law(world, k + 2)
    for method in ("token", "block"):
        law = output_law(world, Speculative(method, k, dtype=torch.float32), k + 2)
        assert tv_distance(law, target) < 1e-6
