"""The "auto" draft-length policy follows the analytic optimum of tokens per second."""

from __future__ import annotations

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
    pol.draft_cost = draft_cost
    pol.target_cost = dict(target_costs)
    return pol


def test_fixed_policy_is_fixed():
    assert DraftLengthPolicy(3, 2).choose().tolist() == [3, 3]


def test_auto_starts_at_four_until_costs_are_measured():
    assert DraftLengthPolicy("auto", 2).choose().tolist() == [4, 4]


def test_cheap_drafts_and_high_acceptance_draft_long_per_row():
    # row 0 accepts nearly everything, row 1 almost nothing; drafting is nearly free
    pol = _policy([500, 1], [5, 100], draft_cost=1e-5, target_costs={5: 0.010})
    k = pol.choose().tolist()
    assert k[0] == AUTO_MAX_DRAFT and k[1] == 1


def test_expensive_drafts_draft_short():
    # a draft as costly as the target gains nothing, whatever the acceptance
    pol = _policy([500], [5], draft_cost=0.010, target_costs={5: 0.010})
    assert pol.choose().tolist() == [0]


def test_useless_drafts_stop_but_are_probed():
    # nothing accepted and wider forwards cost more: plain decoding, with a probe now and then
    pol = _policy([0, 500], [200, 5], draft_cost=1e-4, target_costs={1: 0.010, 5: 0.014})
    chosen = [pol.choose().tolist() for _ in range(AUTO_PROBE_EVERY)]
    assert [c[0] for c in chosen] == [0] * (AUTO_PROBE_EVERY - 1) + [1]
    assert all(c[1] >= 4 for c in chosen)


def test_brute_force_optimum():
    alpha_counts = [(30, 10), (8, 8), (90, 3)]
    pol = _policy([a for a, _ in alpha_counts], [r for _, r in alpha_counts], 0.002,
                  {3: 0.010, 6: 0.013})
    chosen = pol.choose().tolist()
    for (acc, rej), k in zip(alpha_counts, chosen, strict=True):
        alpha = (acc + 1) / (acc + rej + 2)

        def rate(kk, alpha=alpha):
            target = 0.010 + (0.003 / 3) * (kk + 1 - 3)  # the line through the two widths
            return (1 - alpha ** (kk + 1)) / (1 - alpha) / (kk * 0.002 + target)

        assert k == max(range(AUTO_MAX_DRAFT + 1), key=rate)
