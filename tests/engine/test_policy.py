"""The "auto" draft-length policy follows the analytic optimum of tokens per second."""

from __future__ import annotations

import itertools

import pytest
import torch

from exactspec.engine.plan import expected_tokens
from exactspec.engine.policy import (
    AUTO_MAX_DRAFT,
    AUTO_PROBE_EVERY,
    POOL_MAX,
    DraftLengthPolicy,
)


def test_expected_tokens_formula():
    a = torch.tensor([0.0, 0.5, 0.8])
    k = torch.tensor([3.0, 3.0, 1.0])
    assert torch.allclose(expected_tokens(a, k), torch.tensor([1.0, 1.875, 1.8]))


def _policy(accepted, rejections, draft_cost, target_costs):
    pol = DraftLengthPolicy("auto", len(accepted))
    pol.accepted = torch.tensor(accepted, dtype=torch.float64)
    pol.rejections = torch.tensor(rejections, dtype=torch.float64)
    rows = max(len(accepted), 1)
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
    # one row accepts nearly everything, one nothing: wider forwards still pay off for the
    # batch, and the row accepting nothing drafts nothing (its draft positions cost, one row
    # drafting is cheaper than two, and gain nothing)
    pol = _policy([500, 0], [5, 200], draft_cost=1e-5, target_costs={1: 0.010, 5: 0.011})
    assert pol.choose().tolist() == [AUTO_MAX_DRAFT, 0]
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
    """Per row: the n most accepting rows draft min(K, room), the others nothing; (K, n)
    maximise the batch's rate. Brute force over both, with the draft cost read for n drafting
    rows from the one measured at four (y0 (0.5 + 0.5 n / 4)): the row accepting 12% stops."""
    alpha_counts = [(90, 3), (60, 20), (5, 40), (90, 3)]
    room = torch.tensor([8, 2, 8, 1])
    pol = _policy([a for a, _ in alpha_counts], [r for _, r in alpha_counts], 5e-4,
                  {1: 0.010, 9: 0.013})
    chosen = pol.choose(room).tolist()
    alphas = [(acc + 1) / (acc + rej + 2) for acc, rej in alpha_counts]
    order = sorted(range(4), key=lambda i: -alphas[i])  # stable: ties keep batch order

    def lengths(kk, n):
        return [min(kk, int(room[i])) if i in order[:n] else 0 for i in range(4)]

    def rate(kk, n):
        used = lengths(kk, n)
        width, drafting = max(used), sum(u > 0 for u in used)
        per_position = 5e-4 * (0.5 + 0.5 * drafting / 4) if drafting else 0.0
        cost = width * per_position + 0.010 + (0.003 / 8) * width  # the line through 1 and 9
        return sum((1 - a ** (u + 1)) / (1 - a) for a, u in zip(alphas, used, strict=True)) / cost

    best = max(((kk, n) for kk in range(AUTO_MAX_DRAFT + 1) for n in range(1, 5)),
               key=lambda kn: rate(*kn))
    assert best[0] > 2  # the rows with room draft beyond the others' caps
    assert chosen == lengths(*best)
    assert chosen[2] == 0 and chosen[0] > 2  # the row accepting 12% does not draft


def test_first_measurements_and_catch_up_steps_are_not_costs():
    """A width's first forward (lazy set-up) and a draft for rows the drafter lags on (after a
    plain step, or an admission: their prompts) would each poison the draft cost; none is
    counted (a catch-up measures the seconds per caught-up token instead). An estimate is the
    median of the recent measurements: one slow step does not move it."""
    pol = DraftLengthPolicy(4, 0)
    pol.admit(1, [6])  # the drafter has not seen the prompt

    def step(drafted, draft_s, target_s, width):
        want = pol.choose()
        assert want.tolist() == [4] * len(want)
        d = torch.full((len(want),), drafted)
        pol.observe(d, d)  # every draft kept
        pol.observe_costs(draft_s, drafted, target_s, width, len(want))

    step(4, 0.900, 0.500, 5)  # the prompt's catch-up (and the first width-5 forward: dropped)
    assert not pol.draft_cost and pol.catch_up_cost is None and not pol.target_cost
    step(4, 0.090, 0.070, 5)  # the first draft: dropped
    assert not pol.draft_cost and pol.target_cost[(1, 5)] == 0.070
    step(4, 0.048, 0.070, 5)
    assert pol.draft_cost[1] == 0.012 and pol.target_cost[(1, 5)] == 0.070
    step(0, 0.0, 1.900, 1)  # plain steps (first width-1 forward dropped): the drafter lags
    step(0, 0.0, 0.045, 1)
    assert pol.target_cost[(1, 1)] == 0.045 and pol.lag.tolist() == [2]
    step(4, 0.400, 0.070, 5)  # drafting after plain steps: catch-up, not a draft cost
    assert pol.draft_cost[1] == 0.012 and pol.catch_up_cost is None  # (its first: dropped)
    step(4, 0.056, 0.070, 5)
    assert pol.draft_cost[1] == pytest.approx(0.013)  # the median of 0.012 and 0.014
    pol.admit(1, [3])  # into a drafting batch: the drafter prefills the prompt at once
    assert pol.lag.tolist() == [0, 0]
    pol.select(torch.tensor([0]))
    step(0, 0.0, 0.045, 1)  # a plain step: row 0 lags by its token, and a row admitted
    pol.admit(1, [10])  # now is not fed to the drafter: it lags by its prompt
    assert pol.lag.tolist() == [1, 10]
    step(4, 0.900, 0.070, 5)  # two rows draft, lagging by 11 tokens: a catch-up
    assert 2 not in pol.draft_cost
    # (0.9 s - 4 positions at two rows, read from one row's 0.013 s) / 11 lagging tokens
    assert pol.catch_up_cost == pytest.approx((0.900 - 4 * 0.013 * 1.5) / 11)
    pol.select(torch.tensor([0]))
    step(4, 2.000, 0.070, 5)  # one very slow step (a busy machine): the median
    assert pol.draft_cost[1] == pytest.approx(0.014)  # of 0.012, 0.014, 0.5
    step(4, 0.048, 0.070, 5)
    step(4, 0.048, 0.070, 5)
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


def test_a_new_row_starts_from_the_acceptance_pooled_over_earlier_rows():
    """One stream: each request is a new row. With an even guess (alpha 1/2) for it, drafting
    does not pay at these costs (c = 0.3, w(5) = 1.5), so a fresh row decoded plain until its
    own probes had shown otherwise; starting from what earlier rows accepted, it drafts at once."""
    costs = {1: 0.040, 2: 0.052, 5: 0.060, 9: 0.080}
    fresh = _policy([0], [0], draft_cost=0.012, target_costs=costs)
    assert fresh.choose().tolist() == [0]
    for pool, drafts in (([95.0, 5.0], True), ([10.0, 90.0], False)):  # earlier rows' counts
        pol = _policy([], [], draft_cost=0.012, target_costs=costs)
        pol.pool = pool
        pol.admit(1)
        chosen = pol.choose().tolist()
        assert chosen[0] >= 4 if drafts else chosen == [0]


def test_the_pool_follows_observations_and_forgets_old_ones():
    pol = DraftLengthPolicy("auto", 2)
    pol.observe(torch.tensor([4.0, 4.0]), torch.tensor([4.0, 1.0]))
    assert pol.pool == [5.0, 1.0]
    for _ in range(200):
        pol.observe(torch.tensor([4.0, 4.0]), torch.tensor([0.0, 0.0]))
    assert sum(pol.pool) <= POOL_MAX + 1e-9 and pol.pool[0] < 0.1 * pol.pool[1]


def _loaded(rows=16, draft=0.01, verify=0.120):
    """Many rows that accept nothing: plain wins (drafting could, were every draft accepted);
    row 5 is the one the drafter lags least on."""
    pol = _policy([0] * rows, [200] * rows, draft_cost=draft,
                  target_costs={1: 0.100, 2: verify})
    pol.draft_cost = {rows: draft}
    pol.lag = torch.full((rows,), 50.0, dtype=torch.float64)
    pol.lag[5] = 3.0
    return pol


def test_a_probe_drafts_one_token_for_the_least_lagging_row_only():
    pol = _loaded()
    room = torch.full((16,), 30)
    chosen = [pol.choose(room) for _ in range(AUTO_PROBE_EVERY)]
    assert all(c.sum() == 0 for c in chosen[:-1])
    one_hot = torch.zeros(16, dtype=torch.long)
    one_hot[5] = 1
    assert torch.equal(chosen[-1], one_hot)
    pol.observe(chosen[-1], torch.zeros(16))  # row 5 caught up, the others lag one more
    assert torch.equal(pol.choose(room), one_hot)  # the probe's second step: the same row
    room[5] = 0  # a row without room is never probed
    pol.lag[7] = 0.0
    pol._since_probe, pol._probing = pol.probe, 0
    assert pol.choose(room).nonzero().flatten().tolist() == [7]


def test_a_probes_draft_cost_is_the_cost_of_the_rows_that_drafted():
    """A probe drafts for one row of sixteen: its cost is one row's, kept apart from the
    sixteen-row cost (filing it there made a full batch look as cheap to draft as one row)."""
    pol = _loaded()
    drafting_steps = 0
    for _ in range(1000):  # until two probes (each: a catch-up step, a measured one) ran
        if drafting_steps == 4:
            break
        want = pol.choose()
        drafting_steps += int(want.max())
        pol.observe(want, torch.zeros(16))
        pol.observe_costs(0.015 * int(want.max()), int(want.max()), 0.1 + 0.02 * int(want.max()),
                          1 + int(want.max()), 16)
    assert pol.draft_cost == {16: 0.01, 1: 0.015}


def test_no_probe_where_drafting_could_not_win_even_accepting_everything():
    """16 rows where one drafting position costs twice a plain step: even with every draft
    accepted drafting loses, so no probe is taken (each made 16 rows' verify two wide for
    nothing: 0.89x plain at 16 streams); where it could win, probes go on."""
    pol = _loaded(draft=0.2, verify=0.200)
    assert all(int(pol.choose().max()) == 0 for _ in range(10 * AUTO_PROBE_EVERY))
    pol = _loaded()
    assert any(int(pol.choose().max()) > 0 for _ in range(2 * AUTO_PROBE_EVERY))


def test_catching_a_lagging_batch_up_is_paid_before_drafting():
    """Four rows accepting 90%: drafting pays per step (1.3x here), but the drafter has not
    seen 400 tokens of each row (they decoded plain); catching them up costs more than the
    drafting would gain over the rows' remaining 30 tokens, so the batch stays plain. With
    the drafter caught up, the same batch drafts."""
    pol = _policy([90] * 4, [10] * 4, draft_cost=0.010,
                  target_costs={1: 0.050, 2: 0.060, 5: 0.080})
    room = torch.full((4,), 30)
    assert pol.choose(room).tolist()[0] > 0
    pol.catch_up_cost = 0.001  # seconds per caught-up token (measured)
    pol.lag = torch.full((4,), 400.0, dtype=torch.float64)
    assert pol.choose(room).tolist() == [0] * 4
    pol.lag.zero_()
    assert pol.choose(room).tolist()[0] > 0


def test_a_drafting_batch_measures_the_next_wider_verify_once():
    """Widths are measured only when used, and the line through the narrower ones overstates
    a wider one on CPUs (w(5) = 1.64, w(8) = 1.78 here): every AUTO_PROBE_EVERY steps a
    drafting batch drafts one more token where that width was never measured; once measured,
    the costs decide (kept if it was cheaper than the guess, dropped if not)."""
    pol = _policy([95], [5], draft_cost=0.012, target_costs={1: 0.036, 5: 0.059})
    best = pol.choose().tolist()[0]
    assert 0 < best < AUTO_MAX_DRAFT - 1
    pol.steps = AUTO_PROBE_EVERY - 1
    assert pol.choose().tolist() == [best + 1]
    guess = pol._target_cost(1, best + 2)
    pol.target_cost[(1, best + 2)] = guess  # measured: as the line said
    pol.steps = AUTO_PROBE_EVERY - 1
    assert pol.choose().tolist() == [best]
    pol.target_cost[(1, best + 2)] = pol._target_cost(1, best + 1)  # measured: no dearer
    assert pol.choose().tolist()[0] >= best + 1


def test_the_steps_overhead_is_measured_between_choices_and_favours_fewer_steps(monkeypatch):
    """Verification, sampling and the server's loop cost every step the same: plain decoding
    pays them per token, drafting per step. Measured on a stand-in clock: the time between two
    choices less the step's draft and target seconds (median; the first measurement dropped)."""
    import exactspec.engine.policy as policy_module

    now = [100.0]
    monkeypatch.setattr(policy_module.time, "perf_counter", lambda: now[0])
    # alpha 0.6 at c = 0.5: without overhead plain wins, by little
    pol = _policy([60], [40], draft_cost=0.020, target_costs={1: 0.040, 2: 0.044, 3: 0.048})
    assert pol.choose().tolist() == [0]
    for _ in range(3):  # steps of 40 ms in the target and 30 ms elsewhere
        pol.observe_costs(0.0, 0, 0.040, 1)
        now[0] += 0.070
        pol.choose()
    assert pol.overhead == pytest.approx(0.030)
    assert pol.choose().tolist()[0] > 0


def test_plain_is_measured_where_it_could_turn_the_choice_not_where_drafting_clearly_wins():
    """Every AUTO_PROBE_EVERY steps a drafting batch whose plain cost at this row count is a
    guess took one plain step to measure it; one stream drafting at 0.95 paid that in its
    first answer for nothing (drafting's rate is far above plain's guessed one). Now only a
    close call (here alpha 0.6, c = 0.4: K = 1 beats the guessed plain by 7%) measures."""
    costs = {5: 0.059, 6: 0.062}  # one row; width 1 never measured
    clear = _policy([95], [5], draft_cost=0.012, target_costs=costs)
    clear.steps = AUTO_PROBE_EVERY - 1
    assert clear.choose().tolist()[0] >= 4
    close = _policy([60], [40], draft_cost=0.020, target_costs=costs)
    assert close.choose().tolist() == [1]
    close.steps = AUTO_PROBE_EVERY - 1
    assert close.choose().tolist() == [0]


def test_under_load_plain_is_measured_first_and_drafting_first_measured_by_a_probe():
    """From PLAIN_FIRST_ROWS rows a batch decodes plain until plain's step is measured near its
    row count (a plain step loses nothing against plain serving; guessed from a verify's cost
    it looked 2x dearer at 64 rows); then drafting, unmeasured, is measured by one row drafting
    one token, not every row drafting K (two such steps cost 3 s of a 14 s run at 64 rows).
    Below that row count the start is as before (fixed K until measured)."""
    from exactspec.engine.policy import PLAIN_FIRST_ROWS

    pol = DraftLengthPolicy("auto", 64)
    pol.accepted, pol.rejections = torch.full((64,), 90.0), torch.full((64,), 10.0)
    assert pol.choose(rows=64).tolist() == [0] * 64  # plain: nothing measured
    pol.target_cost[(60, 1)] = 0.13  # measured within a quarter of 64 rows
    want = pol.choose(rows=64)
    assert int(want.sum()) == 1 and int(want.max()) == 1  # a probe: one row, one token
    pol = DraftLengthPolicy("auto", 64)
    pol.target_cost[(40, 1)] = 0.09  # far from 64 rows: plain again
    assert pol.choose(rows=64).tolist() == [0] * 64
    few = PLAIN_FIRST_ROWS - 1
    assert DraftLengthPolicy("auto", few).choose(rows=few).tolist() == [4] * few


def test_the_overhead_is_kept_per_verify_width_so_plain_is_not_charged_a_wide_verify(
        monkeypatch):
    """Verification and sampling grow with rows x width (top-p sorts every position: 0.21 s a
    step at 64 rows x 5 against 0.03 s at 64 x 1). One overhead for every step charged plain
    the wide verify's and made drafting 64 rows look faster; per (rows, width) it does not."""
    import exactspec.engine.policy as policy_module

    now = [100.0]
    monkeypatch.setattr(policy_module.time, "perf_counter", lambda: now[0])
    pol = DraftLengthPolicy("auto", 64)
    pol.accepted, pol.rejections = torch.full((64,), 96.0), torch.full((64,), 4.0)
    pol.draft_cost = {64: 0.155}
    pol.target_cost = {(64, 1): 0.133, (64, 5): 0.58}
    pol.choose(rows=64)
    pol.overhead, pol.overheads = 0.02, {(64, 1): 0.19}  # a server: plain measured here only
    assert pol._overhead(64, 5) >= 0.19  # not the all-steps median for the wide verify
    assert pol.choose(rows=64).tolist() == [0] * 64
    pol.overheads = {}
    for width, outside in [(5, 0.26), (5, 0.26), (5, 0.26), (1, 0.03), (1, 0.03), (1, 0.03)]:
        pol.observe_costs(0.6 if width > 1 else 0.0, 4 if width > 1 else 0,
                          pol.target_cost[(64, width)], width, 64)
        now[0] += (0.6 if width > 1 else 0.0) + pol.target_cost[(64, width)] + outside
        pol.choose(rows=64)
    assert pol.overheads[(64, 1)] == pytest.approx(0.03)
    assert pol.overheads[(64, 5)] == pytest.approx(0.26)
    assert pol._overhead(64, 3) == pytest.approx(0.145)  # along the measured widths
    assert pol.choose(rows=64).tolist() == [0] * 64
    # the wrong variant, one overhead for every step (the widest's), drafts
    monkeypatch.setattr(DraftLengthPolicy, "_overhead", lambda self, rows, width: 0.26)
    assert int(pol.choose(rows=64).max()) > 0


def test_a_probes_cost_includes_its_wider_verification():
    """A one-row probe in 16 rows makes every row's verification and sampling two positions
    wide: its cost beyond plain is the draft, the wider forward and that outside time."""
    pol = DraftLengthPolicy("auto", 16)
    pol.target_cost = {(16, 1): 0.040}
    pol.overheads = {(16, 1): 0.010, (16, 2): 0.050}
    pol._probe_step, pol._probing = True, 0
    pol.observe_costs(0.007, 1, 0.050, 2, 16)
    assert pol._probe_cost == pytest.approx(0.007 + 0.010 + 0.040)


def test_an_admissions_prefill_is_kept_out_of_the_outside_time(monkeypatch):
    """A server admits between steps: the prefill is no step's cost. Counted in, it made plain
    steps look 0.3-2.4 s dearer (they took 0.05-0.15 s) and drafting win at 64 streams."""
    import exactspec.engine.policy as policy_module

    now = [100.0]
    monkeypatch.setattr(policy_module.time, "perf_counter", lambda: now[0])
    pol = DraftLengthPolicy("auto", 8)
    pol.choose(rows=8)
    for prefill in (0.0, 0.0, 0.9, 1.5):
        pol.observe_costs(0.0, 0, 0.050, 1, 8)
        now[0] += 0.050 + 0.010 + prefill
        pol.exclude(prefill)
        pol.choose(rows=8)
    assert pol.overheads[(8, 1)] == pytest.approx(0.010)


def test_a_wider_verify_measured_long_ago_is_measured_again():
    """A width is measured only while chosen: one slow measurement (width 5 at 36.6 ms against
    24.3 ms at width 4, a cold first call) kept one stream at K = 3 with alpha 0.999 for whole
    answers. Once a drafting batch's next wider measurement is AUTO_REFRESH choices old, it
    drafts one more token to measure it again (every AUTO_PROBE_EVERY steps)."""
    from exactspec.engine import policy as policy_module

    pol = _policy([990], [1], draft_cost=0.0098,
                  target_costs={1: 0.0258, 3: 0.0242, 4: 0.0243, 5: 0.0366})
    assert pol.choose().tolist() == [3]  # width 5 looks dear: K = 3
    pol.steps = AUTO_PROBE_EVERY - 1
    assert pol.choose().tolist() == [3]  # measured recently (choice 0): no refresh
    pol.steps = policy_module.AUTO_REFRESH + AUTO_PROBE_EVERY - 1
    assert pol.choose().tolist() == [4]  # old: width 5 is measured again
    pol.target_cost[(1, 5)], pol._measured_at[(1, 5)] = 0.0245, pol.steps  # measured again
    assert pol.choose().tolist()[0] >= 4  # the costs decide: wider now
    # the wrong variant, no refresh, keeps K = 3 at every later multiple of AUTO_PROBE_EVERY
    stuck = _policy([990], [1], draft_cost=0.0098,
                    target_costs={1: 0.0258, 3: 0.0242, 4: 0.0243, 5: 0.0366})
    refresh = policy_module.AUTO_REFRESH
    try:
        policy_module.AUTO_REFRESH = 10 ** 9
        stuck.steps = refresh + AUTO_PROBE_EVERY - 1
        assert stuck.choose().tolist() == [3]
    finally:
        policy_module.AUTO_REFRESH = refresh


def test_an_empty_batchs_wait_is_no_steps_outside_time(monkeypatch):
    """A server's batch empties between requests; the wait for the next one is not the last
    step's outside time (one idle second was measured as a 1,009 ms plain step overhead)."""
    import exactspec.engine.policy as policy_module

    now = [100.0]
    monkeypatch.setattr(policy_module.time, "perf_counter", lambda: now[0])

    def serve(empties: bool) -> float:
        pol = DraftLengthPolicy("auto", 1)
        pol.choose(rows=1)
        for idle in (0.0, 0.0, 1.0, 1.0, 1.0):
            pol.observe_costs(0.0, 0, 0.025, 1, 1)
            now[0] += 0.025 + 0.002
            if idle and empties:  # the request ended: the batch empties, then one is admitted
                pol.select(torch.zeros(0, dtype=torch.long))
                pol.admit(1)
            now[0] += idle
            pol.choose(rows=1)
        return pol.overheads[(1, 1)]

    assert serve(empties=True) == pytest.approx(0.002)
    assert serve(empties=False) == pytest.approx(1.002)  # a batch that stays: it is measured
