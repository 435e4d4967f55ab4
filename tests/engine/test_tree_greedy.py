"""Exact: greedy token trees emit the same tokens as greedy plain decoding, bit for bit."""

from __future__ import annotations

import pytest

from exactspec import SamplingParams
from exactspec.drafters import DraftModel
from exactspec.engine import generate
from exactspec.errors import InvalidValue
from tests.engine.tiny import contrarian, perturbed, tiny_llama

GREEDY = SamplingParams(temperature=0)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [30, 31, 30, 31, 30]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


@pytest.fixture(scope="module")
def plain(target):
    return [g.token_ids for g in generate(target, PROMPTS, params=GREEDY, max_new_tokens=40)]


@pytest.mark.parametrize(("tree", "verify"), [((2, 2), "token"), ((3, 2, 1), "traversal"),
                                              ((2, 2), "greedy")])
@pytest.mark.parametrize("name", ["self", "contrarian", "perturbed"])
def test_greedy_tree_equals_plain(target, plain, tree, verify, name):
    draft = {"self": target, "contrarian": contrarian(target),
             "perturbed": perturbed(target, 0.3)}[name]
    out = generate(target, PROMPTS, drafter=DraftModel(draft, tree=tree), params=GREEDY,
                   max_new_tokens=40, verify=verify)
    assert [g.token_ids for g in out] == plain
    accepted = sum(g.stats.accepted for g in out)
    steps = sum(g.stats.steps for g in out)
    if name == "self":  # the top child always agrees: every step takes the whole depth
        assert accepted >= steps * len(tree) - len(PROMPTS) * len(tree)
    if name == "contrarian":
        assert accepted == 0
    if name == "perturbed":
        assert 0 < accepted < steps * len(tree)


def test_tree_beats_its_chain_on_a_weak_greedy_draft(target):
    """The top-2 at every depth catches argmaxes the chain misses (same draft, same depth)."""
    draft = perturbed(target, 0.6)
    chain = generate(target, PROMPTS, drafter=DraftModel(draft), params=GREEDY,
                     max_new_tokens=40, num_draft_tokens=2)
    tree = generate(target, PROMPTS, drafter=DraftModel(draft, tree=(2, 2)), params=GREEDY,
                    max_new_tokens=40)
    assert sum(g.stats.accepted for g in tree) > sum(g.stats.accepted for g in chain)


def test_chain_only_methods_are_refused_with_a_tree(target):
    with pytest.raises(InvalidValue, match="traversal"):
        generate(target, PROMPTS, drafter=DraftModel(target, tree=(2,)), params=GREEDY,
                 verify="block", max_new_tokens=4)
    with pytest.raises(InvalidValue, match="branching"):
        DraftModel(target, tree=(2, 0))
