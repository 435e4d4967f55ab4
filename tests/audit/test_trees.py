"""Tree verification is lossless: exact enumeration (TV < 1e-12) over random p, q and trees, the
tree pitfalls caught (exact TV > 0, chi-square rejects), and trees accept more than a chain.

Exact: `output_law` of whole generations of L tokens through `TreeScheme`, which enumerates every
tree a drafter can draw and runs the library's own `tree_acceptance_law` on it. Statistical
(alpha = 1e-6 per check, fixed seeds): batched simulation through the library's `verify_tree`;
the sample size is justified by the exact power of the test against each pitfall's exact law.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exactspec.audit import (
    Speculative,
    output_law,
    random_world,
    simulate,
    target_law,
    tv_distance,
)
from exactspec.audit.samplers import sequence_ids
from exactspec.audit.stats import ALPHA, bincount, chi_square
from exactspec.audit.trees import TreeScheme, tree_pitfalls, tree_schemes
from exactspec.sampling import SIBLING_KINDS, branching_parents
from tests.audit.test_pitfalls import assert_caught

L = 4  # generated tokens compared in the statistical tests (V**L outcomes)
SAMPLES = 20_000  # every pitfall's power at this size is > 1 - 1e-6 (asserted below)


@st.composite
def _trees(draw):
    """A random topology (parents in topological order), a sibling kind, a method, a world."""
    kind = draw(st.sampled_from(SIBLING_KINDS))
    vocab = draw(st.integers(2, 3))
    n = draw(st.integers(1, 5))
    parents: list[int] = []
    for i in range(n):
        choices = [-1, *range(i)]
        if kind != "iid":  # distinct siblings: at most V children per node
            choices = [c for c in choices if parents.count(c) < vocab]
        parents.append(draw(st.sampled_from(choices)))
    method = draw(st.sampled_from(["token", "traversal"]))
    zeros = draw(st.sampled_from([0.0, 0.3])) if kind == "iid" else 0.0
    return TreeScheme(method, tuple(parents), kind), vocab, draw(st.integers(0, 10**6)), zeros


@settings(max_examples=60, deadline=None)
@given(_trees())
def test_every_tree_rule_is_exactly_lossless(case):
    scheme, vocab, seed, zeros = case
    length = 3
    world = random_world(vocab, length + scheme.num_draft, seed, zeros=zeros)
    assert tv_distance(output_law(world, scheme, length), target_law(world, length)) < 1e-12


@pytest.mark.parametrize("kind", SIBLING_KINDS)
def test_greedy_tree_is_greedy_decoding(kind):
    world = random_world(3, L + 2, 11)
    scheme = TreeScheme("greedy", tuple(branching_parents((2, 2))), kind)
    law = output_law(world, scheme, L)
    assert tv_distance(law, target_law(world, L, greedy=True)) < 1e-12


@pytest.mark.parametrize(("method", "chain"), [("token", "token"), ("traversal", "block")])
def test_a_chain_tree_has_the_chain_verifiers_law(method, chain):
    """A one-child-per-node tree through the tree audit gives `verify`'s sequence law."""
    world = random_world(3, L + 3, 12)
    tree = output_law(world, TreeScheme(method, (-1, 0, 1), "iid"), L)
    assert tv_distance(tree, output_law(world, Speculative(chain, 3), L)) < 1e-12


def test_every_pitfall_is_present():
    assert {p.name for p in tree_pitfalls(3, 6)} == {
        "w/o replacement as iid", "residual not renormalised", "q from the parent's slot",
        "top-k verified as sampled"}


PITFALLS = {p.name: p for p in tree_pitfalls(3, L + 2)}


@pytest.mark.parametrize("name", list(PITFALLS))
def test_tree_pitfall_is_caught(name):
    assert_caught(PITFALLS[name], 3, L, SAMPLES)


@pytest.mark.parametrize("scheme", tree_schemes((2, 2)), ids=lambda s: s.name)
def test_tree_rule_passes_the_chi_square(scheme):
    world = PITFALLS["residual not renormalised"].world  # the world every pitfall fails on
    seqs = simulate(world, scheme, L, SAMPLES, torch.Generator().manual_seed(4))
    result = chi_square(bincount(sequence_ids(seqs, 3), 3**L), target_law(world, L))
    assert result.dof > 30 and not result.rejected, result


def _one_step_accepted(world, scheme, rows, seed):  # [rows] accepted tokens of one step
    start = torch.zeros(rows, dtype=torch.long)
    _, n = scheme.draw(world, start, start, torch.Generator().manual_seed(seed))
    return n.double()


@pytest.mark.parametrize(("method", "kind"), [("token", "iid"), ("traversal", "iid"),
                                              ("token", "without_replacement")])
def test_a_2x2_tree_accepts_more_than_a_depth_2_chain(method, kind):
    """One-sided two-sample z-test at alpha = 1e-6 on the accepted tokens of one step.

    The world's q is flatter than p (a weak drafter), so a second sibling often rescues a
    rejection. The exact means and variances fix the sample size's power first.
    """
    world = random_world(4, 4, 21)
    world = type(world)(world.name, 4, 4, world.target,
                        (world.draft + 0.15) / (world.draft + 0.15).sum(-1, keepdim=True), None)
    world = world.with_claimed(world.draft, "flat q")
    tree = TreeScheme(method, tuple(branching_parents((2, 2))), kind)
    chain = TreeScheme(method, (-1, 0), kind)  # the same drafter, one child per node
    moments = []
    for scheme in (tree, chain):
        step = scheme.step_law(world, 0)
        law = step.joint[0].sum(0)  # [D+1] exact law of the accepted count
        n = torch.arange(3, dtype=torch.float64)
        mean = float((law * n).sum())
        moments.append((mean, float((law * n**2).sum()) - mean**2))
    (m_tree, v_tree), (m_chain, v_chain) = moments
    assert m_tree > m_chain + 0.05  # exact: the tree accepts more per step
    rows = 20_000
    z_crit = 4.753424308822899  # one-sided standard normal quantile at 1 - 1e-6
    assert ALPHA == 1e-6
    spread = math.sqrt((v_tree + v_chain) / rows)
    assert (m_tree - m_chain) / spread > z_crit + 5  # power ~ 1: the shift is > 5 sigma past it
    a, b = _one_step_accepted(world, tree, rows, 1), _one_step_accepted(world, chain, rows, 2)
    z = float(a.mean() - b.mean()) / math.sqrt(float(a.var() + b.var()) / rows)
    assert z > z_crit
