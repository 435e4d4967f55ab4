"""Draft length: fixed, or "auto" per row from observed acceptance and measured step costs."""

from __future__ import annotations

import torch

AUTO_MAX_DRAFT = 8  # the longest draft "auto" proposes
AUTO_PROBE_EVERY = 8  # a row that stopped drafting still drafts one token every this many steps


def expected_tokens(alpha: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Tokens emitted per step with K drafts and per-token acceptance alpha (Leviathan eq. 1).

    (1 - alpha^(K+1)) / (1 - alpha), the recovered / bonus token included.
    """
    alpha = alpha.clamp(0.0, 1.0 - 1e-6)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


class DraftLengthPolicy:
    """Chooses each row's draft length before a step.

    Fixed: always `num_draft_tokens` (capped by each row's room). Auto, per row: row b keeps
    its own acceptance estimate alpha_b = (accepted + 1) / (accepted + rejections + 2) (a
    rejection is a step that did not keep its whole draft) and its room r_b (drafts that still
    fit its token budget and the context). The rows share one forward, padded to the widest
    row, and one drafting pass of as many positions, so a step costs
    c(K) = K' * draft_cost + target_cost(K' + 1) with K' = max_b min(K, r_b), whatever each row
    drafts below K'. Given that shared width a row's extra drafts are free and only add
    expected tokens, so row b drafts k_b = min(K, r_b), and K in 0..AUTO_MAX_DRAFT maximises
    the batch's tokens per second, sum_b expected_tokens(alpha_b, min(K, r_b)) / c(K): a row
    near its budget adds no gain for drafts it cannot emit. draft_cost is the measured seconds
    per draft position and target_cost(w) the measured seconds of a target forward of width w
    (a line fitted through the widths seen so far; with a single width w0 seen,
    t(w0) * (0.5 + 0.5 w / w0)). For one row this is Leviathan's optimum. K = 0 is plain
    decoding; then one token is still drafted every AUTO_PROBE_EVERY steps so that the
    acceptance estimates keep up.
    """

    def __init__(self, num_draft_tokens: int | str, num_rows: int) -> None:
        self.auto = num_draft_tokens == "auto"  # adapt per row
        self.fixed = 4 if self.auto else int(num_draft_tokens)  # the fixed length, or the start
        self.accepted = torch.zeros(num_rows)  # [B] drafts kept so far
        self.rejections = torch.zeros(num_rows)  # [B] steps that rejected a draft
        self.draft_cost: float | None = None  # EMA seconds per draft position
        self.target_cost: dict[int, float] = {}  # width -> EMA seconds per target forward
        self.steps = 0  # choices made so far
        self._observations: dict = {}  # "draft" / width -> measurements taken so far
        self._drafted_last = True  # whether the previous step drafted (no catch-up pending)

    def choose(self, room: torch.Tensor | None = None) -> torch.Tensor:  # [B] -> [B] long
        """Each row's draft length; `room` ([B] long, default unbounded) caps row b's."""
        b = self.accepted.shape[0]
        room = torch.full((b,), AUTO_MAX_DRAFT if self.auto else self.fixed, dtype=torch.long) \
            if room is None else room.cpu().long().clamp(min=0)
        self.steps += 1
        if not self.auto or self.draft_cost is None or not self.target_cost:
            return torch.minimum(torch.full((b,), self.fixed, dtype=torch.long), room)
        alpha = (self.accepted + 1) / (self.accepted + self.rejections + 2)  # [B]
        ks = torch.arange(0, AUTO_MAX_DRAFT + 1, dtype=torch.long)  # [Kc]
        per_row = torch.minimum(ks[None, :], room[:, None])  # [B, Kc] drafts row b can use
        width = per_row.amax(0) if b else ks  # [Kc] shared draft positions K'
        cost = width.double() * self.draft_cost + torch.tensor(
            [self._target_cost(int(w) + 1) for w in width], dtype=torch.float64)  # [Kc]
        tokens = expected_tokens(alpha[:, None].double(), per_row.double()).sum(0)  # [Kc]
        k = int((tokens / cost).argmax())
        if k == 0 and self.steps % AUTO_PROBE_EVERY == 0:
            k = 1
        return torch.minimum(torch.full((b,), k, dtype=torch.long), room)

    def _target_cost(self, width: int) -> float:
        # a width already measured uses its own EMA: on CPUs the cost is far from linear in the
        # width (smollm2-135m, 1 thread: 37, 47, 80, 104 ms at widths 1, 2, 5, 9), and a line
        # through all of them overestimates width 1, drafting where plain decoding is faster
        if width in self.target_cost:
            return self.target_cost[width]
        seen = sorted(self.target_cost.items())
        if len(seen) == 1:
            # one width measured: assume half its cost is fixed and half grows with the width.
            # Taking every width as equally cheap made the first choice the widest draft,
            # whose cost is then paid before it is known (a batch of 8 rows on 2 CPU cores:
            # auto 0.83x batched plain against 0.88x at K=4; width 9 costs ~1.5x width 5 there)
            w0, t0 = seen[0]
            return t0 * (0.5 + 0.5 * width / w0)
        w = torch.tensor([s[0] for s in seen], dtype=torch.float64)
        t = torch.tensor([s[1] for s in seen], dtype=torch.float64)
        slope = float(((w - w.mean()) * (t - t.mean())).sum() / ((w - w.mean()) ** 2).sum())
        return max(float(t.mean()) + max(slope, 0.0) * (width - float(w.mean())), 1e-9)

    def observe(self, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        """Per row: drafts proposed [B] and kept [B] in the last step."""
        drafted, accepted = drafted.cpu().double(), accepted.cpu().double()
        self.accepted += accepted
        self.rejections += ((accepted < drafted) & (drafted > 0)).double()

    def observe_costs(self, draft_seconds: float, num_draft: int, target_seconds: float,
                      width: int) -> None:
        """One step's measured costs. Two one-off costs are kept out of the estimates: the
        first measurement of each quantity is dropped (first calls pay for allocation and
        lazy set-up: a float32 target's first one-row step builds its one-row weight copy,
        974 ms against 45 ms, after which auto never chose plain steps again; llama.cpp's
        first draft took 90 ms a token against 12), and a drafting step right after a step
        without drafts is not counted (the drafter then also catches up on every token it
        skipped)."""
        if num_draft > 0 and self._drafted_last:
            self.draft_cost = self._ema(self.draft_cost, draft_seconds / num_draft, "draft")
        self._drafted_last = num_draft > 0
        cost = self._ema(self.target_cost.get(width), target_seconds, width)
        if cost is not None:
            self.target_cost[width] = cost

    def _ema(self, old: float | None, new: float, key) -> float | None:
        seen = self._observations.get(key, 0)
        self._observations[key] = seen + 1
        if seen == 0:
            return old  # the first measurement of a quantity is dropped
        return new if old is None else 0.8 * old + 0.2 * new

    def admit(self, num_rows: int) -> None:
        """Append `num_rows` new rows with no observations yet."""
        self.accepted = torch.cat([self.accepted, torch.zeros(num_rows)])
        self.rejections = torch.cat([self.rejections, torch.zeros(num_rows)])

    def select(self, rows: torch.Tensor) -> None:
        rows = rows.cpu()
        self.accepted = self.accepted[rows]
        self.rejections = self.rejections[rows]
