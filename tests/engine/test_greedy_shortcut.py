"""The engine's greedy shortcut: at T = 0 with the engine's own q, token verification's draw is
greedy verification's, token for token, so a step of greedy rows skips the law's uniforms,
residual and float64 CDF (exactspec/engine/verifier.py greedy_shortcut)."""

from __future__ import annotations

import pytest
import torch

from exactspec.drafters.draft_model import DraftModel
from exactspec.engine.arguments import parse_verify
from exactspec.engine.verifier import greedy_shortcut
from exactspec.sampling import RowStreams, SamplingParams, parse_method, probs_from_logits

GREEDY = SamplingParams(temperature=0)


def _chain(rows: int, k: int, vocab: int, seed: int, params: SamplingParams):
    """p [B, K+1, V] and a drafter's q [B, K, V] standardized with `params`, drafts x [B, K]
    drawn from q (greedy: q's argmax), about half of them p's argmax, rows -1 padded."""
    g = torch.Generator().manual_seed(seed)
    p = probs_from_logits(torch.randn(rows, k + 1, vocab, generator=g) * 3, params)
    q_logits = torch.randn(rows, k, vocab, generator=g) * 3
    agree = torch.rand(rows, k, generator=g) < 0.7  # the draft's top token is the target's
    top = p[:, :k].argmax(-1)  # [B, K]
    q_logits.scatter_(2, top[..., None], torch.where(agree, 50.0, -50.0)[..., None])
    q = probs_from_logits(q_logits, params)
    x = q.argmax(-1) if params.is_greedy else torch.multinomial(
        q.reshape(-1, vocab), 1, generator=g).reshape(rows, k)
    lengths = torch.randint(0, k + 1, (rows,), generator=g)
    x = torch.where(torch.arange(k)[None, :] < lengths[:, None], x, -1)
    return p, x, q


@pytest.mark.parametrize("point_mass", [False, True])
def test_greedy_rows_get_the_token_laws_tokens(point_mass):
    rule = greedy_shortcut(DraftModel.__new__(DraftModel), parse_method("token"))
    token = parse_method("token").chain_law
    for seed in range(20):
        p, x, q = _chain(32, 5, 300, seed, GREEDY)
        q = None if point_mass else q
        streams = RowStreams.from_seed(seed, 32)
        want = token(p, x, q, check=True).draw(streams)
        got = rule(p, x, q, streams)
        assert torch.equal(got.tokens, want.tokens)
        assert torch.equal(got.num_accepted, want.num_accepted)
        assert 0 < int(want.num_accepted.sum()) < int((x >= 0).sum())  # accepts and rejects


def test_the_shortcut_is_wrong_off_greedy_so_the_engine_gates_it():
    """At T = 1 greedy verification's tokens are not the token law's draws: the shortcut is
    taken only when every row is greedy (RowBatch.greedy)."""
    rule = greedy_shortcut(DraftModel.__new__(DraftModel), parse_method("token"))
    p, x, q = _chain(32, 5, 300, 0, SamplingParams(temperature=1))
    streams = RowStreams.from_seed(0, 32)
    want = parse_method("token").chain_law(p, x, q, check=True).draw(streams)
    assert not torch.equal(rule(p, x, q, streams).tokens, want.tokens)


class _UserDrafter:  # a user's drafter: its q is checked by the engine, no shortcut
    hidden_layers = None


@pytest.mark.parametrize(("drafter", "verify"), [
    (None, "token"), (DraftModel.__new__(DraftModel), "block"),
    (DraftModel.__new__(DraftModel), "traversal"), (DraftModel.__new__(DraftModel), "greedy"),
    (DraftModel.__new__(DraftModel), "lenient:0.5"), (_UserDrafter(), "token"),
    (DraftModel.__new__(DraftModel), lambda p, x, q, generator=None: None),
])
def test_no_shortcut_for_other_rules_and_checked_drafters(drafter, verify):
    assert greedy_shortcut(drafter, parse_verify(verify)) is None
