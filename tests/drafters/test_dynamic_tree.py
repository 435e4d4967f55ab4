"""Dynamic token trees: EAGLE-2's growth on a hand-computed case, the sampled growth's shape
rules, greedy dynamic trees == greedy plain bit for bit (draft model, EAGLE head, quantized
draft), and the refusals."""

from __future__ import annotations

import pytest
import torch

from exactspec import SamplingParams
from exactspec.drafters import DraftModel, QuantizedDraft
from exactspec.drafters.base import DraftContext
from exactspec.drafters.dynamic_tree import DynamicTree, grow_dynamic, grow_sampled
from exactspec.drafters.eagle import EagleDrafter
from exactspec.engine import generate
from exactspec.errors import InvalidType, InvalidValue
from exactspec.sampling import RowStreams
from tests.drafters.test_eagle import make_head
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

T1 = SamplingParams(temperature=1.0)
Q = torch.tensor([0.5, 0.3, 0.2])  # the same draft q after every path


def _context(params, rows: int = 1) -> DraftContext:
    tokens = torch.zeros(rows, 1, dtype=torch.long)
    return DraftContext(tokens, torch.ones(rows, dtype=torch.long),
                        torch.ones(rows, dtype=torch.long), params, RowStreams.from_seed(0, rows))


def _constant(tokens, slots, depth, anc):  # the Expand of a draft whose q never changes
    return Q.log().expand(tokens.shape[0], slots.numel(), -1)  # [B, M, V]


def test_eagle2_growth_keeps_the_best_path_scores():
    """top_k=2: candidates a .5, b .3 | aa .25, ab .15, ba .15, bb .09 | (from aa, ab) aaa .125,
    ...; the 6 best, ties to the earlier candidate: a, b, aa, ab, ba, aaa (a = 0, b = 1)."""
    tree = grow_dynamic(_context(T1), DynamicTree(6, 2, 3), torch.tensor([9]), Q.log()[None],
                        _constant)
    assert tree.siblings == "deterministic" and tree.draft_probs is None
    assert tree.tokens[0].tolist() == [0, 1, 0, 1, 0, 0]
    assert tree.parents[0].tolist() == [-1, -1, 0, 0, 1, 2]
    capped = grow_dynamic(_context(T1), DynamicTree(6, 2, 3), torch.tensor([1]), Q.log()[None],
                          _constant)  # the row may add one token: depth 1 only
    assert capped.tokens[0].tolist() == [0, 1]  # only 2 candidates were grown


def test_sampled_growth_spends_the_budget_depth_by_depth():
    spec = DynamicTree(node_budget=7, top_k=3, max_depth=5)
    tree = grow_sampled(_context(T1, rows=64), spec, "without_replacement",
                        torch.full((64,), 9), Q.log()[None].expand(64, -1), _constant)
    depth = tree.shape.depth
    assert tree.num_nodes == 7 and bool(tree.shape.valid.all())  # 3 + 3 + 1, all kept
    assert depth[0].tolist() == [1, 1, 1, 2, 2, 2, 3]
    assert torch.allclose(tree.draft_probs, Q.expand(64, 7, -1))  # each node: its parent's q
    root_kids = tree.tokens[:, :3].sort(1).values
    assert (root_kids == torch.tensor([0, 1, 2])).all()  # without replacement: all distinct
    # D'Hondt: the root children are always {0, 1, 2} (scores .5, .3, .2); priorities .5, .3,
    # .25 (token 0's second child) win depth 2's three slots: token 0 gets two, token 1 one
    parent_tok = tree.tokens.gather(1, tree.parents[:, 3:6])  # [64, 3]
    assert (parent_tok.sort(1).values == torch.tensor([0, 0, 1])).all()
    # depth 3's one slot goes to the depth-2 node of the highest path score
    path_score = Q[parent_tok] * Q[tree.tokens[:, 3:6]]  # [64, 3]
    assert torch.equal(tree.parents[:, 6], 3 + path_score.argmax(1))


@pytest.mark.parametrize(("spec", "verify"), [(DynamicTree(16, 4, 6), "token"),
                                              (DynamicTree(6, 2, 4), "traversal"),
                                              (DynamicTree(8, 3, 3), "greedy")])
@pytest.mark.parametrize("name", ["self", "contrarian", "perturbed"])
def test_greedy_dynamic_tree_equals_plain(target, plain, spec, verify, name):
    draft = {"self": target, "contrarian": contrarian(target),
             "perturbed": perturbed(target, 0.3)}[name]
    siblings = "deterministic" if verify == "traversal" else "without_replacement"
    out = generate(target, PROMPTS, drafter=DraftModel(draft, tree=spec, siblings=siblings),
                   params=GREEDY, max_new_tokens=40, verify=verify)
    assert [g.token_ids for g in out] == plain
    accepted = sum(g.stats.accepted for g in out)
    steps = sum(g.stats.steps for g in out)
    if name == "self":  # the best depth-1 node (the argmax) is always kept and agrees
        assert accepted >= steps - len(PROMPTS) and accepted > 2 * steps
    if name == "contrarian":
        assert accepted == 0
    if name == "perturbed":
        assert 0 < accepted < steps * spec.max_depth


@pytest.mark.parametrize("drafter", ["eagle", "int8", "int8-fixed", "eagle-sampled"])
def test_greedy_dynamic_trees_of_other_drafters_equal_plain(target, plain, drafter):
    spec = DynamicTree(10, 3, 4)
    d = {"eagle": lambda: EagleDrafter(make_head(target), target, tree=spec,
                                       siblings="deterministic"),
         "eagle-sampled": lambda: EagleDrafter(make_head(target), target, tree=spec),
         "int8": lambda: QuantizedDraft(8, tree=spec),
         "int8-fixed": lambda: QuantizedDraft(8, tree=(2, 2))}[drafter]()
    out = generate(target, PROMPTS, drafter=d, params=GREEDY, max_new_tokens=40)
    assert [g.token_ids for g in out] == plain
    assert sum(g.stats.accepted for g in out) > 0


def test_a_dynamic_tree_beats_its_chain_on_a_weak_greedy_draft(target):
    draft = perturbed(target, 0.6)
    chain = generate(target, PROMPTS, drafter=DraftModel(draft), params=GREEDY,
                     max_new_tokens=40, num_draft_tokens=4)
    tree = generate(target, PROMPTS, drafter=DraftModel(draft, tree=DynamicTree(8, 2, 4)),
                    params=GREEDY, max_new_tokens=40)
    assert sum(g.stats.accepted for g in tree) > sum(g.stats.accepted for g in chain)


def test_dynamic_tree_arguments_and_refusals(target):
    assert DraftModel(target, tree="dynamic:12:3").tree == DynamicTree(12, 3, 6)
    assert DraftModel(target, tree="dynamic").tree == DynamicTree()
    for bad in ("dynamic:0", "dynamic:x", "dynamic:1:2:3:4", "dynamic16"):
        with pytest.raises(InvalidValue, match=r"(?i)dynamic"):
            DraftModel(target, tree=bad)
    with pytest.raises(InvalidType, match="node_budget"):
        DynamicTree(node_budget=2.5)
    sampled = DraftModel(target, tree=DynamicTree(8))  # siblings default: without replacement
    with pytest.raises(InvalidValue, match="traversal"):
        generate(target, PROMPTS[:1], drafter=sampled, params=T1, max_new_tokens=4,
                 verify="traversal")
    with pytest.raises(InvalidValue, match=r"llama\.cpp"):
        QuantizedDraft(8, backend="llama.cpp", tree=DynamicTree())
    with pytest.raises(InvalidValue, match=r"llama\.cpp"):
        QuantizedDraft(8, backend="llama.cpp", tree=(2, 2))
    assert QuantizedDraft(8, tree=(2, 2)).backend == "torch"  # auto picks torch for trees
