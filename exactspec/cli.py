"""The `exactspec` command line: parses arguments, calls the library, prints. Nothing else.

Each subcommand is a `_add_<name>` parser builder plus a `_cmd_<name>` runner. User mistakes
exit with code 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from exactspec.audit import (
    CAT_DOG_FISH,
    AuditConfig,
    explain,
    format_explanation,
    format_table,
    money_diagram,
    run_audit,
)


class UsageError(Exception):
    """A mistake in the command line; printed as one line, exit code 2."""


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exactspec",
        description="Lossless speculative decoding: faster generation, the same distribution.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log diagnostics")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_explain, _add_audit, _add_generate):
        add(sub)
    return parser


# --- explain -------------------------------------------------------------------------------

def _add_explain(sub) -> None:
    p = sub.add_parser(
        "explain", help="walk through one accept/reject step for any p and q",
        description="The seeds' walk-through of one speculative step: a(x) = min(1, p/q), "
        "min(p, q), (p - q)+, P(accept), Z = P(reject), p'(x) and P(output = x) = p(x), "
        "computed by the library's own acceptance law. Example: "
        "exactspec explain --p 0.6,0.3,0.1 --q 0.4,0.5,0.1 --labels cat,dog,fish")
    p.add_argument("--p", type=_floats, default=None, help="target distribution, e.g. 0.6,0.3,0.1")
    p.add_argument("--q", type=_floats, default=None, help="draft distribution, e.g. 0.4,0.5,0.1")
    p.add_argument("--labels", default=None, help="comma-separated token names")
    p.add_argument("--png", default="explain.png",
                   help="where to write the money diagram ('' to skip)")
    p.set_defaults(run=_cmd_explain)


def _cmd_explain(args) -> int:
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


# --- audit ---------------------------------------------------------------------------------

def _add_audit(sub) -> None:
    p = sub.add_parser(
        "audit", help="exact and statistical audit of every verifier and pitfall",
        description="Runs token, block and greedy verification on random, point-mass, "
        "zero-holding, disjoint and parameter-folded p/q, and every seed pitfall: exact TV "
        "distance of the first generated tokens from the target, and a chi-square test on "
        "batched samples. Exits 1 if a lossless method fails or a pitfall is missed.")
    p.add_argument("--seed", type=int, default=0, help="seed for the statistical samples")
    p.add_argument("--samples", type=int, default=AuditConfig.samples,
                   help="sequences drawn per case (default %(default)s)")
    p.set_defaults(run=_cmd_audit)


def _cmd_audit(args) -> int:
    if args.samples < 100:
        raise UsageError(f"--samples {args.samples} is too small; use at least 100")
    cfg = AuditConfig(seed=args.seed, samples=args.samples,
                      greedy_samples=min(AuditConfig.greedy_samples, args.samples))
    rows = run_audit(cfg)
    print(format_table(rows, cfg))
    return 0 if all(row.ok for row in rows) else 1


# --- generate ------------------------------------------------------------------------------

def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text, speculatively")
    p.add_argument("prompt")
    p.set_defaults(run=_cmd_generate)


def _cmd_generate(args) -> int:
    raise UsageError("generate is not available yet")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        return int(args.run(args) or 0)
    except (UsageError, ValueError, TypeError, FileNotFoundError) as exc:
        print(f"exactspec {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
