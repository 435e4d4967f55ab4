"""The seeds' walk-through of one accept/reject step, for any p (target) and q (draft).

Every number comes from `acceptance_law` (V draft tokens, K = 1), so the table shows what the
library really computes: a(x) = min(1, p/q) is its acceptance probability, (p - q)+ its residual.
The identity on display is the "money equation" min(p, q) + (p - q)+ = p, pointwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from exactspec.errors import InvalidValue
from exactspec.sampling import acceptance_law

CAT_DOG_FISH = ((0.6, 0.3, 0.1), (0.4, 0.5, 0.1), ("cat", "dog", "fish"))  # seed 000, section 2.3
TOLERANCE = 1e-6  # how far p and q may be from summing to 1
MATCH = 1e-12  # a row "matches" when |P(output = x) - p(x)| is below this


@dataclass(frozen=True)
class ExplainRow:
    """One token of the walk-through."""

    label: str  # token name
    p: float  # target probability p(x)
    q: float  # draft probability q(x)
    accept: float | None  # a(x) = min(1, p/q); None when q(x) = 0 (x is never drafted)
    both: float  # P(output = x and accepted) = q(x) a(x) = min(p(x), q(x))
    excess: float  # (p - q)+(x) = max(0, p(x) - q(x)), the residual's unnormalised weight
    recovered: float | None  # p'(x) = (p - q)+(x) / Z; None when Z = 0 (never rejected)
    output: float  # P(output = x) = min(p, q)(x) + Z p'(x)

    @property
    def matches(self) -> bool:
        return abs(self.output - self.p) < MATCH


@dataclass(frozen=True)
class Explanation:
    """The whole walk-through: per-token rows and the two totals."""

    rows: tuple[ExplainRow, ...]  # one per token
    p_accept: float  # P(accept) = sum_x min(p, q)
    p_reject: float  # Z = P(reject) = 1 - P(accept) = sum_x (p - q)+

    @property
    def matches(self) -> bool:
        return all(row.matches for row in self.rows)


def check_pair(p: Sequence[float], q: Sequence[float], labels: Sequence[str] | None) -> None:
    """ValueError naming the problem if p, q or labels cannot describe one step."""
    if len(p) != len(q):
        raise InvalidValue(f"p has {len(p)} values but q has {len(q)}: give one value per token")
    if len(p) < 1:
        raise InvalidValue("p and q are empty: give one probability per token")
    for name, dist in (("p", p), ("q", q)):
        if not all(math.isfinite(v) for v in dist):
            raise InvalidValue(f"{name} holds a value that is not a finite number")
        if any(v < 0 for v in dist):
            raise InvalidValue(f"{name} holds a negative probability: {min(dist)}")
        if abs(sum(dist) - 1.0) > TOLERANCE:
            raise InvalidValue(f"{name} sums to {sum(dist):.6g}, not 1: give a probability distribution")
    if labels is not None and len(labels) != len(p):
        raise InvalidValue(f"{len(labels)} labels for {len(p)} tokens: give one label per token")


def explain(p: Sequence[float], q: Sequence[float],
            labels: Sequence[str] | None = None) -> Explanation:
    """The walk-through table for target p and draft q, computed by `acceptance_law`."""
    check_pair(p, q, labels)
    vocab = len(p)
    labels = list(labels) if labels is not None else [f"x{i}" for i in range(vocab)]
    pt = torch.tensor(p, dtype=torch.float64)
    qt = torch.tensor(q, dtype=torch.float64)
    drafted = (qt > 0).nonzero()[:, 0]  # every token the draft can propose, one row each
    rows = len(drafted)
    law = acceptance_law(pt.expand(rows, 2, vocab), drafted[:, None], qt.expand(rows, 1, vocab),
                         method="token")
    accept = torch.zeros(vocab, dtype=torch.float64)
    accept[drafted] = law.accept_probs[:, 1]  # P(n = 1 | draft x) = a(x)
    both = qt * accept  # P(output = x and accepted)
    p_accept = float(both.sum())
    p_reject = float((qt * (1.0 - accept)).sum())  # Z
    # the residual after a rejection is the same for every draft token: (p - q)+
    excess = law.residual(torch.zeros(rows, dtype=torch.long))[0] if p_reject > 0 else 0 * pt
    recovered = excess / excess.sum() if p_reject > 0 else None
    output = both + (p_reject * recovered if recovered is not None else 0.0)
    return Explanation(tuple(
        ExplainRow(labels[i], p[i], q[i], float(accept[i]) if q[i] > 0 else None,
                   float(both[i]), float(excess[i]),
                   float(recovered[i]) if recovered is not None else None, float(output[i]))
        for i in range(vocab)), p_accept, p_reject)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def format_explanation(ex: Explanation) -> str:
    """The table, the two totals and the conclusion, as plain text."""
    head = ("x", "p(x)", "q(x)", "a(x)=min(1,p/q)", "min(p,q)", "(p-q)+", "p'(x)",
            "P(output=x)", "= p(x)?")
    body = [(r.label, _num(r.p), _num(r.q), _num(r.accept), _num(r.both), _num(r.excess),
             _num(r.recovered), _num(r.output), "yes" if r.matches else "NO")
            for r in ex.rows]
    total = ("sum", _num(sum(r.p for r in ex.rows)), _num(sum(r.q for r in ex.rows)), "",
             _num(ex.p_accept), _num(sum(r.excess for r in ex.rows)), "", "", "")
    widths = [max(len(row[i]) for row in (head, *body, total)) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in body] + [fmt.format(*total), ""]
    lines.append(f"P(accept) = sum_x min(p, q) = {_num(ex.p_accept)}")
    lines.append(f"Z = P(reject) = 1 - P(accept) = sum_x (p - q)+ = {_num(ex.p_reject)}")
    lines.append("P(output = x) = min(p, q)(x) + Z * p'(x) = min(p, q)(x) + (p - q)+(x) = p(x): "
                 + ("every row matches, the step is lossless" if ex.matches
                    else "SOME ROWS DO NOT MATCH"))
    return "\n".join(lines)


def money_diagram(ex: Explanation, path: str) -> None:
    """Write the PNG: per token, min(p, q) + (p - q)+ stacked to exactly p; q as an outline."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1.6 * len(ex.rows) + 2.5, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = range(len(ex.rows))
    both = [r.both for r in ex.rows]
    excess = [r.excess for r in ex.rows]
    ax.bar(xs, both, width=0.6, color="#4c72b0", label="min(p, q): accepted draft")
    ax.bar(xs, excess, width=0.6, bottom=both, color="#55a868",
           label="(p - q)+: recovered after a rejection")
    ax.bar(xs, [r.p for r in ex.rows], width=0.6, fill=False, edgecolor="#c44e52", linewidth=2,
           label="p (target)")
    ax.bar(xs, [r.q for r in ex.rows], width=0.8, fill=False, edgecolor="black",
           linestyle="--", linewidth=1, label="q (draft)")
    ax.set_xticks(list(xs), [r.label for r in ex.rows])
    ax.set_ylabel("probability")
    ax.set_title(f"min(p, q) + (p - q)+ = p    P(accept) = {_num(ex.p_accept)}, "
                 f"Z = P(reject) = {_num(ex.p_reject)}")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_ylim(0, max(max(r.p for r in ex.rows), max(r.q for r in ex.rows)) * 1.35)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
