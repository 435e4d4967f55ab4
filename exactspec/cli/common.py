"""What several subcommands share: the usage error, argument types, and flag bookkeeping.

Nothing here imports torch: `exactspec --help` and `--version` must stay fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from exactspec.errors import UserError


class UsageError(UserError):
    """A mistake in the command line; printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but a parse error is one line (`prog: error: ...`) instead of usage + error."""

    def error(self, message: str):  # type: ignore[override]
        raise ArgumentError(f"{self.prog}: error: {message} (see {self.prog} --help)")


class ArgumentError(Exception):
    """A parse error, already formatted as the one line `main` prints (exit code 2)."""


KV_CACHES = ("float32", "bfloat16")  # es.load's kv_cache= names (models/cache.py's KV_CACHES)
DTYPES = ("float32", "bfloat16")  # es.load's dtype= names (models/loading.py's DTYPES)


def add_dtype_flag(p: argparse.ArgumentParser, note: str = "") -> None:
    """--dtype, es.load's dtype= (generate, serve, batch, bench); `note` ends its help."""
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="weights of the target (and of a --draft model loaded by name); "
                   "bfloat16 halves a step's bytes and is fast on CPUs with native bf16 "
                   f"(avx512_bf16 / AMX){note}")


def add_kv_cache_flag(p: argparse.ArgumentParser, note: str = "") -> None:
    """--kv-cache, es.load's kv_cache= (generate, serve, batch, bench); `note` ends its help."""
    p.add_argument("--kv-cache", choices=KV_CACHES, default="float32",
                   help="the target's KV cache; bfloat16 stores keys and values rounded to bf16 "
                   "(half the bytes a step reads of a long context; another target, decoded "
                   f"exactly; our kernels only{note})")


def floats(text: str) -> list[float]:
    """argparse type: comma-separated numbers."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc


def at_least(low: int):
    """argparse type: an int >= `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"  # how argparse names the type in its messages
    return parse


def given(args: argparse.Namespace, name: str) -> bool:
    """Whether the user set option `name` (dest) on the command line.

    Options whose default must be told apart from an explicit value use `default=None` and
    resolve the effective value with `value_or`.
    """
    return getattr(args, name, None) is not None


def value_or(args: argparse.Namespace, name: str, default):
    """The option's value, or `default` when the user did not give it."""
    value = getattr(args, name, None)
    return default if value is None else value


def refuse_without(args: argparse.Namespace, flags: dict[str, str], needed: bool,
                   what: str) -> None:
    """UsageError if any of `flags` (dest -> spelling) was given while `needed` is False.

    `what` says what the flags need, e.g. "a drafter (--draft, --prompt-lookup or --eagle)".
    """
    if needed:
        return
    for dest, flag in flags.items():
        value = getattr(args, dest, None)
        if value is not None and value is not False:
            raise UsageError(f"{flag} only applies with {what}")


def user_paths(args: argparse.Namespace) -> list[str]:
    """Every string argument, absolutised: the files and directories the user named."""
    out = []
    for value in vars(args).values():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and v:
                out.append(os.path.abspath(os.path.expanduser(v)))
    return out


def names_user_file(exc: FileNotFoundError, args: argparse.Namespace) -> bool:
    """Whether a FileNotFoundError is about a path the user named (or one inside it)."""
    if exc.filename is None:
        return False
    missing = os.path.abspath(os.path.expanduser(os.fsdecode(exc.filename)))
    return any(missing == p or missing.startswith(p.rstrip(os.sep) + os.sep)
               for p in user_paths(args))


def draft_tokens(text: str) -> int | str:
    """argparse type of --num-draft-tokens: 'auto' or an int >= 1.

    It only applies with a drafter (refused without one), and 0 would decode plainly under
    the drafter's label, so 0 is refused with the fix named.
    """
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1 or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{value} drafts nothing: give N >= 1 or 'auto', or drop the drafter flag for plain "
            "decoding")
    return value


def bars() -> bool:
    """Whether progress bars show: `--progress` (EXACTSPEC_PROGRESS=1) forces them, 0 hides
    them, otherwise only when stderr is a terminal (as exactspec.models.loading.progress_off)."""
    flag = os.environ.get("EXACTSPEC_PROGRESS", "").strip()
    if flag in ("0", "1"):
        return flag == "1"
    return sys.stderr.isatty()


def warn_lossy(verify: str, tail: str = "") -> None:
    """The one stderr line every command prints when `verify` is an opt-in lossy rule.

    The library logs its own warning at each `generate` call with such a rule; after this
    line that record would repeat it, so it is dropped until the command ends (`main` calls
    `end_lossy_warning`; the CLI's line is the one).
    """
    print(f"warning: --verify {verify} is a lossy rule: the text is NOT distributed as the "
          f"target's (exactspec audit --lossy measures how far){tail}", file=sys.stderr)
    logger = logging.getLogger("exactspec.engine.arguments")
    if not any(isinstance(f, _LossyRecordFilter) for f in logger.filters):
        logger.addFilter(_LossyRecordFilter())


def end_lossy_warning() -> None:
    """Lets the library's lossy-rule record through again (a command ended; in-process callers
    such as tests run more than one)."""
    logger = logging.getLogger("exactspec.engine.arguments")
    for f in [f for f in logger.filters if isinstance(f, _LossyRecordFilter)]:
        logger.removeFilter(f)


class _LossyRecordFilter(logging.Filter):
    """Drops the library's "LOSSY rule" warning, which `warn_lossy` already printed."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is a LOSSY rule" not in str(record.msg)


def load_model(*args, **kwargs):
    """`exactspec.models.load` for a command's process, which keeps the model to its end: torch,
    transformers and the model made with the collector paused, then settled out of every later
    collection's way (exactspec/_collector.py: ~1 s of a command's start)."""
    from exactspec._collector import collector_paused, settle

    with collector_paused():
        from exactspec.models import load

        model = load(*args, **kwargs)
        settle()
    return model
