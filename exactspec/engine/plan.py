"""The draft-length policy's arithmetic (policy.py), pure functions of their inputs: the cost
curves (measured (x, y) points read at any x, and the three estimates from them: the verify
forward, a draft position, a step's outside time, each the measurement where there is one), and
`plan_lengths`, the choice of each row's draft length from acceptance estimates and costs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def mean_by_key(points) -> list[tuple[float, float]]:
    """(x, y) points with equal x averaged."""
    by: dict[float, list[float]] = {}
    for x, y in points:
        by.setdefault(x, []).append(y)
    return [(x, sum(ys) / len(ys)) for x, ys in by.items()]


def along(points: list[tuple[float, float]], x: float) -> float:
    """y at x on the piecewise-linear curve through `points` (sorted by x, distinct x),
    extended by its end segments (slope at least 0); one point (x0, y0): y0 (0.5 + 0.5 x / x0)
    (half fixed, half growing: taking every x as equally cheap made the widest draft look
    free before it was measured)."""
    assert points, "no measurement yet"
    if len(points) == 1:
        x0, y0 = points[0]
        return y0 * (0.5 + 0.5 * x / x0)
    if x <= points[0][0]:
        (x0, y0), (x1, y1) = points[0], points[1]
    elif x >= points[-1][0]:
        (x0, y0), (x1, y1) = points[-2], points[-1]
    else:
        i = next(i for i in range(1, len(points)) if points[i][0] >= x)
        (x0, y0), (x1, y1) = points[i - 1], points[i]
    slope = max((y1 - y0) / (x1 - x0), 0.0)
    return max(y0 + slope * (x - x0), 1e-9)


def verify_cost(table: dict[tuple[int, int], float], rows: int, width: int) -> float:
    """The target forward's seconds at (rows, width) from those measured (`table`): its own
    where measured (on CPUs the cost is far from linear in the width, and a line through every
    width overestimates width 1, drafting where plain is faster); else along the widths
    measured at these rows, by tokens rows x width; one width there: its cost scaled as the
    model over every measurement scales (tokens -> mean seconds); none: that model."""
    if (rows, width) in table:
        return table[(rows, width)]
    n = rows * width
    same = [(b * w, t) for (b, w), t in table.items() if b == rows]
    if len(same) >= 2:
        return along(sorted(same), n)
    model = sorted(mean_by_key((b * w, t) for (b, w), t in table.items()))
    if same:
        n0, t0 = same[0]
        return t0 * along(model, n) / max(along(model, n0), 1e-12)
    return along(model, n)


def per_rows(table: dict[int, float], rows: int) -> float:
    """Seconds per draft position with `rows` rows drafting: measured, else along the row
    counts measured (0 rows: 0)."""
    if rows == 0:
        return 0.0
    if rows in table:
        return table[rows]
    return along(sorted(table.items()), rows)


def outside_cost(table: dict[tuple[int, int], float], fallback: float, rows: int,
                 width: int) -> float:
    """A step's time outside the draft and the target forward at `rows` rows and verify
    `width`: measured there, else along the widths measured at these rows (one: half fixed,
    half growing with the width), else `fallback` (the median over every step; read for a wide
    verify next to a measured plain step it made drafting look cheaper outside the forwards)."""
    if (rows, width) in table:
        return table[(rows, width)]
    same = sorted((w, t) for (b, w), t in table.items() if b == rows)
    return along(same, width) if same else fallback


def expected_tokens(alpha: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Tokens emitted per step with K drafts and per-token acceptance alpha (Leviathan eq. 1).

    (1 - alpha^(K+1)) / (1 - alpha), the recovered / bonus token included.
    """
    alpha = alpha.clamp(0.0, 1.0 - 1e-6)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass(frozen=True)
class Plan:
    """What a batch gains and pays at each draft length K = 0..Kc-1, each K with its best
    number of drafting rows (`plan_lengths`)."""

    order: torch.Tensor  # [B] long: the rows, most accepting first
    per_row: torch.Tensor  # [B, Kc] long: drafts of the i-th most accepting row at K, min(K, room)
    top: torch.Tensor  # [Kc] long: the rows drafting at each K, less one
    tokens: torch.Tensor  # [Kc] float64: expected tokens of a step
    cost: torch.Tensor  # [Kc] float64: its seconds
    width: torch.Tensor  # [Kc] long: its shared draft positions K'
    cost_n: torch.Tensor  # [B, Kc] float64: seconds when the top n + 1 rows draft

    @property
    def best(self) -> int:
        """The K of the highest rate (tokens per second)."""
        return int((self.tokens / self.cost).argmax())

    def rate(self, k: int) -> float:
        return float(self.tokens[k] / self.cost[k])

    def lengths(self, k: int) -> torch.Tensor:  # [B] long: each row's drafts at K = k
        want = torch.zeros(self.order.shape[0], dtype=torch.long)
        top = self.order[: int(self.top[k]) + 1]
        want[top] = self.per_row[: int(self.top[k]) + 1, k]
        return want

    def ceiling(self) -> float:
        """The best rate of any K > 0 were every draft accepted (alpha 1); 0.0 without one."""
        b = self.order.shape[0]
        return float(((b + self.per_row.double().cumsum(0)) / self.cost_n)[:, 1:].max()) \
            if self.per_row.shape[1] > 1 else 0.0


def plan_lengths(alpha: torch.Tensor,  # [B] float64 each row's acceptance estimate
                 room: torch.Tensor,  # [B] long drafts each row can still use
                 lag: torch.Tensor,  # [B] tokens the drafter has not seen of each row
                 draft: torch.Tensor,  # [B + 1] float64 seconds per draft position, by rows drafting
                 verify: torch.Tensor,  # [Kc] float64 seconds of the target forward, by K' + 1
                 outside: torch.Tensor,  # [Kc] float64 a step's other seconds, by K' + 1
                 catch_up: float) -> Plan:  # seconds per caught-up lagging token
    """The draft-length choice as a function of its inputs (DraftLengthPolicy's docstring): at
    each K the n most accepting rows draft min(K, room) and the others none, n maximising
    tokens / seconds, a step costing K' draft(n) + verify[K'] + outside[K'] plus the catch-up
    of the drafting rows' lag spread over the steps they keep drafting."""
    b = alpha.shape[0]
    ks = torch.arange(0, verify.shape[0], dtype=torch.long)  # [Kc]
    # the rows that draft: the n most accepting (n = 1..B), each min(K, its room); the
    # others draft nothing (a row accepting little is not worth its draft positions)
    order = torch.argsort(alpha, descending=True, stable=True)  # [B]
    per_row = torch.minimum(ks[None, :], room[order][:, None])  # [B, Kc] by acceptance
    gain = expected_tokens(alpha[order][:, None], per_row.double()) - 1  # [B, Kc]
    tokens_n = b + gain.cumsum(0)  # [B, Kc] tokens when the top n + 1 rows draft
    width_n = per_row.cummax(0).values  # [B, Kc] shared draft positions K'
    drafting_n = (per_row > 0).long().cumsum(0)  # [B, Kc] rows that draft
    cost_n = width_n * draft[drafting_n] + verify[width_n] + outside[width_n]  # [B, Kc]
    # catching the drafter up on the rows that draft, spread over the steps they keep
    # drafting (the rows' mean room over the tokens a step emits)
    lagging = ((per_row > 0).double() * lag.double()[order][:, None]).cumsum(0)
    horizon = (room.double().mean() * b / tokens_n).clamp(min=1.0)  # [B, Kc] steps
    cost_n = cost_n + catch_up * lagging / horizon
    best = (tokens_n / cost_n).argmax(0)  # [Kc] top rows drafting (n - 1) at each K
    return Plan(order=order, per_row=per_row, top=best,
                tokens=tokens_n.gather(0, best[None]).squeeze(0),
                cost=cost_n.gather(0, best[None]).squeeze(0),
                width=width_n.gather(0, best[None]).squeeze(0), cost_n=cost_n)
