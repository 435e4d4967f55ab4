"""Coupled verification in isolation: the verdict emits the target's own draws, the position
uniforms ignore the step, and the law (what the audit enumerates) is exact.

The engine-level tests (same text with and without drafters, chi-square) are in
tests/engine/test_coupled.py.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exactspec import verify
from exactspec.audit import Speculative, output_law, positional_world, target_law, tv_distance
from exactspec.errors import InvalidValue
from exactspec.sampling import RowStreams, acceptance_law, parse_method, sample_from_weights
from exactspec.sampling.coupled import coupled_verdict
from exactspec.sampling.streams import position_uniforms

EXACT = 1e-12  # float64 rounding only


def _probs(g: torch.Generator, *shape: int) -> torch.Tensor:
    w = torch.rand(*shape, generator=g, dtype=torch.float64) ** 3
    return (w / w.sum(-1, keepdim=True)).float()


def test_the_verdict_emits_the_targets_draws():
    """tokens[:n+1] are F_p^{-1}(u) at each position; drafts drawn with the same u are kept
    exactly while they equal those draws."""
    g = torch.Generator().manual_seed(0)
    b, k, v = 64, 5, 7
    p = _probs(g, b, k + 1, v)
    q = _probs(g, b, k, v)
    u = torch.rand(b, k + 1, generator=g, dtype=torch.float64)
    t = sample_from_weights(p.reshape(-1, v), u.reshape(-1)).view(b, k + 1)
    x = sample_from_weights(q.reshape(-1, v), u[:, :k].reshape(-1)).view(b, k)
    verdict = coupled_verdict(p, x, u)
    for row in range(b):
        n = int(verdict.num_accepted[row])
        assert verdict.tokens[row, : n + 1].tolist() == t[row, : n + 1].tolist()
        assert verdict.tokens[row, n + 1:].tolist() == [-1] * (k - n)
        assert x[row, :n].tolist() == t[row, :n].tolist()
        assert n == k or int(x[row, n]) != int(t[row, n])
    assert 0 < int(verdict.num_accepted.sum()) < b * k  # both kept and rejected drafts seen


def test_greedy_verdict_is_the_argmax():
    p = torch.nn.functional.one_hot(torch.tensor([[2, 0, 1]]), 4).float()  # [1, 3, 4]
    verdict = coupled_verdict(p, torch.tensor([[2, 3]]), None)
    assert verdict.tokens.tolist() == [[2, 0, -1]] and verdict.num_accepted.tolist() == [1]


def test_position_uniforms_ignore_the_step():
    """A position's uniform is a function of (seed, position): advancing the stream moves no
    position's draw, and a row's uniforms do not depend on the batch around it."""
    streams = RowStreams.from_seed(7, 3)
    pos = torch.tensor([[0, 1, 2], [5, 6, 7], [0, 1, 2]])
    before = position_uniforms(streams, pos)
    streams.advance()
    streams.advance()
    assert torch.equal(position_uniforms(streams, pos), before)
    alone = position_uniforms(streams.select(torch.tensor([1])), pos[1:2])
    assert torch.equal(alone, before[1:2])
    shifted = position_uniforms(streams, pos[:, 1:])
    assert torch.equal(shifted, before[:, 1:])  # position j, not column j
    assert not torch.equal(before[0], before[2])  # rows have their own seeds
    assert before.dtype == torch.float64 and bool(((before >= 0) & (before < 1)).all())
    assert not torch.equal(before[:, :1], streams.uniform(1, 3))  # apart from step draws


def test_one_step_law_point_mass_is_tokens():
    """With a point-mass draft the coupled law is token verification's: a = p(x), the
    residual p without x."""
    g = torch.Generator().manual_seed(1)
    p = _probs(g, 4, 3, 6).double()
    p = p / p.sum(-1, keepdim=True)  # the coupled law normalises as the inverse CDF does
    x = torch.randint(0, 6, (4, 2), generator=g)
    coupled = acceptance_law(p, x, None, method="coupled")
    token = acceptance_law(p, x, None, method="token")
    assert torch.allclose(coupled.accept_probs, token.accept_probs, atol=EXACT, rtol=0)
    n = torch.tensor([0, 1, 2, 0])
    res_c, res_t = coupled.residual(n), token.residual(n)
    assert torch.allclose(res_c / res_c.sum(-1, keepdim=True),
                          res_t / res_t.sum(-1, keepdim=True), atol=EXACT, rtol=0)


def test_the_law_matches_the_coupled_draws_on_a_grid():
    """The acceptance probability a(x) = |I_p(x) ∩ I_q(x)| / q(x) is the fraction of
    uniforms drawing x from q that also draw x from p (a grid of 2^16 uniforms)."""
    g = torch.Generator().manual_seed(2)
    p = _probs(g, 1, 2, 5).double()
    q = _probs(g, 1, 1, 5).double()
    grid = (torch.arange(1 << 16, dtype=torch.float64) + 0.5) / (1 << 16)
    xs = sample_from_weights(q[0, 0].expand(grid.shape[0], 5), grid)
    ts = sample_from_weights(p[0, 0].expand(grid.shape[0], 5), grid)
    for x in range(5):
        drawn = xs == x
        if not bool(drawn.any()):
            continue
        law = acceptance_law(p, torch.tensor([[x]]), q, method="coupled")
        frac = float((ts[drawn] == x).double().mean())
        assert float(law.accept_probs[0, 1]) == pytest.approx(frac, abs=4 / float(drawn.sum()))


@st.composite
def positional_case(draw):
    """Per-position p and q with zeros allowed, V in 2..4, K in 1..3."""
    vocab, k = draw(st.integers(2, 4)), draw(st.integers(1, 3))

    def dist():
        vals = draw(st.lists(st.one_of(st.just(0.0), st.floats(0.01, 1.0)),
                             min_size=vocab, max_size=vocab))
        if sum(vals) == 0:
            vals[0] = 1.0
        t = torch.tensor(vals, dtype=torch.float64)
        return t / t.sum()

    depth = 2 * k + 2
    p = torch.stack([dist() for _ in range(depth)])
    q = torch.stack([dist() for _ in range(depth)])
    return positional_world(p, q), k


@settings(max_examples=40, deadline=None)
@given(positional_case())
def test_coupled_law_is_lossless_by_enumeration(case):
    """The exact law of the first K+2 tokens, over every draft block and accept/reject path,
    is the target's (exact enumeration, exactspec.audit)."""
    world, k = case
    law = output_law(world, Speculative("coupled", k), k + 2)
    assert tv_distance(law, target_law(world, k + 2)) < EXACT


def test_public_verify_draws_from_the_law():
    """es.verify(method="coupled") (no positions there) draws from the method's law."""
    g = torch.Generator().manual_seed(3)
    p = _probs(g, 2, 3, 5)
    x = torch.tensor([[1, 2], [0, -1]])
    verdict = verify(p, x, None, method="coupled", generator=RowStreams.from_seed(0, 2))
    assert verdict.tokens.shape == (2, 3)
    assert parse_method("coupled").lossless and parse_method("coupled").coupled


def test_coupled_refuses_a_draft_q_never_drew():
    p = torch.full((1, 2, 3), 1 / 3)
    q = torch.tensor([[[0.5, 0.5, 0.0]]])
    with pytest.raises(InvalidValue, match="q\\(x\\) = 0"):
        acceptance_law(p, torch.tensor([[2]]), q, method="coupled")
