"""Draft length: fixed, or "auto" per row from observed acceptance and measured step costs."""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Iterable

import torch

from exactspec.drafters.base import prefills_at_once
from exactspec.engine.plan import Plan, plan_lengths
from exactspec.engine.plan import outside_cost as _outside_cost
from exactspec.engine.plan import per_rows as _per_rows
from exactspec.engine.plan import verify_cost as _verify_cost

AUTO_MAX_DRAFT = 8  # the longest draft "auto" proposes
AUTO_PROBE_EVERY = 8  # a batch that stopped drafting still drafts one token after this many steps
AUTO_PROBE_MAX = 64  # ... the gap doubling while the answer stays plain, up to this
AUTO_COST_WINDOW = 9  # a cost estimate is the median of this many latest measurements
PRIOR_WEIGHT = 2.0  # pseudo-observations a row's acceptance starts from (the pooled estimate)
POOL_MAX = 256.0  # the pooled acceptance counts are scaled down past this many observations
# a probe is due only once the plain steps since the last one cost 1 / PROBE_SHARE times what
# that probe cost beyond plain steps (a torch draft's probe under load catches its row up in a
# forward padded to the whole batch): exploring costs at most this share of the time
PROBE_SHARE = 0.03
# unmeasured, a caught-up token costs this many one-row draft positions (a batched feed, as a
# prefill; docs/performance.md, "The draft-length policy's measurements")
CATCH_UP_PRIOR = 0.15
# plain's cost at a row count is measured (one plain step) unless drafting's rate beats plain's
# guessed rate by this factor (the guess would have to be that far off to turn the choice)
PLAIN_MARGIN = 1.5
# from this many rows a batch decodes plain until plain's step is measured near its row count
# (within a quarter): a plain step loses nothing against plain serving, while guessing plain's
# cost from a verify's (one point, half fixed) made it look far dearer under load than it was
PLAIN_FIRST_ROWS = 4
# a drafting batch re-measures the next wider verify once its latest measurement is this many
# choices old: a width is measured only while chosen, so one slow measurement (a busy machine,
# a cold first call) would keep wider drafts out for good
AUTO_REFRESH = 32


class DraftLengthPolicy:
    """Chooses each row's draft length before a step.

    Fixed: always `num_draft_tokens` (capped by each row's room). Auto, per row: row b keeps
    its own acceptance estimate alpha_b = (accepted + 2 a0) / (accepted + rejections + 2) (a
    rejection is a step that did not keep its whole draft), a0 the acceptance pooled over every
    row seen so far (the latest POOL_MAX observations; 1/2 before any): rows of one decoder draw
    from similar texts, so a new row starts from what the rows before it accepted, not from an
    even guess that kept one-stream serving plain for most of each answer. Row b's room r_b
    caps its drafts (its token budget and the context). The B rows share one forward, padded
    to the widest row, and one drafting pass of as many positions, so a step costs
    c = K' * draft_cost(n) + target_cost(B, K' + 1) + o with K' = max_b k_b, n the rows
    drafting and o
    the step's time outside both (verification, sampling, the caller's loop: the time between
    two choices less the measured parts, which plain decoding pays per token), whatever
    each row drafts below K'. Per row: the n rows of highest acceptance draft k_b = min(K, r_b)
    and the others none (within the shared width a row's drafts cost the verify nothing, but
    the draft's cost is measured by the number of rows drafting: a row accepting little is not
    worth its positions), and (K in 0..AUTO_MAX_DRAFT, n in 1..B) maximise the batch's tokens
    per second, sum_b expected_tokens(alpha_b, k_b) / (c + s): s, the switch, is the catch-up
    of the tokens the drafter has not seen
    (rows that decoded plain, prompts not yet drafted for: `lag`) at the measured seconds per
    caught-up token, spread over the steps the batch would keep drafting (its rows' mean room
    over the tokens a step emits). A row near its budget adds no gain for drafts it cannot
    emit. K = 0 is plain decoding, chosen whenever no K pays at this load.

    Costs are measured at the current number of rows and verify width, because that is what a
    server's load changes: a forward over B x (K+1) tokens is memory-bound for small B and
    compute-bound for large B, so drafting that pays for one row can cost for sixteen.
    target_cost(B, w) is the median of the latest measurements at (B, w); unmeasured, it is
    scaled from a width measured at the same B by a model of cost against tokens B * w
    (piecewise linear through every measurement, extended by its end segments; with one
    measurement t0 * (0.5 + 0.5 n / n0)), or read from that model alone. draft_cost(n)
    (seconds per draft position with n rows drafting) the same way along n.

    Exploration: while K = 0 wins, one row (the one the drafter lags least on) drafts one token
    for two steps every `probe` steps (doubling, up to AUTO_PROBE_MAX, while the answer stays
    0), so that the acceptance, the one-row draft cost and the width-2 forward keep being
    measured without catching the drafter up on the whole batch (the first step catches that
    row up, the second is measured); a probe is due only once the plain steps since the last
    one cost 1 / PROBE_SHARE times what that probe cost beyond plain steps, so exploring under
    load costs at most PROBE_SHARE of the time whatever a probe costs there. A drafting batch
    takes one plain step at a row count whose plain cost was never measured (unless drafting's
    rate beats plain's guessed one by PLAIN_MARGIN), or one more draft where that wider verify
    was never measured at this row count (so the chosen K climbs while wider forwards cost less
    than the line through the narrower ones said).

    Drafter state: rows admitted while the batch drafts for fewer than half its rows are not
    fed to the drafter (`prefills_at_once`, which DraftModel follows; llama.cpp feeds a row at
    its first draft anyway): they lag by their prompts, charged as above before drafting.
    """

    def __init__(self, num_draft_tokens: int | str, num_rows: int) -> None:
        self.auto = num_draft_tokens == "auto"  # adapt per row
        self.fixed = 4 if self.auto else int(num_draft_tokens)  # the fixed length, or the start
        self.accepted = torch.zeros(num_rows)  # [B] drafts kept so far
        self.rejections = torch.zeros(num_rows)  # [B] steps that rejected a draft
        self.lag = torch.zeros(num_rows, dtype=torch.float64)  # [B] tokens the drafter has not seen (not yet drafted)
        self.pool = [0.0, 0.0]  # accepted, rejections pooled over every row (the latest)
        self.draft_cost: dict[int, float] = {}  # drafting rows -> seconds per draft position
        self.target_cost: dict[tuple[int, int], float] = {}  # (rows, width) -> seconds
        self.catch_up_cost: float | None = None  # seconds per lagging token a draft catches up
        self.steps = 0  # choices made so far
        self.probe = AUTO_PROBE_EVERY  # steps between probes while K = 0 is chosen
        self._since_probe = 0  # K = 0 steps since the last probe
        self._observations: dict = {}  # "draft" / width -> measurements taken so far
        self._windows: dict = {}  # ("draft", rows) / (rows, width) -> recent measurements
        self._probing = 0  # drafting steps left in the current probe
        self._measured_at: dict[tuple[int, int], int] = {}  # (rows, width) -> choice measured at
        # draft lengths the next choices take whatever the costs say (Decoder.calibrate's
        # sweep over the widths), each capped by the rows' room; measured as any step
        self.forced: collections.deque[int] = collections.deque()
        # (rows drafting, their lag) of the step chosen last; None: not chosen here (trees)
        self._chosen: tuple[int, float] | None = None
        self.overhead = 0.0  # seconds a step spends outside the draft and the target forward
        # ... by (rows, verify width): verification and sampling grow with the positions (top-p
        # sorts each); one number for every width charged plain steps a wide verify's
        self.overheads: dict[tuple[int, int], float] = {}
        self._probe_step = False  # the step chosen last is a probe's
        self._probe_excess = 0.0  # seconds the current probe cost beyond plain steps so far
        self._probe_cost = 0.0  # ... and what the last whole probe cost
        # rows the latest step drafted for (None: no step yet): a drafter prefills admitted
        # rows at once only into a batch drafting for half its rows (`prefills_at_once`);
        # otherwise the rows lag by their prompts
        self._drafted_rows: int | None = None
        # (perf_counter at the last choice, its step's draft + target seconds, (rows, width))
        self._last = None
        self._excluded = 0.0  # seconds since the last choice that are no step's (admissions)
        # whether the drafter falls behind on rows it does not draft for (False: a drafter that
        # reads the target's cache never lags: no catch-up to charge); `drafter_lags` sets it
        self.lagging = True

    def alphas(self) -> torch.Tensor:  # [B] float64
        """Each row's acceptance estimate, starting from the pooled one."""
        pa, pr = self.pool
        prior = (pa + 1) / (pa + pr + 2)
        return ((self.accepted.double() + PRIOR_WEIGHT * prior)
                / (self.accepted.double() + self.rejections.double() + PRIOR_WEIGHT))

    def choose(self, room: torch.Tensor | None = None,
               rows: int | None = None) -> torch.Tensor:  # [B] -> [B] long
        """Each row's draft length; `room` ([B] long, default unbounded) caps row b's."""
        b = self.accepted.shape[0]
        rows = b if rows is None else rows
        room = torch.full((b,), AUTO_MAX_DRAFT if self.auto else self.fixed, dtype=torch.long) \
            if room is None else room.cpu().long().clamp(min=0)
        self.steps += 1
        self._time_overhead()
        self._probe_step = False
        want = self._before_costs(room, rows)
        return self._note(want if want is not None else self._by_costs(room, rows))

    def _before_costs(self, room: torch.Tensor, rows: int) -> torch.Tensor | None:  # [B]
        """The lengths while the costs cannot decide (forced lengths; under load, plain until
        plain is measured, then a probe until drafting is; the fixed length until both are
        measured), or None when they can."""
        b = room.shape[0]
        if self.forced:
            return torch.minimum(torch.full((b,), self.forced.popleft()), room)
        if self.auto and rows >= PLAIN_FIRST_ROWS and not self._plain_measured(rows):
            return torch.zeros(b, dtype=torch.long)
        if self.auto and rows >= PLAIN_FIRST_ROWS and not self.draft_cost:
            # drafting unmeasured under load: one row drafts one token (a probe), not every
            # row K (each such step is as dear as the whole batch drafting)
            return self._probe_row(room)
        if not self.auto or not self.draft_cost or not self.target_cost:
            return torch.minimum(torch.full((b,), self.fixed, dtype=torch.long), room)
        if not b:
            return torch.zeros(0, dtype=torch.long)
        return None

    def _by_costs(self, room: torch.Tensor, rows: int) -> torch.Tensor:  # [B] -> [B] long
        """The lengths the measured costs choose (`plan_lengths`), with the exploration."""
        kc = range(AUTO_MAX_DRAFT + 1)
        catch_up = self.catch_up_cost if self.catch_up_cost is not None \
            else CATCH_UP_PRIOR * self._draft_cost(1)
        plan = plan_lengths(
            self.alphas(), room, self.lag, self._draft_costs(room.shape[0]),
            torch.tensor([self._target_cost(rows, w + 1) for w in kc], dtype=torch.float64),
            torch.tensor([self._overhead(rows, w + 1) for w in kc], dtype=torch.float64),
            catch_up)
        k = plan.best
        if k == 0:
            return self._plain_or_probe(plan, room, rows)
        return plan.lengths(self._explore(plan, k, rows))

    def _plain_or_probe(self, plan: Plan, room: torch.Tensor, rows: int) -> torch.Tensor:
        """K = 0 wins: plain decoding, or a probe (one row drafts one token) when one is due."""
        if self._probing:  # a probe's second step: the one whose cost counts
            self._probing -= 1
            self._probe_step = True
            return self._probe_row(room)
        # could drafting win here at all: every drafting row accepting every draft (alpha 1)?
        # If not, a probe cannot turn the choice and none is taken
        if plan.ceiling() <= plan.rate(0):
            return torch.zeros(room.shape[0], dtype=torch.long)
        self._since_probe += 1
        plain = self._since_probe * (self._target_cost(rows, 1) + self._overhead(rows, 1))
        if self._since_probe >= self.probe and plain * PROBE_SHARE >= self._probe_cost:
            self._since_probe = 0  # a probe: one row drafts one token
            self.probe = min(2 * self.probe, AUTO_PROBE_MAX)
            self._probing = 1
            self._probe_step = True
            return self._probe_row(room)
        return plan.lengths(0)

    def _explore(self, plan: Plan, k: int, rows: int) -> int:
        """A drafting batch's K: the costs' `k`, but every AUTO_PROBE_EVERY steps plain where
        plain's cost is a guess that could turn the choice, or one draft more where that wider
        verify is unmeasured or stale (a line through the narrower ones overestimates it on
        CPUs), so that the costs then decide."""
        self.probe, self._since_probe, self._probing = AUTO_PROBE_EVERY, 0, 0
        self._probe_cost = 0.0
        near = self._plain_measured(rows)
        rates = plan.tokens / plan.cost  # [Kc]
        if self.steps % AUTO_PROBE_EVERY == 0:
            if not near and rates[k] < PLAIN_MARGIN * rates[0]:
                k = 0
            elif k < AUTO_MAX_DRAFT and self._stale((rows, int(plan.width[k + 1]) + 1)):
                k += 1
        return k

    def _stale(self, key: tuple[int, int]) -> bool:
        """Whether the verify cost at (rows, width) is unmeasured or AUTO_REFRESH choices old."""
        return key not in self.target_cost or \
            self.steps - self._measured_at.get(key, 0) >= AUTO_REFRESH

    def _plain_measured(self, rows: int) -> bool:
        """Whether a plain (width 1) step was measured at a row count within a quarter of
        `rows`."""
        return any(w == 1 and abs(b - rows) <= rows // 4 for b, w in self.target_cost)

    def _time_overhead(self) -> None:
        """The step's time outside drafting and the target forward (verification, sampling,
        bookkeeping, the caller's loop): between two choices, less the measured parts. Every
        step pays it once, so drafting, which takes fewer steps, saves it too."""
        now = time.perf_counter()
        if self._last is not None and self._last[1] is not None:
            value = max(now - self._last[0] - self._last[1] - self._excluded, 0.0)
            cost = self._median("overhead", value, "overhead")
            if cost is not None:
                self.overhead = cost
            key = self._last[2]
            cost = self._median(("overhead", key), value, ("overhead", key[1]))
            if cost is not None:
                self.overheads[key] = cost
        self._last = (now, None, None)
        self._excluded = 0.0

    def exclude(self, seconds: float) -> None:
        """Time since the last choice that is no step's cost (an admission's prefill): kept
        out of the next outside-time measurement (a server admits between steps; counted in,
        prefills made plain steps look many times dearer than they are)."""
        self._excluded += seconds

    def _overhead(self, rows: int, width: int) -> float:
        """A step's time outside the draft and the target forward (curves.outside_cost)."""
        return _outside_cost(self.overheads, self.overhead, rows, width)

    def _probe_row(self, room: torch.Tensor) -> torch.Tensor:  # [B] -> [B] long
        """One draft token for the row with room the drafter lags least on; none elsewhere."""
        want = torch.zeros_like(room)
        able = (room > 0).nonzero().flatten()
        if len(able):
            want[able[int(self.lag[able].argmin())]] = 1
        return want

    def _note(self, want: torch.Tensor) -> torch.Tensor:  # [B] long
        """Remember who drafts in the chosen step and how far behind the drafter is there."""
        on = want > 0
        self._chosen = (int(on.sum()), float(self.lag[on].sum()))
        return want

    def _target_cost(self, rows: int, width: int) -> float:
        return _verify_cost(self.target_cost, rows, width)

    def _draft_costs(self, rows: int) -> torch.Tensor:  # [rows + 1] float64
        """_draft_cost(n) for n = 0..rows drafting rows."""
        return torch.tensor([self._draft_cost(n) for n in range(rows + 1)], dtype=torch.float64)

    def _draft_cost(self, rows: int) -> float:
        return _per_rows(self.draft_cost, rows)

    def observe(self, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        """Per row: drafts proposed [B] and kept [B] in the last step."""
        drafted, accepted = drafted.cpu().double(), accepted.cpu().double()
        rejected = ((accepted < drafted) & (drafted > 0)).double()
        self.accepted += accepted
        self.rejections += rejected
        self._drafted_rows = int((drafted > 0).sum())
        pa, pr = self.pool[0] + float(accepted.sum()), self.pool[1] + float(rejected.sum())
        scale = min(1.0, POOL_MAX / max(pa + pr, 1.0))
        self.pool = [pa * scale, pr * scale]
        # a row that drafted is caught up (but for the routine last token or two); one that
        # did not lags by the token it emitted
        self.lag = torch.where(drafted > 0, torch.zeros_like(self.lag), self.lag + accepted + 1)
        if not self.lagging:
            self.lag.zero_()

    def observe_costs(self, draft_seconds: float, num_draft: int, target_seconds: float,
                      width: int, rows: int = 1) -> None:
        """One step's measured costs at `rows` rows; an estimate is the median of its last
        AUTO_COST_WINDOW measurements (one slow step on a busy machine moved an average for
        many steps). Two one-off costs are kept out: the first measurement of drafting and of
        each width is dropped (first calls pay for allocation and lazy set-up: a float32
        target's first one-row step builds its one-row weight copy), and a drafting step whose
        rows the drafter lagged on (after
        plain steps, or an admission) is a catch-up, not a draft cost: it measures the seconds
        per caught-up token instead (what the draft positions would have cost taken out)."""
        drafting, lag = self._chosen if self._chosen is not None else (rows, 0.0)
        self._chosen = None
        if self._probe_step:  # what the probe costs beyond the plain steps it replaces
            plain = self._target_cost(rows, 1) if self.target_cost else target_seconds
            # ... its wider verification and sampling included (a one-row probe makes every
            # row's verification wider, which the forwards alone do not explain)
            outside = max(self._overhead(rows, width) - self._overhead(rows, 1), 0.0)
            self._probe_excess += draft_seconds + max(target_seconds - plain, 0.0) + outside
            if not self._probing:
                self._probe_cost, self._probe_excess = self._probe_excess, 0.0
        if self._last is not None:
            self._last = (self._last[0], draft_seconds + target_seconds, (rows, width))
        if num_draft > 0 and drafting > 0 and lag > 0:
            if self.draft_cost:
                extra = draft_seconds - num_draft * self._draft_cost(drafting)
                cost = self._median("catch_up", max(extra, 0.0) / lag, "catch_up")
                if cost is not None:
                    self.catch_up_cost = cost
        elif num_draft > 0 and drafting > 0:
            cost = self._median(("draft", drafting), draft_seconds / num_draft, "draft")
            if cost is not None:
                self.draft_cost[drafting] = cost
        cost = self._median((rows, width), target_seconds, width)
        if cost is not None:
            self.target_cost[(rows, width)] = cost
            self._measured_at[(rows, width)] = self.steps

    def _median(self, key, value: float, first) -> float | None:
        """Record `value` under `key`; the median of its window, or None while `first` (a
        quantity) has no measurement but its dropped first one."""
        seen = self._observations.get(first, 0)
        self._observations[first] = seen + 1
        if seen == 0:
            return None  # the first measurement of a quantity is dropped
        window = self._windows.setdefault(key, collections.deque(maxlen=AUTO_COST_WINDOW))
        window.append(value)
        return statistics.median(window)

    def admit(self, num_rows: int, prompt_lengths: list[int] | None = None) -> None:
        """Append `num_rows` new rows with no observations yet. Into a batch whose latest
        step drafted for half its rows the drafter prefills them at once (no lag); otherwise it
        has not seen their prompts (`prompt_lengths`, default one token each), which it catches
        up when they first draft."""
        self.accepted = torch.cat([self.accepted, torch.zeros(num_rows)])
        self.rejections = torch.cat([self.rejections, torch.zeros(num_rows)])
        lags = torch.tensor(prompt_lengths, dtype=torch.float64) if prompt_lengths is not None \
            else torch.ones(num_rows, dtype=torch.float64)
        if not self.lagging or prefills_at_once(self._drafted_rows, len(self.accepted)):
            lags = torch.zeros(num_rows, dtype=torch.float64)
        self.lag = torch.cat([self.lag, lags])

    def select(self, rows: torch.Tensor) -> None:
        """Keep these rows. An empty batch waits for requests: that wait is no step's outside
        time (a server's idle time between two requests is no step's)."""
        rows = rows.cpu()
        if not len(rows):
            self._last = None
        self.accepted = self.accepted[rows]
        self.rejections = self.rejections[rows]
        self.lag = self.lag[rows]

    def force(self, lengths: Iterable[int]) -> None:
        """The next choices take these draft lengths, in order, whatever the costs say (each
        capped by the rows' room; `Decoder.calibrate`'s sweep over the widths); measured as any
        step. An empty `lengths` ends a sweep early."""
        self.forced = collections.deque(lengths)

    def drafter_lags(self, lagging: bool) -> None:
        """What the drafter said after an admission (`drafters.base.lags_behind`): False, it
        reads the target's cache and no row lags (no catch-up to charge)."""
        self.lagging = lagging
        if not lagging:
            self.lag.zero_()
