"""Cost curves of the draft-length policy (policy.py): measured (x, y) points read at any x,
and its three estimates from them (the verify forward, a draft position, a step's outside
time), each the measurement where there is one."""

from __future__ import annotations


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
    where measured (on CPUs the cost is far from linear: smollm2-135m, 1 thread, one row: 37,
    47, 80, 104 ms at widths 1, 2, 5, 9, and a line through all of them overestimates width 1,
    drafting where plain is faster); else along the widths measured at these rows, by tokens
    rows x width; one width there: its cost scaled as the model over every measurement scales
    (tokens -> mean seconds); none: that model."""
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
    half growing with the width), else `fallback` (the median over every step). (That median
    for a wide verify next to a measured plain step: 0.023 s against plain's 0.19 s at 64 rows
    in a server, which made drafting 64 rows look cheaper outside the forwards.)"""
    if (rows, width) in table:
        return table[(rows, width)]
    same = sorted((w, t) for (b, w), t in table.items() if b == rows)
    return along(same, width) if same else fallback
