"""The `exactspec` command line: parses arguments, calls the library, prints. Nothing else.

One module per subcommand, each with `add(sub)` (its parser) and `run(args)` (its runner);
a new subcommand is a new module here plus one entry in `SUBCOMMANDS`. Modules import the
library inside `run`, so `exactspec --help` and `--version` never import torch.

Exit codes: 0 success; 1 a failed audit, or an internal error (one line, `--debug` for the
traceback); 2 a user mistake (`exactspec.errors.UserError`, an argparse error, a missing file
the user named), printed as one line; 130 interrupted (Ctrl-C).

common.py holds what several subcommands share (errors, threads, progress); the subcommands:
generate, explain, audit, train_draft, bench, batch, serve, bench_serve (docs/cli.md).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback

from exactspec import __version__
from exactspec.cli.common import (
    ArgumentError,
    Parser,
    UsageError,
    end_lossy_warning,
    names_user_file,
)
from exactspec.errors import UserError

# subcommand modules of exactspec.cli, in --help order; each has add(sub) and run(args)
SUBCOMMANDS = ("explain", "audit", "generate", "train_draft", "bench", "batch", "serve",
               "bench_serve", "prepare")

__all__ = ["SUBCOMMANDS", "UsageError", "build_parser", "main", "run_audit"]


def run_audit(cfg):
    """exactspec.audit.run_audit, imported on first use (tests replace this name); its bar
    only on a terminal or with --progress."""
    from exactspec.audit import run_audit as run
    from exactspec.cli.common import bars

    return run(cfg, progress=bars())


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="exactspec",
        description="Lossless speculative decoding: faster generation, the same distribution.",
    )
    parser.add_argument("--version", action="version", version=f"exactspec {__version__}")
    for flags, kwargs in _GLOBAL_SWITCHES:
        parser.add_argument(*flags, action="store_true", **kwargs)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"exactspec.cli.{name}").add(sub)
    for command in sub.choices.values():  # the global switches also work after the subcommand
        for flags, kwargs in _GLOBAL_SWITCHES:
            command.add_argument(*flags, action="store_true", default=argparse.SUPPRESS, **kwargs)
    return parser


# switches accepted before and after the subcommand: (flags, add_argument kwargs)
_GLOBAL_SWITCHES = (
    (("-v", "--verbose"), {"help": "log diagnostics"}),
    (("--debug",), {"help": "print the full traceback of an internal error"}),
    (("--progress",), {"help": "show progress bars even when stderr is not a terminal"}),
)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except ArgumentError as exc:
        print(exc, file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if args.progress:
        os.environ["EXACTSPEC_PROGRESS"] = "1"  # read by exactspec.models.loading.progress_off
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: quiet, the shell's convention for SIGINT
        return 130
    except BrokenPipeError:  # `exactspec generate ... | head`: the reader left
        sys.stderr.close()
        return 1
    except Exception as exc:
        user = isinstance(exc, UserError) or (
            isinstance(exc, FileNotFoundError) and names_user_file(exc, args))
        if user:
            print(f"exactspec {args.command}: error: {_one_line(exc)}", file=sys.stderr)
            return 2
        if args.debug:
            traceback.print_exc()
        print(f"exactspec {args.command}: internal error: {type(exc).__name__}: "
              f"{_one_line(exc)} (run with --debug for the traceback)", file=sys.stderr)
        return 1
    finally:
        end_lossy_warning()  # a lossy rule's library warning is the CLI's only while it runs


def _one_line(exc: BaseException, limit: int = 500) -> str:
    """The exception's message on one line (whitespace runs joined), at most `limit` chars."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
