"""verify / acceptance_law: the seeds' hand-computed tables, exact laws, layout, bad input.

Sequence-level exact enumeration and the statistical tests of the draws live in tests/audit.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exactspec import verify
from exactspec.sampling import RowStreams, acceptance_law

P = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)  # target: cat, dog, fish
Q = torch.tensor([0.4, 0.5, 0.1], dtype=torch.float64)  # draft


def _one_step_output(p, q, method):
    """Exact P(first emitted token = y) for K = 1, summing over the drafted token."""
    out = torch.zeros_like(p)
    for x in range(p.shape[0]):
        if q[x] == 0:
            continue
        law = acceptance_law(torch.stack([p, p])[None], torch.tensor([[x]]), q[None, None],
                             method=method)
        out[x] += q[x] * law.accept_probs[0, 1]
        res = law.residual(torch.tensor([0]))[0]
        out += q[x] * law.accept_probs[0, 0] * res / res.sum()
    return out


def test_cat_dog_fish_table():
    accept = []
    for x in range(3):
        law = acceptance_law(torch.stack([P, P])[None], torch.tensor([[x]]), Q[None, None])
        accept.append(float(law.accept_probs[0, 1]))
        if x == 1:  # dog is rejected 40% of the time; the residual is all cat
            assert law.residual(torch.tensor([0]))[0].tolist() == pytest.approx([0.2, 0, 0])
    assert accept == pytest.approx([1.0, 0.6, 1.0])  # a(x) = min(1, p/q)
    assert float((Q * torch.tensor(accept)).sum()) == pytest.approx(0.8)  # P(accept)
    torch.testing.assert_close(_one_step_output(P, Q, "token"), P)  # P(output = x) = p(x)


@st.composite
def _pq(draw):
    v = draw(st.integers(2, 6))
    vals = st.floats(0.0, 1.0, allow_nan=False)
    p = torch.tensor(draw(st.lists(vals, min_size=v, max_size=v)), dtype=torch.float64)
    q = torch.tensor(draw(st.lists(vals, min_size=v, max_size=v)), dtype=torch.float64)
    p[draw(st.integers(0, v - 1))] += 0.1  # at least some mass
    q[draw(st.integers(0, v - 1))] += 0.1
    return p / p.sum(), q / q.sum()


@settings(max_examples=200, deadline=None)
@given(_pq())
def test_one_step_exactly_lossless(pq):
    p, q = pq
    for method in ("token", "block"):
        torch.testing.assert_close(_one_step_output(p, q, method), p, rtol=0, atol=1e-12)


def test_token_law_hand_computed_k2():
    p = torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]], dtype=torch.float64)
    q = torch.tensor([[[1.0, 0.0], [0.3, 0.7]]], dtype=torch.float64)
    law = acceptance_law(p, torch.tensor([[0, 1]]), q)
    # a1 = 0.5, a2 = min(1, 0.1 / 0.7) = 1/7
    torch.testing.assert_close(law.accept_probs,
                               torch.tensor([[0.5, 0.5 * 6 / 7, 0.5 / 7]], dtype=torch.float64))


def test_point_mass_law():
    p = torch.tensor([[[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]], dtype=torch.float64)
    law = acceptance_law(p, torch.tensor([[1]]), None)
    torch.testing.assert_close(law.accept_probs, torch.tensor([[0.8, 0.2]], dtype=torch.float64))
    torch.testing.assert_close(law.residual(torch.tensor([0])),  # p without the draft token
                               torch.tensor([[0.7, 0.0, 0.1]], dtype=torch.float64))


def test_greedy_accepts_argmax_prefix():
    p = torch.tensor([[[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]],
                      [[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]])
    v = verify(p, torch.tensor([[1, 1], [1, 0]]), method="greedy")
    assert v.tokens.tolist() == [[1, 0, -1], [1, 0, 1]]
    assert v.num_accepted.tolist() == [1, 2] and v.num_emitted.tolist() == [2, 3]


def test_ragged_rows_and_layout():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 4, 5, generator=gen), -1)
    q = torch.softmax(torch.randn(3, 3, 5, generator=gen), -1)
    x = torch.tensor([[1, 2, 3], [4, -1, -1], [-1, -1, -1]])
    v = verify(p, x, q, generator=gen)
    for b, length in enumerate([3, 1, 0]):
        n = int(v.num_accepted[b])
        assert 0 <= n <= length
        assert v.tokens[b, :n].tolist() == x[b, :n].tolist()
        assert v.tokens[b, n] >= 0 and (v.tokens[b, n + 1:] == -1).all()


def test_no_drafts_is_plain_sampling_from_p():
    p = torch.tensor([[[0.0, 1.0, 0.0]]] * 4)
    v = verify(p, torch.zeros(4, 0, dtype=torch.long), generator=torch.Generator().manual_seed(1))
    assert v.tokens.tolist() == [[1]] * 4 and v.num_accepted.tolist() == [0] * 4


def test_certain_rejection_and_acceptance():
    p = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])
    q = torch.tensor([[[1.0, 0.0]]])
    for method in ("token", "block"):
        v = verify(p, torch.tensor([[0]]), q, method=method)
        assert v.tokens.tolist() == [[1, -1]]  # p(x) = 0: rejected; the residual is token 1
    v = verify(torch.tensor([[[1.0, 0.0], [0.0, 1.0]]]), torch.tensor([[0]]), q)
    assert v.tokens.tolist() == [[0, 1]]  # p >= q: accepted, then the bonus token from p


def test_empty_residual_falls_back_to_target():
    """Rounding can leave max(p - q, 0) with no mass after a rejection: then p is used."""
    p = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]], dtype=torch.float64)
    q = torch.tensor([[[0.50004, 0.50004]]], dtype=torch.float64)  # within the sum tolerance
    law = acceptance_law(p, torch.tensor([[0]]), q)
    assert float(law.accept_probs[0, 0]) > 0
    torch.testing.assert_close(law.residual(torch.tensor([0])), p[:, 0])


def test_seeded_streams_reproduce_per_row():
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(6, 3, 7, generator=gen), -1)
    q = torch.softmax(torch.randn(6, 2, 7, generator=gen), -1)
    x = torch.multinomial(q.reshape(-1, 7), 1, generator=gen).reshape(6, 2)
    full = verify(p, x, q, generator=RowStreams.from_seed(42, 6))
    again = verify(p, x, q, generator=RowStreams.from_seed(42, 6))
    assert torch.equal(full.tokens, again.tokens)
    rows = torch.tensor([4, 1])
    part = verify(p[rows], x[rows], q[rows], generator=RowStreams.from_seed(42, 6).select(rows))
    assert torch.equal(part.tokens, full.tokens[rows])
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    one = verify(p, x, q, generator=gens)
    assert one.tokens.shape == (6, 3)
    with pytest.raises(ValueError, match="one per row"):
        verify(p, x, q, generator=gens[:2])


@pytest.mark.parametrize("case, exc, word", [
    ("unknown method", ValueError, "unknown verify method"),
    ("q zero", ValueError, r"q\(x\) = 0"),
    ("id range", ValueError, "out of range"),
    ("hole", ValueError, "padding at the end"),
    ("negative", ValueError, "negative"),
    ("nan", ValueError, "NaN"),
    ("not normalised", ValueError, "sum to 1"),
    ("shape", ValueError, "expected"),
    ("vocab", ValueError, "vocabulary"),
    ("logits dtype", TypeError, "integer"),
])
def test_bad_input(case, exc, word):
    p = torch.full((1, 3, 4), 0.25)
    q = torch.full((1, 2, 4), 0.25)
    x = torch.tensor([[1, 2]])
    kwargs = {}
    if case == "unknown method":
        kwargs["method"] = "typical"
    elif case == "q zero":
        q = torch.tensor([[[0.5, 0.0, 0.5, 0.0], [0.25] * 4]])
    elif case == "id range":
        x = torch.tensor([[1, 4]])
    elif case == "hole":
        x = torch.tensor([[-1, 2]])
    elif case == "negative":
        p = p.clone()
        p[0, 0] = torch.tensor([0.5, 0.5, 0.25, -0.25])
    elif case == "nan":
        p = p.clone()
        p[0, 2, 0] = float("nan")
    elif case == "not normalised":
        q = q * 2
    elif case == "shape":
        x = torch.tensor([[1, 2, 3]])
    elif case == "vocab":
        q = torch.full((1, 2, 5), 0.2)
    elif case == "logits dtype":
        x = x.float()
    with pytest.raises(exc, match=word):
        verify(p, x, q, **kwargs)
