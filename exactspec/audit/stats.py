"""Statistical tests of sampled outcomes against an exact law: Pearson chi-square, power.

The threshold comes from a stated false-alarm rate alpha: the test rejects iff the p-value is
below alpha, i.e. iff the statistic exceeds the chi-square quantile chi2.isf(alpha, dof). Bins
whose expected count is small (< `min_expected`) are pooled so the chi-square approximation
holds; pooling depends only on the null law, never on the data. Any observation in a bin of
probability exactly zero is an impossible outcome and rejects outright (under the null it never
happens, so the false-alarm rate is unchanged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ALPHA = 1e-6  # default false-alarm rate of every statistical check
MIN_EXPECTED = 5.0  # bins expecting fewer counts than this are pooled


def _scipy_stats():
    """scipy.stats, imported on first use: it costs ~1 s, and the CLI imports this module."""
    from scipy import stats

    return stats


@dataclass(frozen=True)
class ChiSquare:
    """Result of one chi-square goodness-of-fit test."""

    statistic: float  # Pearson X^2 over the pooled bins (inf if an impossible outcome was seen)
    dof: int  # degrees of freedom: pooled bins - 1
    threshold: float  # reject when statistic > threshold: chi2.isf(alpha, dof)
    p_value: float  # P(X^2 >= statistic) under the null
    alpha: float  # the stated false-alarm rate
    samples: int  # number of observations
    impossible: int  # observations in bins of probability zero

    @property
    def rejected(self) -> bool:
        """True when the sample is inconsistent with the exact law at false-alarm rate alpha."""
        return self.p_value < self.alpha


def pool_bins(expected: torch.Tensor, min_expected: float = MIN_EXPECTED
              ) -> torch.Tensor:  # [bins] long: pooled group of each bin, -1 for zero-probability
    """Group bins so that every group expects at least `min_expected` counts (when possible).

    Bins at or above the bound stay alone; the small ones are pooled in increasing order of
    expectation, and a leftover pool still below the bound joins the smallest big bin.
    """
    expected = expected.to(torch.float64)
    group = torch.full(expected.shape, -1, dtype=torch.long)
    order = torch.argsort(expected)
    big = [int(i) for i in order if expected[i] >= min_expected]
    small = [int(i) for i in order if 0 < expected[i] < min_expected]
    for g, i in enumerate(big):
        group[i] = g
    next_group, acc = len(big), 0.0
    pending: list[int] = []
    for i in small:
        pending.append(i)
        acc += float(expected[i])
        if acc >= min_expected:
            group[pending] = next_group
            next_group, acc, pending = next_group + 1, 0.0, []
    if pending:  # a leftover pool below the bound
        group[pending] = 0 if big else (next_group - 1 if next_group > len(big) else next_group)
    return group


def chi_square(counts: torch.Tensor, probs: torch.Tensor, *, alpha: float = ALPHA,
               min_expected: float = MIN_EXPECTED) -> ChiSquare:
    """Test observed `counts` [bins] against the exact law `probs` [bins] (sums to 1)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} must be in (0, 1)")
    counts = counts.to(torch.float64)
    probs = probs.to(torch.float64).clamp(min=0.0)
    samples = int(counts.sum())
    expected = probs / probs.sum() * samples
    group = pool_bins(expected, min_expected)
    impossible = int(counts[group < 0].sum())
    groups = int(group.max()) + 1 if bool((group >= 0).any()) else 0
    keep = group >= 0
    obs = torch.zeros(max(groups, 1), dtype=torch.float64).index_add_(0, group[keep], counts[keep])
    exp = torch.zeros(max(groups, 1), dtype=torch.float64).index_add_(0, group[keep],
                                                                      expected[keep])
    dof = max(groups - 1, 0)
    statistic = float(((obs - exp) ** 2 / exp.clamp(min=1e-300)).sum())
    if impossible:
        return ChiSquare(math.inf, dof, _threshold(alpha, dof), 0.0, alpha, samples, impossible)
    if dof == 0:  # a single outcome is possible: the sample either matches it or is impossible
        return ChiSquare(0.0, 0, 0.0, 1.0, alpha, samples, 0)
    return ChiSquare(statistic, dof, _threshold(alpha, dof), float(_scipy_stats().chi2.sf(statistic, dof)),
                     alpha, samples, 0)


def _threshold(alpha: float, dof: int) -> float:
    return float(_scipy_stats().chi2.isf(alpha, dof)) if dof > 0 else 0.0


def power(null: torch.Tensor, alternative: torch.Tensor, samples: int, *,
          alpha: float = ALPHA, min_expected: float = MIN_EXPECTED) -> float:
    """Probability that `chi_square` rejects when the data really follow `alternative`.

    Noncentral chi-square approximation over the pooled bins: lambda = n * sum (a - p)^2 / p.
    Mass of the alternative on zero-probability bins is seen as impossible outcomes, so that
    part is exact: the test rejects unless none of the n draws lands there.
    """
    null = null.to(torch.float64).clamp(min=0.0)
    alternative = alternative.to(torch.float64).clamp(min=0.0)
    group = pool_bins(null * samples, min_expected)
    keep = group >= 0
    groups = int(group.max()) + 1 if bool(keep.any()) else 0
    p = torch.zeros(max(groups, 1), dtype=torch.float64).index_add_(0, group[keep], null[keep])
    a = torch.zeros(max(groups, 1), dtype=torch.float64).index_add_(0, group[keep],
                                                                    alternative[keep])
    escape = float(alternative[~keep].sum())  # chance a single draw is an impossible outcome
    never_impossible = (1.0 - min(escape, 1.0)) ** samples
    dof = max(groups - 1, 0)
    if dof == 0:
        return 1.0 - never_impossible
    lam = samples * float(((a - p) ** 2 / p.clamp(min=1e-300)).sum())
    chi_power = float(_scipy_stats().ncx2.sf(_threshold(alpha, dof), dof, lam)) if lam > 0 else alpha
    return 1.0 - never_impossible * (1.0 - chi_power)


def samples_for_power(null: torch.Tensor, alternative: torch.Tensor, *, target: float = 0.999,
                      alpha: float = ALPHA, start: int = 10, limit: int = 10**8) -> int:
    """Smallest sample size (to within 5%) whose `power` reaches `target`.

    Doubles from `start` until the power suffices, then bisects the last doubling.
    """
    hi = start
    while power(null, alternative, hi, alpha=alpha) < target:
        hi *= 2
        if hi > limit:
            raise ValueError(f"no sample size up to {limit} reaches power {target}: "
                             "the laws are too close")
    lo = hi // 2
    while hi - lo > max(1, hi // 20):
        mid = (lo + hi) // 2
        if power(null, alternative, mid, alpha=alpha) >= target:
            hi = mid
        else:
            lo = mid
    return hi


def bincount(ids: torch.Tensor, bins: int) -> torch.Tensor:  # [bins] float64
    """Counts of outcome ids [B] in [0, bins)."""
    return torch.bincount(ids, minlength=bins).to(torch.float64)
