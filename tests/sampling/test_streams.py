"""Random streams: uniform, reproducible per row, independent of the batch around a row."""

import torch
from scipy import stats

from exactspec.sampling import RowStreams, sample, sample_from_weights


def test_uniformity_ks():
    """KS test at false-alarm rate 1e-6: 200k draws of a correct U[0,1) pass with p >= 1e-6."""
    u = RowStreams.from_seed(7, 1000).uniform(200, domain=5).flatten().numpy()
    assert u.min() >= 0 and u.max() < 1
    assert stats.kstest(u, "uniform").pvalue >= 1e-6
    # the same test rejects a visibly biased source (power check)
    assert stats.kstest(u ** 1.05, "uniform").pvalue < 1e-6


def test_streams_depend_on_row_step_domain_only():
    s = RowStreams.from_seed(1, 5)
    a = s.uniform(4, domain=1)
    assert torch.equal(a[:, :2], s.uniform(2, domain=1))  # a column does not depend on n
    assert not torch.equal(a, s.uniform(4, domain=2))  # domains differ
    sub = s.select(torch.tensor([3]))
    assert torch.equal(sub.uniform(4, domain=1), a[3:4])
    s.advance()
    assert not torch.equal(a, s.uniform(4, domain=1))  # next step, new numbers
    assert not torch.equal(RowStreams.from_seed(2, 5).uniform(4, 1), a)


def test_inverse_cdf_never_picks_zero_weight():
    w = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0]] * 5)
    u = torch.tensor([0.0, 0.29999, 0.30001, 0.99999999, 0.5], dtype=torch.float64)
    assert sample_from_weights(w, u).tolist() == [1, 1, 3, 3, 3]
    tokens = sample(w / w.sum(-1, keepdim=True), torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) <= {1, 3}


def test_greedy_draw_is_the_inverse_cdf_draw_of_a_one_hot():
    """sample(greedy=True) on greedy p (one-hots from probs_from_logits) gives the token the
    inverse CDF gives, for any uniform; a torch.Generator still draws (its state moves as
    before). On a p that is not a one-hot the shortcut would differ: it is only for T = 0."""
    from exactspec.sampling import SamplingParams, probs_from_logits

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 500, generator=g) * 2
    logits[5, 7] = logits[5, 9] = logits[5].max() + 1  # a tie: the lowest id
    p = probs_from_logits(logits, SamplingParams(temperature=0))  # [64, 500] one-hots
    streams = RowStreams.from_seed(11, 64)
    fast = sample(p, streams, greedy=True)
    assert torch.equal(fast, sample(p, streams))
    assert fast[5] == 7
    a, b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert torch.equal(sample(p, a, greedy=True), sample(p, b))
    assert torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=b))
    soft = probs_from_logits(logits, SamplingParams(temperature=1))
    assert not torch.equal(sample(soft, streams, greedy=True), sample(soft, streams))


def test_cached_keys_give_the_uncached_bits_and_follow_every_change():
    """uniform() hashes a step's row keys once and a domain's columns once: the bits equal
    the four-mix formula's, and advancing (all rows or some), selecting rows, or changing a
    seed or a step in place gives the new step's numbers, not stale ones."""
    from exactspec.sampling.streams import _mix, _shr

    def direct(s: RowStreams, n: int, domain: int) -> torch.Tensor:
        cols = torch.arange(n, dtype=torch.long)
        key = _mix(s.seeds ^ _mix(s.steps))[:, None]
        z = _mix(key ^ _mix(cols[None, :] + (domain << 32)))
        return _shr(z, 11).to(torch.float64) * (1.0 / (1 << 53))

    s = RowStreams.from_seed(5, 6)
    for change in (lambda: None, lambda: s.advance(), lambda: s.advance(torch.tensor([1, 4])),
                   lambda: s.steps.__setitem__(2, 40), lambda: s.seeds.__setitem__(0, 99)):
        change()
        for n, domain in ((1, 3), (4, 64), (1, 65), (7, 1)):
            assert torch.equal(s.uniform(n, domain), direct(s, n, domain))
    sub = s.select(torch.tensor([5, 2]))
    assert torch.equal(sub.uniform(3, 2), direct(sub, 3, 2))
    with torch.inference_mode():  # the engine's mode: no version counters to lean on
        t = RowStreams.from_seed(8, 3)
        first = t.uniform(2, 1)
        t.advance()
        assert not torch.equal(t.uniform(2, 1), first)
        assert torch.equal(t.uniform(2, 1), direct(t, 2, 1))
