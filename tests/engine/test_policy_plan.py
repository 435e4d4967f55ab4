"""The draft-length choice as a function (engine/plan.py `plan_lengths`): tables of acceptance
and costs in, each row's draft length out, the brute-force optimum of tokens per second over
every K and every number of drafting rows."""

from __future__ import annotations

import itertools

import pytest
import torch

from exactspec.engine.plan import plan_lengths

KC = 9  # K = 0..8


def _table(alphas, rooms, lags, draft, verify, outside, catch_up=0.0):
    return dict(alpha=torch.tensor(alphas, dtype=torch.float64),
                room=torch.tensor(rooms, dtype=torch.long),
                lag=torch.tensor(lags, dtype=torch.float64),
                draft=torch.tensor(draft, dtype=torch.float64),
                verify=torch.tensor(verify, dtype=torch.float64),
                outside=torch.tensor(outside, dtype=torch.float64), catch_up=catch_up)


def _brute(t) -> tuple[float, list[int]]:
    """The best rate over every K and every n most accepting rows drafting, and its lengths."""
    alpha, room, lag = t["alpha"].tolist(), t["room"].tolist(), t["lag"].tolist()
    b = len(alpha)
    order = sorted(range(b), key=lambda i: -alpha[i])  # stable: ties keep batch order
    best = (-1.0, [])
    for k, n in itertools.product(range(KC), range(1, b + 1)):
        used = [min(k, room[i]) if i in order[:n] else 0 for i in range(b)]
        a = [min(x, 1 - 1e-6) for x in alpha]
        tokens = b + sum((1 - a[i] ** (u + 1)) / (1 - a[i]) - 1 for i, u in enumerate(used))
        width, drafting = max(used), sum(u > 0 for u in used)
        cost = (width * float(t["draft"][drafting]) + float(t["verify"][width])
                + float(t["outside"][width]))
        horizon = max(sum(room) / b * b / tokens, 1.0)
        cost += t["catch_up"] * sum(lag[i] for i, u in enumerate(used) if u > 0) / horizon
        if tokens / cost > best[0] * (1 + 1e-12):
            best = (tokens / cost, used)
    return best


LINEAR = [0.010 + 0.001 * w for w in range(KC)]  # a target forward by draft positions K'
CASES = {
    # one row accepting nearly everything, drafts nearly free: the longest draft
    "free drafts": _table([0.98], [20], [0], [0, 1e-5], LINEAR, [0.002] * KC),
    # a draft position as dear as the target step: plain
    "dear drafts": _table([0.98], [20], [0], [0, 0.012], LINEAR, [0.002] * KC),
    # four rows of mixed acceptance and rooms, drafting cost growing with the rows drafting
    "mixed rows": _table([0.9, 0.6, 0.12, 0.9], [8, 2, 8, 1], [0, 0, 0, 0],
                         [0, 3e-4, 6e-4, 9e-4, 2e-3], LINEAR, [0.001] * KC),
    # a forward that gets dear with the width: a short draft
    "dear wide forwards": _table([0.8, 0.8], [30, 30], [0, 0], [0, 0.001, 0.0015],
                                 [0.010 * (1 + 0.5 * w) for w in range(KC)], [0.0] * KC),
    # the same rows, lagging far behind the drafter: catching up outweighs drafting
    "lagging rows": _table([0.9] * 4, [30] * 4, [400] * 4, [0, 0.01, 0.012, 0.014, 0.016],
                           [0.050, 0.060, 0.065, 0.070, 0.075, 0.080, 0.085, 0.09, 0.095],
                           [0.0] * KC, catch_up=0.001),
    # ... and caught up, the same batch drafts
    "caught up": _table([0.9] * 4, [30] * 4, [0] * 4, [0, 0.01, 0.012, 0.014, 0.016],
                        [0.050, 0.060, 0.065, 0.070, 0.075, 0.080, 0.085, 0.09, 0.095],
                        [0.0] * KC, catch_up=0.001),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_choice_is_the_brute_force_optimum_of_its_table(name):
    t = CASES[name]
    plan = plan_lengths(t["alpha"], t["room"], t["lag"], t["draft"], t["verify"], t["outside"],
                        t["catch_up"])
    rate, lengths = _brute(t)
    assert plan.rate(plan.best) == pytest.approx(rate, rel=1e-9)
    assert plan.lengths(plan.best).tolist() == lengths


def test_the_tables_turn_the_choice():
    """The cases above are not all one answer: cheap drafts draft long, dear ones not at all,
    a lag too long to catch up keeps a batch plain that drafts once caught up."""
    def chosen(name):
        t = CASES[name]
        plan = plan_lengths(t["alpha"], t["room"], t["lag"], t["draft"], t["verify"],
                            t["outside"], t["catch_up"])
        return plan.lengths(plan.best).tolist()

    assert chosen("free drafts") == [KC - 1]
    assert chosen("dear drafts") == [0]
    assert chosen("lagging rows") == [0] * 4 and max(chosen("caught up")) > 0
    assert chosen("mixed rows")[2] == 0  # the row accepting 12% does not draft
