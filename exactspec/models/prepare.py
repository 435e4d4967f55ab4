"""`python -m exactspec.models.prepare [NAME ...]`: convert the embedded models whose packages are
installed into the model cache now, so that no later command or test waits for it.

`make test` runs it before the suite (smollm2-135m ~20 s and gemma3-270m ~40 s when the cache is
empty, ~1 s to check both when it is not); `make run` does not need it (its first `generate`
converts smollm2-135m with a progress bar). A model whose package is not installed is named with
its pip command and skipped; naming it explicitly makes that an error (exit 2).
"""

from __future__ import annotations

import argparse
import sys
import time

from exactspec.errors import InvalidValue
from exactspec.models import registry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m exactspec.models.prepare",
        description="Convert embedded models into the model cache now (default: every one whose "
        "package is installed). Example: python -m exactspec.models.prepare smollm2-135m")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"embedded models ({', '.join(registry.known_names())})")
    args = p.parse_args(argv)
    from exactspec.models.loading import convert_embedded

    named = bool(args.names)
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
        print(f"{name}: ready in {time.perf_counter() - start:.1f} s ({directory})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
