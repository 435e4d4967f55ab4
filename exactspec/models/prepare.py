"""`python -m exactspec.models.prepare [NAME ...] [--frequent-tokens NAME ...]`: convert the
embedded models whose packages are installed into the model cache now, so that no later command
or test waits for it; with --frequent-tokens also the survey a reduced draft head reads
(`--draft-vocab N`, drafters/frequent_tokens.py: the target generates ~7k tokens once, cached).

`make test` runs it before the suite (on the Zen 4 of docs/performance.md with an empty cache:
smollm2-135m ~12 s, gemma3-270m ~32 s, smollm2's survey ~40 s; ~1 s to check them all when they
are there); `make run` does not need it (its first `generate` converts smollm2-135m with a
progress bar). A model whose package is not installed is named with its pip command and skipped;
naming it explicitly makes that an error (exit 2).
"""

from __future__ import annotations

import argparse
import sys
import time

from exactspec.errors import InvalidValue
from exactspec.models import registry


def main(argv: list[str] | None = None) -> int:
    names = ", ".join(registry.known_names())
    p = argparse.ArgumentParser(
        prog="python -m exactspec.models.prepare",
        description="Convert embedded models into the model cache now (default: every one whose "
        "package is installed). Examples: python -m exactspec.models.prepare smollm2-135m; "
        "python -m exactspec.models.prepare --frequent-tokens smollm2-135m")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"embedded models ({names})")
    p.add_argument("--frequent-tokens", nargs="+", default=[], metavar="NAME",
                   help="also survey these models' own text for the tokens a reduced draft head "
                   "keeps (--draft-vocab N)")
    args = p.parse_args(argv)
    from exactspec.models.loading import convert_embedded

    named = bool(args.names)
    ready = []
    for name in args.names or registry.known_names():
        start = time.perf_counter()
        try:
            directory = convert_embedded(name)
        except InvalidValue as exc:
            if named:
                print(f"prepare: error: {exc}", file=sys.stderr)
                return 2
            print(f"{name}: skipped ({exc})")
            continue
        ready.append(name)
        print(f"{name}: ready in {time.perf_counter() - start:.1f} s ({directory})")
    for name in args.frequent_tokens:
        if name not in ready:
            print(f"prepare: error: --frequent-tokens {name}: not among the models made ready "
                  f"here ({', '.join(ready) or 'none'})", file=sys.stderr)
            return 2
        start = time.perf_counter()
        survey(name)
        print(f"{name}: its frequent tokens ready in {time.perf_counter() - start:.1f} s")
    return 0


def survey(name: str) -> None:
    """The token mass of embedded model `name`'s own text, into the disk cache (or found there)."""
    from exactspec.drafters.frequent_tokens import token_mass
    from exactspec.models.loading import load

    model = load(name)
    token_mass(model.model, model.tokenizer, progress=False)


if __name__ == "__main__":
    sys.exit(main())
