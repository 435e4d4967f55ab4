"""`exactspec explain`: the seeds' walk-through of one accept/reject step, for any p and q."""

from __future__ import annotations

from exactspec.cli.common import UsageError, floats


def add(sub) -> None:
    p = sub.add_parser(
        "explain", help="walk through one accept/reject step for any p and q",
        description="The seeds' walk-through of one speculative step: a(x) = min(1, p/q), "
        "min(p, q), (p - q)+, P(accept), Z = P(reject), p'(x) and P(output = x) = p(x), "
        "computed by the library's own acceptance law. Example: "
        "exactspec explain --p 0.6,0.3,0.1 --q 0.4,0.5,0.1 --labels cat,dog,fish")
    p.add_argument("--p", type=floats, default=None, help="target distribution, e.g. 0.6,0.3,0.1")
    p.add_argument("--q", type=floats, default=None, help="draft distribution, e.g. 0.4,0.5,0.1")
    p.add_argument("--labels", default=None, help="comma-separated token names")
    p.add_argument("--png", default="explain.png",
                   help="where to write the money diagram ('' to skip)")
    p.set_defaults(run=run)


def run(args) -> int:
    from exactspec.audit import CAT_DOG_FISH, explain, format_explanation, money_diagram

    if (args.p is None) != (args.q is None):
        raise UsageError("give both --p and --q, or neither for the cat/dog/fish example")
    p, q, labels = (args.p, args.q, None) if args.p is not None else CAT_DOG_FISH
    if args.labels is not None:
        labels = [x.strip() for x in args.labels.split(",")]
    ex = explain(p, q, labels)
    print(format_explanation(ex))
    if args.png:
        money_diagram(ex, args.png)
        print(f"wrote the money diagram to {args.png}")
    return 0
