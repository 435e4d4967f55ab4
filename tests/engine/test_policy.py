"""The "auto" draft-length policy follows the analytic optimum of tokens per second."""

from __future__ import annotations

import itertools

import pytest
import torch

from exactspec.engine.policy import (
    AUTO_MAX_DRAFT,
    AUTO_PROBE_EVERY,
    DraftLengthPolicy,
    expected_tokens,
)


def test_expected_tokens_formula():
    a = torch.tensor([0.0, 0.5, 0.8])
    k = torch.tensor([3.0, 3.0, 1.0])
    assert torch.allclose(expected_tokens(a, k), torch.tensor([1.0, 1.875, 1.8]))


def _policy(accepted, rejections, draft_cost, target_costs):
    pol = DraftLengthPolicy("auto", len(accepted))
    pol.accepted = torch.tensor(accepted, dtype=torch.float64)
    pol.rejections = torch.tensor(rejections, dtype=torch.float64)
    rows = len(accepted)
    pol.draft_cost = {rows: draft_cost}  # measured at this many rows
    pol.target_cost = {(rows, w): t for w, t in target_costs.items()}
    return pol


def test_fixed_policy_is_fixed():
    assert DraftLengthPolicy(3, 2).choose().tolist() == [3, 3]


def test_auto_starts_at_four_until_costs_are_measured():
    assert DraftLengthPolicy("auto", 2).choose().tolist() == [4, 4]


def test_cheap_drafts_and_high_acceptance_draft_long():
    # drafting is nearly free: a row that accepts nearly everything drafts the most
    pol = _policy([500], [5], draft_cost=1e-5, target_costs={5: 0.010})
    assert pol.choose().tolist() == [AUTO_MAX_DRAFT]


def test_the_batch_shares_the_k_that_maximises_its_total_rate():
    # one row accepts nearly everything, one nothing: wider forwards still pay off for the batch
    pol = _policy([500, 0], [5, 200], draft_cost=1e-5, target_costs={1: 0.010, 5: 0.011})
    assert pol.choose().tolist() == [AUTO_MAX_DRAFT, AUTO_MAX_DRAFT]
    # ... unless the rows that gain are too few for the cost of the wider forward
    pol = _policy([500] + [0] * 7, [5] + [200] * 7, draft_cost=1e-5,
                  target_costs={1: 0.010, 5: 0.030})
    assert pol.choose().tolist() == [0] * 8


def test_expensive_drafts_draft_short():
    # a draft as costly as the target gains nothing, whatever the acceptance
    pol = _policy([500], [5], draft_cost=0.010, target_costs={5: 0.010})
    assert pol.choose().tolist() == [0]


def test_useless_drafts_stop_but_are_probed():
    # nothing accepted and wider forwards cost more: plain decoding, with a probe now and then
    pol = _policy([0], [200], draft_cost=1e-4, target_costs={1: 0.010, 5: 0.014})
    chosen = [pol.choose().tolist() for _ in range(AUTO_PROBE_EVERY)]
    assert chosen == [[0]] * (AUTO_PROBE_EVERY - 1) + [[1]]


def test_brute_force_optimum():
    alpha_counts = [(30, 10), (8, 8), (90, 3)]
    pol = _policy([a for a, _ in alpha_counts], [r for _, r in alpha_counts], 0.002,
                  {3: 0.010, 6: 0.013})
    chosen = pol.choose().tolist()

    def rate(kk):
        target = 0.010 + (0.003 / 3) * (kk + 1 - 3)  # the line through the two widths
        total = sum((1 - a ** (kk + 1)) / (1 - a)
                    for a in ((acc + 1) / (acc + rej + 2) for acc, rej in alpha_counts))
        return total / (kk * 0.002 + target)

    best = max(range(AUTO_MAX_DRAFT + 1), key=rate)
    assert chosen == [best] * 3


def test_one_measured_width_does_not_make_wider_forwards_look_free():
    # alpha ~0.86 (prompt lookup on a copy task) with only width 5 measured: the old rule took
    # every width as costing what width 5 did and jumped to the widest draft
    pol = _policy([86], [13], draft_cost=1e-5, target_costs={5: 0.010})
    assert pol._target_cost(1, 9) > pol._target_cost(1, 5) > pol._target_cost(1, 1)
    alpha = 87 / 101

    def rate(kk):
        return ((1 - alpha ** (kk + 1)) / (1 - alpha)) / (kk * 1e-5 + 0.010 * (0.5 + 0.5 * (kk + 1) / 5))

    best = max(range(AUTO_MAX_DRAFT + 1), key=rate)
    assert best < AUTO_MAX_DRAFT
    assert pol.choose().tolist() == [best]
    # a row accepting nearly everything still drafts the most
    assert _policy([500], [5], 1e-5, {5: 0.010}).choose().tolist() == [AUTO_MAX_DRAFT]


def test_rows_that_cannot_use_drafts_do_not_pay_for_a_wide_forward():
    # eight rows accepting 95%; seven have no room left for drafts (about to hit their budget):
    # the wide forward would serve one row, so nobody drafts. Counting every row as gaining
    # (one K for the batch, blind to rooms) chose K = 5 here.
    pol = _policy([95] * 8, [4] * 8, draft_cost=1e-5, target_costs={1: 0.010, 5: 0.030})
    room = torch.tensor([0] * 7 + [8])
    assert pol.choose(room).tolist() == [0] * 8
    assert pol.choose(torch.full((8,), 8)).tolist() == [5] * 8  # with room, all draft 5
    # one row alone drafts its own optimum, the same 5
    assert _policy([95], [4], 1e-5, {1: 0.010, 5: 0.030}).choose(torch.tensor([8])).tolist() == [5]


def test_per_row_lengths_are_capped_by_each_rows_room_and_brute_force_optimal():
    alpha_counts = [(90, 3), (60, 20), (5, 40), (90, 3)]
    room = torch.tensor([8, 2, 8, 1])
    pol = _policy([a for a, _ in alpha_counts], [r for _, r in alpha_counts], 5e-4,
                  {1: 0.010, 9: 0.013})
    chosen = pol.choose(room).tolist()
    alphas = [(acc + 1) / (acc + rej + 2) for acc, rej in alpha_counts]

    def rate(kk):
        used = [min(kk, int(r)) for r in room]
        width = max(used)
        cost = width * 5e-4 + 0.010 + (0.003 / 8) * width  # the line through widths 1 and 9
        return sum((1 - a ** (u + 1)) / (1 - a) for a, u in zip(alphas, used, strict=True)) / cost

    best = max(range(AUTO_MAX_DRAFT + 1), key=rate)
    assert best > 2  # the rows with room draft beyond the others' caps
    assert chosen == [min(best, int(r)) for r in room]


def test_first_measurements_and_catch_up_steps_are_not_costs():
    """A width's first forward (lazy set-up) and a draft right after a plain step (catch-up)
    or an admission (the new rows' prefill) would each poison the estimates; none is counted.
    An estimate is the median of the recent measurements: one slow step does not move it."""
    pol = DraftLengthPolicy("auto", 1)
    pol.observe_costs(0.090, 4, 0.500, 5)  # first draft and first width-5 forward: dropped
    assert not pol.draft_cost and (1, 5) not in pol.target_cost
    pol.observe_costs(0.048, 4, 0.070, 5)
    assert pol.draft_cost[1] == 0.012 and pol.target_cost[(1, 5)] == 0.070
    pol.observe_costs(0.0, 0, 1.900, 1)  # first width-1 forward: dropped
    pol.observe_costs(0.0, 0, 0.045, 1)
    assert pol.target_cost[(1, 1)] == 0.045
    pol.observe_costs(0.400, 4, 0.070, 5)  # drafting after a plain step: catch-up, not counted
    assert pol.draft_cost[1] == 0.012
    pol.observe_costs(0.056, 4, 0.070, 5)
    assert pol.draft_cost[1] == pytest.approx(0.013)  # the median of 0.012 and 0.014
    pol.admit(1)
    pol.observe_costs(0.900, 4, 0.070, 5)  # the first draft after an admission: not counted
    assert pol.draft_cost[1] == pytest.approx(0.013)
    pol.observe_costs(2.000, 4, 0.070, 5)  # one very slow step (a busy machine): the median
    assert pol.draft_cost[1] == pytest.approx(0.014)  # of 0.012, 0.014, 0.5
    pol.observe_costs(0.048, 4, 0.070, 5)
    pol.observe_costs(0.048, 4, 0.070, 5)
    assert pol.draft_cost[1] == pytest.approx(0.012)


def test_costs_are_per_row_count_and_plain_wins_where_the_forward_is_compute_bound():
    """Measured (rows, width) costs: one row pays for drafting (a width-5 forward costs 1.3x
    a width-1 one), sixteen rows do not (it costs 4x there); the same acceptance, two answers.
    Unmeasured row counts are read from the measured ones by tokens (rows x width)."""
    pol = DraftLengthPolicy("auto", 16)
    pol.accepted, pol.rejections = torch.full((16,), 70.0), torch.full((16,), 30.0)
    pol.draft_cost = {1: 0.004, 16: 0.010}
    pol.target_cost = {(1, 1): 0.030, (1, 5): 0.040, (16, 1): 0.060, (16, 5): 0.240}
    assert pol.choose(rows=16).tolist() == [0] * 16
    one = DraftLengthPolicy("auto", 1)
    one.accepted, one.rejections = torch.tensor([70.0]), torch.tensor([30.0])
    one.draft_cost, one.target_cost = pol.draft_cost, pol.target_cost
    assert one.choose(rows=1).tolist()[0] >= 2
    # 12 rows, never measured: between the two, along tokens; at 12 x 5 = 60 tokens the
    # forward is far dearer than at 12 x 1, so plain again
    assert pol._target_cost(12, 5) > 2.5 * pol._target_cost(12, 1)
    twelve = DraftLengthPolicy("auto", 12)
    twelve.accepted, twelve.rejections = torch.full((12,), 70.0), torch.full((12,), 30.0)
    twelve.draft_cost, twelve.target_cost = pol.draft_cost, pol.target_cost
    twelve.steps = 1  # not a step that measures plain's cost
    assert twelve.choose(rows=12).tolist() == [0] * 12


def test_probes_back_off_while_plain_keeps_winning():
    pol = _policy([0], [200], draft_cost=1e-4, target_costs={1: 0.010, 5: 0.014})
    chosen = [pol.choose().tolist()[0] for _ in range(AUTO_PROBE_EVERY * 9)]
    starts = [i for i, k in enumerate(chosen) if k and not (i and chosen[i - 1])]
    assert all(chosen[i + 1] == 1 for i in starts)  # a probe drafts two steps: one is costed
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps == sorted(gaps) and gaps[-1] >= 4 * AUTO_PROBE_EVERY
