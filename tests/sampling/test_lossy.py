"""Lossy rules: exact one-step laws against their documented formulas, hand-computed cases,
parsing, and `is_lossless`."""

from __future__ import annotations

import math

import pytest
import torch

from exactspec.errors import InvalidValue
from exactspec.sampling import acceptance_law, is_lossless, parse_lossy, verify


def _one_step_law(p: torch.Tensor, q: torch.Tensor, method: str) -> torch.Tensor:
    """Exact law [V] of the first emitted token of one K=1 step, by enumerating the draft x."""
    v = p.shape[0]
    x = torch.arange(v)[:, None]  # every draft token, one row each
    target = p.expand(v, 2, v).contiguous()  # [V, 2, V]: p at the draft and the bonus position
    law = acceptance_law(target, x, q.expand(v, 1, v).contiguous(), method=method)
    rejected = law.residual(torch.zeros(v, dtype=torch.long)).double()  # [V, V]
    rejected = rejected / rejected.sum(-1, keepdim=True)
    accept = law.accept_probs[:, 1]  # [V]
    emitted = accept[:, None] * torch.eye(v, dtype=torch.float64) + (1 - accept)[:, None] * rejected
    return (q.double()[:, None] * emitted).sum(0)


def _random_pair(seed: int, v: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(v, generator=g, dtype=torch.float64) ** 3 + 1e-3
    q = torch.rand(v, generator=g, dtype=torch.float64) ** 3 + 1e-3
    return p / p.sum(), q / q.sum()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("lenience", [1.0, 0.8, 0.5, 0.2])
def test_lenient_one_step_law_is_the_documented_formula(seed, lenience):
    p, q = _random_pair(seed)
    got = _one_step_law(p, q, f"lenient:{lenience}")
    kept = torch.minimum(q, p / lenience)
    residual = (p - q).clamp(min=0)
    want = kept + (1 - kept.sum()) * residual / residual.sum()
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    if lenience == 1.0:  # the exact rule
        assert torch.allclose(got, p, atol=1e-12, rtol=0)
    else:  # accepts more than the exact rule, and drifts
        assert kept.sum() > torch.minimum(p, q).sum()
        assert 0.5 * (got - p).abs().sum() > 1e-3


def test_lenient_hand_computed():
    # p = (cat .5, dog .3, fish .2), q = (.2, .6, .2), L = 0.5: dog is accepted with
    # min(1, .3 / (.5 * .6)) = 1, so the step emits q itself (TV .3 from p)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)
    assert torch.allclose(_one_step_law(p, q, "lenient:0.5"), q, atol=1e-12, rtol=0)
    # L = 0.75: dog accepted with .3 / .45 = 2/3; kept = (.2, .4, .2); residual = cat alone
    got = _one_step_law(p, q, "lenient:0.75")
    assert torch.allclose(got, torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64), atol=1e-12)


def test_lenient_point_mass_accepts_with_p_over_l():
    p = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]])  # [1, 2, 3]
    law = acceptance_law(p, torch.tensor([[1]]), None, method="lenient:0.6")
    assert law.accept_probs[0].tolist() == pytest.approx([0.5, 0.5])  # min(1, .3 / .6)
    assert law.residual(torch.tensor([0]))[0].tolist() == pytest.approx([0.5, 0.0, 0.2])


def test_typical_hand_computed():
    p = torch.tensor([0.7, 0.2, 0.1])
    entropy = -sum(v * math.log(v) for v in (0.7, 0.2, 0.1))  # 0.8018 nats
    for eps, accepted in ((0.09, [1, 1, 1]), (0.15, [1, 1, 0]), (0.5, [1, 0, 0])):
        threshold = min(eps, math.sqrt(eps) * math.exp(-entropy))
        assert [int(float(v) >= threshold) for v in p] == accepted  # the case is as described
        target = p.expand(3, 2, 3).contiguous()
        law = acceptance_law(target, torch.arange(3)[:, None], None, method=f"typical:{eps}")
        assert law.accept_probs[:, 1].tolist() == accepted
        assert torch.equal(law.residual(torch.zeros(3, dtype=torch.long)), target[:, 0])


def test_typical_is_exact_for_greedy_targets():
    p = torch.zeros(4, 3, 5)
    p[torch.arange(4), :, torch.tensor([0, 2, 4, 1])] = 1.0  # one-hot targets  [4, 3, 5]
    x = torch.tensor([[0, 2], [1, 1], [4, 4], [1, 3]])
    greedy = acceptance_law(p, x, None, method="greedy")
    typical = acceptance_law(p, x, None, method="typical:0.09")
    assert torch.equal(typical.accept_probs, greedy.accept_probs)


def test_verify_draws_with_a_lossy_rule():
    p = torch.tensor([[[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]]]).expand(4, 2, 3).contiguous()
    q = torch.tensor([[[0.2, 0.6, 0.2]]]).expand(4, 1, 3).contiguous()
    out = verify(p, torch.tensor([[1]] * 4), q, method="lenient:0.5",
                 generator=[torch.Generator().manual_seed(i) for i in range(4)])
    assert out.num_accepted.tolist() == [1, 1, 1, 1]  # accepted with probability 1


def test_parsing_and_is_lossless():
    assert all(is_lossless(m) for m in ("token", "block", "greedy", "traversal"))
    assert not is_lossless("lenient:0.5") and not is_lossless("typical:0.09")
    assert not is_lossless(lambda *a, **k: None)  # a custom verify is not known to be exact
    assert parse_lossy("lenient:0.5").value == 0.5 and parse_lossy("token") is None
    for bad in ("lenient:0", "lenient:1.5", "lenient:x", "typical:1", "typical:", "mars:0.5",
                "tokens"):
        with pytest.raises(InvalidValue, match=r"verify=|unknown verify method"):
            parse_lossy(bad)
    with pytest.raises(InvalidValue, match="unknown verify method"):
        acceptance_law(torch.ones(1, 1, 2) / 2, torch.zeros(1, 0, dtype=torch.long),
                       method="bogus")
