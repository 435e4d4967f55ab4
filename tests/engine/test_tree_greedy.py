"""Exact: greedy token trees emit the same tokens as greedy plain decoding, bit for bit."""

from __future__ import annotations

import pytest
import torch

from exactspec import SamplingParams
from exactspec.drafters import DraftModel, PromptLookup
from exactspec.engine import generate
from exactspec.errors import InvalidValue
from tests.engine.tiny import (
    GREEDY,
    GREEDY_PROMPTS,
    contrarian,
    greedy_plain,
    greedy_target,
    perturbed,
)

PROMPTS = GREEDY_PROMPTS
target, plain = greedy_target, greedy_plain  # the module fixtures of tests/engine/tiny.py


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


@pytest.mark.parametrize("verify", ["token", "traversal", "greedy"])
def test_prompt_lookup_branches_equal_plain(target, plain, verify):
    out = generate(target, PROMPTS, drafter=PromptLookup(1, 2, branches=3, depth=3),
                   params=GREEDY, max_new_tokens=40, verify=verify)
    assert [g.token_ids for g in out] == plain
    assert sum(g.stats.accepted for g in out) > 0


def test_prompt_lookup_tree_is_a_trie_of_the_latest_matches():
    from exactspec.drafters.base import DraftContext
    from exactspec.drafters.tree_draft import lookup_tree
    from exactspec.sampling import RowStreams

    row = [1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2]  # "1 2" was followed by 3 9 / 3 1 / 4 1
    tokens = torch.tensor([row])
    ctx = DraftContext(tokens, torch.tensor([len(row)]), torch.tensor([0]), GREEDY,
                       RowStreams(torch.zeros(1, dtype=torch.long)))
    tree = lookup_tree(ctx, 1, 2, 3, 2, torch.tensor([5]))
    # latest first: (3, 9), (4, 1), (3, 1): the two starting with 3 share one node
    assert tree.tokens[0, :5].tolist() == [3, 9, 4, 1, 1]
    assert tree.parents[0, :5].tolist() == [-1, 0, -1, 2, 0]
    assert (tree.tokens[0, 5:] == -1).all()
    capped = lookup_tree(ctx, 1, 2, 3, 2, torch.tensor([1]))  # the row's budget: depth 1
    assert capped.tokens[0, :2].tolist() == [3, 4] and (capped.tokens[0, 2:] == -1).all()


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


def test_traversal_on_a_chain_drafter_is_block_verification(target):
    """verify='traversal' with a chain drafter runs block verification: same seeded text."""
    params = SamplingParams(temperature=1.0, seed=3)
    draft = DraftModel(perturbed(target, 0.3))
    a = generate(target, PROMPTS, drafter=draft, params=params, max_new_tokens=12, verify="block")
    b = generate(target, PROMPTS, drafter=draft, params=params, max_new_tokens=12,
                 verify="traversal")
    assert [g.token_ids for g in a] == [g.token_ids for g in b]


def test_eagle_tree_equals_plain_and_beats_its_chain():
    from tests.audit.test_engine_lossless import eagle
    from tests.audit.test_engine_lossless import tiny_llama as tiny8

    target = tiny8(0)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7], [3]]
    plain = [g.token_ids for g in generate(target, prompts, params=GREEDY, max_new_tokens=20)]
    chain = generate(target, prompts, drafter=eagle(target), params=GREEDY, max_new_tokens=20,
                     num_draft_tokens=2)
    drafter = eagle(target)
    drafter.tree = (2, 2)
    tree = generate(target, prompts, drafter=drafter, params=GREEDY, max_new_tokens=20)
    assert [g.token_ids for g in tree] == plain == [g.token_ids for g in chain]
    assert sum(g.stats.accepted for g in tree) > sum(g.stats.accepted for g in chain)
