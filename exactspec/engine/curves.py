"""Cost curves of the draft-length policy (policy.py): measured (x, y) points read at any x."""

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
