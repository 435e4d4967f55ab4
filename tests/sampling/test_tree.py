"""Token trees: hand-computed tables, chains against `verify`, the verdict's layout, bad input.

Exact enumeration of whole generations and the statistical tests live in tests/audit/test_trees.py.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exactspec.errors import InvalidType, InvalidValue
from exactspec.sampling import (
    DraftTree,
    RowStreams,
    acceptance_law,
    branching_parents,
    tree_acceptance_law,
    tree_history,
    verify,
    verify_tree,
)

P = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)  # target: cat, dog, fish
Q = torch.tensor([0.4, 0.5, 0.1], dtype=torch.float64)  # draft
CAT, DOG, FISH = 0, 1, 2


def _root_tree(tokens, kind, q=Q):
    """Siblings under the root only: p at the root and (unused here) after each child."""
    n = len(tokens)
    target = torch.stack([P] * (n + 1))[None]  # [1, N+1, 3]
    parents = torch.full((1, n), -1)
    draft = None if kind == "deterministic" else torch.stack([q] * n)[None]
    return target, DraftTree(torch.tensor([tokens]), parents, draft, kind)


def test_branching_parents():
    assert branching_parents((2, 2)) == [-1, -1, 0, 0, 1, 1]
    assert branching_parents((3, 2, 1)) == [-1] * 3 + [0, 0, 1, 1, 2, 2] + list(range(3, 9))
    assert branching_parents((1, 1, 1)) == [-1, 0, 1]
    with pytest.raises(InvalidValue, match="branching"):
        branching_parents((2, 0))


@pytest.mark.parametrize(("tokens", "kind", "terminal", "residual_at_root"), [
    # dog first: a = 0.6; after the rejection P' = norm(max(p - q, 0)) = cat only; the second
    # dog has P'(dog) = 0 and is always rejected, so the recovered token is cat
    ((DOG, DOG), "iid", [0.4, 0.6, 0.0], [1.0, 0.0, 0.0]),
    # then cat: a = min(1, P'(cat) / q(cat)) = min(1, 1 / 0.4) = 1
    ((DOG, CAT), "iid", [0.0, 0.6, 0.4], None),
    # without replacement the second sibling is divided by q without dog: (0.8, 0, 0.2)
    ((DOG, CAT), "without_replacement", [0.0, 0.6, 0.4], None),
    # point masses: accept cat w.p. p(cat) = 0.6, then dog w.p. p'(dog) = 0.3 / 0.4, then fish
    ((CAT, DOG), "deterministic", [0.1, 0.6, 0.3], [0.0, 0.0, 1.0]),
])
def test_cat_dog_fish_siblings(tokens, kind, terminal, residual_at_root):
    for method in ("token", "traversal"):  # one level below the root: the two rules coincide
        law = tree_acceptance_law(*_root_tree(tokens, kind), method=method)
        torch.testing.assert_close(law.terminal_probs[0],
                                   torch.tensor(terminal, dtype=torch.float64))
        if residual_at_root is not None:
            res = law.residuals()[0, 0]
            res = res / res.sum()
            torch.testing.assert_close(res, torch.tensor(residual_at_root, dtype=torch.float64))


def test_without_replacement_divides_by_the_conditioned_q():
    p = torch.tensor([0.5, 0.2, 0.3], dtype=torch.float64)
    q = torch.tensor([0.4, 0.5, 0.1], dtype=torch.float64)
    target = torch.stack([p] * 3)[None]
    tokens, roots = torch.tensor([[DOG, CAT]]), torch.tensor([[-1, -1]])
    draft = torch.stack([q, q])[None]
    # dog: a = 0.2 / 0.5 = 0.4; after it P' = norm(max(p - q, 0)) = (1/3, 0, 2/3)
    # cat drawn i.i.d.: a = min(1, (1/3) / 0.4) = 5/6
    iid = tree_acceptance_law(target, DraftTree(tokens, roots, draft, "iid"))
    assert iid.terminal_probs[0].tolist() == pytest.approx([0.1, 0.4, 0.5])
    # cat drawn without replacement has q = 0.4 / (1 - 0.5) = 0.8: a = (1/3) / 0.8 = 5/12
    wor = tree_acceptance_law(target, DraftTree(tokens, roots, draft, "without_replacement"))
    assert wor.terminal_probs[0].tolist() == pytest.approx([0.35, 0.4, 0.25])
    # the recovered token: norm(max(P' - (0.8, 0, 0.2), 0)) = fish only
    res = wor.residuals()[0, 0]
    assert (res / res.sum()).tolist() == pytest.approx([0, 0, 1])


def test_traversal_keeps_a_child_the_token_rule_would_lose():
    # the seed of arXiv 2505.12398: a parent accepted w.p. 0.5 whose child has ratio 4/3 is kept
    # with the sequence-level min(1, 0.5 * 4/3) = 2/3 under traversal, 0.5 under the token rule
    p = torch.tensor([[[0.25, 0.75], [0.8, 0.2], [0.5, 0.5]]], dtype=torch.float64)
    q = torch.tensor([[[0.5, 0.5], [0.6, 0.4]]], dtype=torch.float64)
    tree = DraftTree(torch.tensor([[0, 0]]), torch.tensor([[-1, 0]]), q, "iid")
    token = tree_acceptance_law(p, tree, method="token").terminal_probs[0]
    traversal = tree_acceptance_law(p, tree, method="traversal").terminal_probs[0]
    assert float(token[2]) == pytest.approx(0.5)  # a_1 = 0.5, a_2 = min(1, 4/3) = 1
    assert float(traversal[2]) == pytest.approx(2 / 3)


def _rand(gen, *shape, dtype=torch.float64):
    t = torch.rand(*shape, generator=gen, dtype=torch.float64) ** 3 + 1e-3
    return (t / t.sum(-1, keepdim=True)).to(dtype)


@st.composite
def _chains(draw):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    bsz, k, v = draw(st.integers(1, 6)), draw(st.integers(0, 5)), draw(st.integers(2, 7))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    p, q = _rand(gen, bsz, k + 1, v, dtype=dtype), _rand(gen, bsz, k, v, dtype=dtype)
    x = torch.multinomial(q.reshape(-1, v).double(), 1, generator=gen).reshape(bsz, k) if k \
        else torch.zeros(bsz, 0, dtype=torch.long)
    lengths = torch.randint(0, k + 1, (bsz,), generator=gen)
    x = torch.where(torch.arange(k)[None, :] < lengths[:, None], x, -1)
    return p, x, q, draw(st.booleans()), draw(st.integers(0, 2**31))


@settings(max_examples=80, deadline=None)
@given(_chains())
def test_a_chain_is_verified_exactly_as_verify_does(case):
    """Same law (bit for bit for token / greedy) and the same tokens from the same randomness."""
    p, x, q, point_mass, seed = case
    q = None if point_mass else q
    tree = DraftTree.chain(x, q)
    for method in ("token", "greedy"):
        assert torch.equal(acceptance_law(p, x, q, method=method).accept_probs,
                           tree_acceptance_law(p, tree, method=method).terminal_probs)
        chain = verify(p, x, q, method=method, generator=torch.Generator().manual_seed(seed))
        out = verify_tree(p, tree, method=method, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(chain.tokens, out.tokens), method
        assert torch.equal(chain.num_accepted, out.num_accepted)
    streams = RowStreams.from_seed(seed, x.shape[0])
    assert torch.equal(verify(p, x, q, generator=streams).tokens,
                       verify_tree(p, tree, generator=streams).tokens)


@settings(max_examples=80, deadline=None)
@given(_chains())
def test_traversal_on_a_chain_is_block_verification(case):
    p, x, q, point_mass, _ = case
    p = p.double() / p.double().sum(-1, keepdim=True)
    q = None if point_mass else q.double() / q.double().sum(-1, keepdim=True)
    block = acceptance_law(p, x, q, method="block")
    law = tree_acceptance_law(p, DraftTree.chain(x, q), method="traversal")
    torch.testing.assert_close(law.terminal_probs, block.accept_probs, rtol=0, atol=1e-12)
    lengths = (x >= 0).sum(1)
    residuals = law.residuals()
    for n in range(x.shape[1] + 1):
        ours = residuals[:, n] / residuals[:, n].sum(-1, keepdim=True)
        theirs = block.residual(torch.full_like(lengths, n))
        theirs = theirs / theirs.sum(-1, keepdim=True)
        reached = n <= lengths
        torch.testing.assert_close(ours[reached], theirs[reached], rtol=0, atol=1e-12)


def _batch_tree(gen, bsz, parents, v, kind):
    n = len(parents)
    q = _rand(gen, bsz, n, v)
    tokens = torch.stack([torch.randperm(v, generator=gen)[:n] for _ in range(bsz)]) \
        if kind != "iid" else torch.multinomial(q.reshape(-1, v), 1, generator=gen).reshape(bsz, n)
    par = torch.tensor(parents).expand(bsz, n).clone()
    return DraftTree(tokens, par, None if kind == "deterministic" else q, kind)


@pytest.mark.parametrize("method", ["token", "traversal", "greedy"])
@pytest.mark.parametrize("kind", ["iid", "without_replacement", "deterministic"])
def test_verdict_is_a_root_path_and_one_extra_token(method, kind):
    gen = torch.Generator().manual_seed(3)
    parents = branching_parents((2, 2))
    bsz, v = 200, 8
    tree = _batch_tree(gen, bsz, parents, v, kind)
    p = _rand(gen, bsz, len(parents) + 1, v)
    law = tree_acceptance_law(p, tree, method=method)
    torch.testing.assert_close(law.terminal_probs.sum(-1), torch.ones(bsz, dtype=torch.float64))
    out = law.draw(torch.Generator().manual_seed(4))
    residuals = law.residuals()
    for b in range(bsz):
        path = [int(i) for i in out.path[b] if i >= 0]
        assert len(path) == int(out.num_accepted[b])
        assert [int(tree.parents[b, i]) for i in path] == [-1, *path][:len(path)]  # root path
        emitted = out.tokens[b, :len(path) + 1]
        assert emitted[:-1].tolist() == [int(tree.tokens[b, i]) for i in path]
        assert (out.tokens[b, len(path) + 1:] == -1).all() and emitted[-1] >= 0
        t = path[-1] + 1 if path else 0
        assert law.terminal_probs[b, t] > 0 and residuals[b, t, emitted[-1]] > 0
    if method != "greedy":
        assert (out.num_accepted == 2).any() and (out.num_accepted == 0).any()


def test_greedy_follows_the_argmax_through_the_tree():
    v = 5
    p = torch.full((1, 7, v), 0.1, dtype=torch.float64)
    for pos, top in enumerate([3, 0, 1, 0, 0, 2, 4]):  # argmax after the root, after node i
        p[0, pos, top] = 0.6
    # root children: node 0 (2), node 1 (3); node 1's children: node 3 (4), node 4 (1);
    # node 4's child: node 5 (2). Argmax 3 -> node 1, then 1 -> node 4, then 2 -> node 5, emit 4
    tree = DraftTree(torch.tensor([[2, 3, 0, 4, 1, 2]]), torch.tensor([[-1, -1, 0, 1, 1, 4]]),
                     None, "deterministic")
    out = verify_tree(p, tree, method="greedy")
    assert out.tokens[0].tolist() == [3, 1, 2, 4, -1, -1, -1]
    assert out.path[0].tolist() == [1, 4, 5, -1, -1, -1]
    p[0, 5] = 0.2  # a tie after node 4: argmax picks the lowest id, 0, which no child holds
    assert verify_tree(p, tree, method="greedy").tokens[0].tolist() == [3, 1, 0, -1, -1, -1, -1]


def test_empty_tree_is_plain_sampling():
    p = torch.tensor([[[0.2, 0.8]]])
    tree = DraftTree(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long),
                     None, "deterministic")
    law = tree_acceptance_law(p, tree)
    assert law.terminal_probs.tolist() == [[1.0]]
    assert verify_tree(p, tree, method="greedy").tokens.tolist() == [[1]]


def test_bad_trees_are_named():
    q = torch.full((1, 2, 3), 1 / 3)
    p = torch.full((1, 3, 3), 1 / 3)
    two = torch.tensor([[0, 1]])
    roots = torch.tensor([[-1, -1]])
    with pytest.raises(InvalidValue, match="deterministic"):
        DraftTree(two, roots, q, "deterministic")
    with pytest.raises(InvalidValue, match="needs draft_probs"):
        DraftTree(two, roots, None, "iid")
    with pytest.raises(InvalidValue, match="siblings="):
        DraftTree(two, roots, q, "top-k")
    with pytest.raises(InvalidValue, match="parent < own index"):
        DraftTree(two, torch.tensor([[1, -1]]), q)
    with pytest.raises(InvalidValue, match="parent is an unused slot"):
        DraftTree(torch.tensor([[-1, 1]]), torch.tensor([[-1, 0]]), q)
    DraftTree(torch.tensor([[-1, 1]]), roots, q)  # an unused slot before a used one is fine
    with pytest.raises(InvalidType, match="parents"):
        DraftTree(two, torch.tensor([[-1.0, -1.0]]), q)
    tree = DraftTree(two, roots, q)
    with pytest.raises(InvalidValue, match=r"not a tree method.*traversal"):
        verify_tree(p, tree, method="block")
    with pytest.raises(InvalidValue, match="expected"):
        verify_tree(p[:, :2], tree)
    with pytest.raises(InvalidValue, match="out of range"):
        verify_tree(p, DraftTree(torch.tensor([[0, 3]]), roots, q))
    with pytest.raises(InvalidValue, match="sum to 1"):
        verify_tree(p * 2, tree)
    with pytest.raises(InvalidType, match="DraftTree"):
        verify_tree(p, two)
    same = DraftTree(torch.tensor([[1, 1]]), roots, q, "without_replacement")
    with pytest.raises(InvalidValue, match="distinct"):
        verify_tree(p, same)
    zero = torch.tensor([[[0.5, 0.5, 0.0]] * 2])
    with pytest.raises(InvalidValue, match="q\\(x\\) = 0"):
        verify_tree(p, DraftTree(torch.tensor([[2, 0]]), roots, zero))
    # a repeated token drawn i.i.d. is legal: the second copy is simply never accepted
    law = tree_acceptance_law(p, DraftTree(torch.tensor([[1, 1]]), roots, q))
    assert float(law.terminal_probs[0, 2]) == 0.0


def test_tree_history_is_the_context_then_the_path():
    tokens = torch.tensor([[5, 6, 7, -1], [8, -1, -1, -1]])  # committed tokens, -1 padded
    lengths = torch.tensor([3, 1])
    tree = DraftTree(torch.tensor([[1, 2, 3], [4, 0, -1]]), torch.tensor([[-1, -1, 1], [-1, 0, 0]]),
                     None, "deterministic")
    hist = tree_history(tokens, lengths, tree)  # [B, N+1, T']
    assert hist[0].tolist() == [[5, 6, 7, -1, -1], [5, 6, 7, 1, -1], [5, 6, 7, 2, -1],
                                [5, 6, 7, 2, 3]]
    assert hist[1, :, :3].tolist() == [[8, -1, -1], [8, 4, -1], [8, 4, 0], [8, -1, -1]]
