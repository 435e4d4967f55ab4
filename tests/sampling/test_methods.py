"""Verify methods as objects (exactspec.sampling.methods): what each declares, parsing once at
the boundary, and that the string and the object give the same draws."""

import pytest
import torch

import exactspec as es
from exactspec.errors import InvalidValue
from exactspec.sampling import (
    DraftTree,
    RowStreams,
    acceptance_law,
    is_lossless,
    parse_lossy,
    parse_method,
    verify,
)
from exactspec.sampling.methods import (
    LOSSY_RULES,
    METHODS,
    TREE_METHODS,
    Block,
    Greedy,
    Lenient,
    Token,
    Traversal,
    Typical,
    tree_method,
)
from exactspec.sampling.verify import tree_acceptance_law, verify_tree

# name -> (class, lossless, greedy_only, verifies trees)
DECLARED = {"token": (Token, True, False, True), "block": (Block, True, False, False),
            "traversal": (Traversal, True, False, True), "greedy": (Greedy, True, True, True),
            "lenient:0.5": (Lenient, False, False, False),
            "typical:0.09": (Typical, False, False, False)}


@pytest.mark.parametrize("name", DECLARED)
def test_each_method_declares_its_rules(name):
    cls, lossless, greedy_only, trees = DECLARED[name]
    m = parse_method(name)
    assert type(m) is cls and m.name == name and str(m) == name
    assert (m.lossless, m.greedy_only, m.tree_law is not None) == (lossless, greedy_only, trees)
    assert parse_method(m) is m  # an object passes the boundary unchanged
    assert is_lossless(name) == is_lossless(m) == lossless


def test_the_tables():
    assert METHODS == ("token", "block", "greedy") and LOSSY_RULES == ("lenient", "typical")
    assert TREE_METHODS == ("token", "traversal", "greedy")
    assert parse_lossy("token") is None and parse_lossy("lenient:0.25").value == 0.25
    assert parse_method("lenient:0.5") == Lenient(0.5) and parse_method("lenient:1").name \
        == "lenient:1"


@pytest.mark.parametrize("bad", ["tokens", "Token", "mars:0.5", "lenient", "lenient:0",
                                 "lenient:1.5", "typical:1", "typical:x", ""])
def test_bad_names_are_refused_with_the_choices(bad):
    with pytest.raises(InvalidValue, match="verify="):
        parse_method(bad)
    with pytest.raises(InvalidValue, match="must be a method string"):
        parse_method(3)
    with pytest.raises(InvalidValue, match="L must be a number"):
        Lenient(2.0)  # the object checks its own parameter too


def test_unknown_name_lists_every_choice():
    with pytest.raises(InvalidValue) as err:
        parse_method("tokens")
    for choice in ("token", "block", "traversal", "greedy", "lenient:L", "typical:EPS"):
        assert choice in str(err.value)


def _chain(seed=0, bsz=3, k=3, v=5):
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(bsz, k + 1, v, generator=gen), -1)
    q = torch.softmax(torch.randn(bsz, k, v, generator=gen), -1)
    x = torch.multinomial(q.reshape(-1, v), 1, generator=gen).reshape(bsz, k)
    return p, x, q


@pytest.mark.parametrize("name", ["token", "block", "greedy", "lenient:0.5", "typical:0.2"])
def test_the_string_and_the_object_draw_the_same(name):
    p, x, q = _chain()
    a = verify(p, x, q, method=name, generator=RowStreams(torch.tensor([1, 2, 3])))
    b = es.verify(p, x, q, method=parse_method(name), generator=RowStreams(torch.tensor([1, 2, 3])))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)


def test_traversal_on_a_chain_is_block_verification():
    p, x, q = _chain(seed=4)
    law_t = acceptance_law(p, x, q, method="traversal")
    law_b = acceptance_law(p, x, q, method="block")
    assert law_t.method == "traversal"
    assert torch.equal(law_t.accept_probs, law_b.accept_probs)
    assert not torch.equal(law_b.accept_probs, acceptance_law(p, x, q).accept_probs)  # != token


def test_tree_entry_points_refuse_chain_only_methods():
    p = torch.full((1, 2, 4), 0.25)
    tree = DraftTree(torch.tensor([[1]]), torch.tensor([[-1]]), torch.full((1, 1, 4), 0.25))
    assert verify_tree(p, tree, method=parse_method("token")).num_accepted.shape == (1,)
    assert tree_acceptance_law(p, tree, method="greedy").method == "greedy"
    for name in ("block", "lenient:0.5", "typical:0.1"):
        with pytest.raises(InvalidValue, match="not a tree method"):
            tree_method(name)
    with pytest.raises(InvalidValue, match="tree form is 'traversal'"):
        tree_acceptance_law(p, tree, method="block")
