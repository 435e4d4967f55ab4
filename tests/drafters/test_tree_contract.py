"""The tree contract declared beside Drafter (drafters/base.py): tree shapes as TreeSpecs,
`siblings` declared, and trust in q declared by a drafter's own class."""

from __future__ import annotations

import pytest
import torch

from exactspec.drafters import (
    Branching,
    CrossVocabDraft,
    DraftModel,
    DynamicTree,
    EagleDrafter,
    PromptLookup,
    QuantizedDraft,
    SuffixDrafter,
    TreeDrafter,
    TreeSpec,
)
from exactspec.drafters.base import trusts_q
from exactspec.drafters.gguf_draft import GgufDraft
from exactspec.drafters.tree_shape import as_tree, parse_tree, tree_of
from exactspec.engine import generate
from exactspec.engine.drafting import NoDrafter
from exactspec.errors import InvalidType, InvalidValue
from tests.engine.tiny import GREEDY, GREEDY_PROMPTS, greedy_target

target = greedy_target  # the module fixture of tests/engine/tiny.py


def test_both_shapes_are_tree_specs():
    fixed, dynamic = Branching((3, 2, 1)), DynamicTree(12, 3, 5)
    assert isinstance(fixed, TreeSpec) and isinstance(dynamic, TreeSpec)
    assert not isinstance((3, 2, 1), TreeSpec)  # a plain tuple is read through as_tree
    assert fixed == (3, 2, 1) and fixed.fixed and not dynamic.fixed
    assert (fixed.node_budget, fixed.depth, fixed.text()) == (3 + 6 + 6, 3, "3,2,1")
    assert (dynamic.node_budget, dynamic.depth, dynamic.text()) == (12, 5, "dynamic:12:3:5")
    assert DynamicTree(16).text() == "dynamic:16" and fixed.as_json() == [3, 2, 1]


def test_as_tree_and_parse_tree():
    assert as_tree(None) is None and type(as_tree((2, 2))) is Branching
    assert as_tree("dynamic:8") == DynamicTree(8) and as_tree(DynamicTree(4)) == DynamicTree(4)
    assert parse_tree("3,2,1") == (3, 2, 1) and parse_tree("dynamic") == DynamicTree()
    for bad in ("3,x", "3,0", ""):
        with pytest.raises(InvalidValue):
            parse_tree(bad)
    with pytest.raises(InvalidType, match="branching factors"):
        as_tree(3)


def test_tree_drafters_declare_their_shape_and_siblings(target):
    lookup = PromptLookup(branches=3, depth=2)
    assert isinstance(lookup, TreeDrafter) and lookup.siblings == "deterministic"
    assert type(lookup.tree) is Branching and lookup.tree == (3, 1)
    assert tree_of(PromptLookup()) is None  # a chain drafter now
    assert isinstance(SuffixDrafter(), TreeDrafter) and SuffixDrafter.siblings == "deterministic"
    drafter = DraftModel(target, tree=(2, 2))
    assert type(drafter.tree) is Branching and drafter.siblings == "without_replacement"
    drafter.tree = (2,)  # a plain tuple assigned later is read as a Branching
    assert type(tree_of(drafter)) is Branching and tree_of(drafter).fixed


def test_exactspec_drafters_declare_trusted_q_and_subclasses_do_not_inherit_it():
    for cls in (DraftModel, PromptLookup, SuffixDrafter, EagleDrafter, QuantizedDraft,
                CrossVocabDraft, GgufDraft, NoDrafter):
        assert vars(cls).get("standardized_q") is True, cls.__name__

    class Mine(PromptLookup):  # may change how q is made: checked every step
        pass

    assert trusts_q(PromptLookup()) and not trusts_q(Mine())


class _UserTree:
    """A user's tree drafter that forgot `siblings`."""

    hidden_layers = None
    tree = (2,)

    def begin(self, context, target):
        pass

    def select(self, rows):
        pass

    def propose(self, context, num_tokens):
        return torch.zeros(context.tokens.shape[0], 0, dtype=torch.long), None

    def propose_tree(self, context, max_depth):
        raise AssertionError("never reached")


def test_a_tree_drafter_without_siblings_is_refused_by_name(target):
    with pytest.raises(InvalidType, match=r"_UserTree proposes trees .* no `siblings`"):
        generate(target, GREEDY_PROMPTS[:1], drafter=_UserTree(), params=GREEDY,
                 max_new_tokens=2)
