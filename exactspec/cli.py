"""The `exactspec` command line: parses arguments, calls the library, prints. Nothing else.

Each subcommand is a `_add_<name>` parser builder plus a `_cmd_<name>` runner. User mistakes
exit with code 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys


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
    p = sub.add_parser("explain", help="walk through one accept/reject step for any p and q")
    p.add_argument("--p", type=_floats, default=None, help="target distribution, e.g. 0.6,0.3,0.1")
    p.add_argument("--q", type=_floats, default=None, help="draft distribution, e.g. 0.4,0.5,0.1")
    p.add_argument("--labels", default=None, help="comma-separated token names")
    p.add_argument("--png", default="explain.png", help="where to write the money diagram")
    p.set_defaults(run=_cmd_explain)


def _cmd_explain(args) -> int:
    raise UsageError("explain is not available yet")


# --- audit ---------------------------------------------------------------------------------

def _add_audit(sub) -> None:
    p = sub.add_parser("audit", help="exact and statistical audit of every verifier and pitfall")
    p.add_argument("--seed", type=int, default=0, help="seed for the statistical samples")
    p.set_defaults(run=_cmd_audit)


def _cmd_audit(args) -> int:
    raise UsageError("audit is not available yet")


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
