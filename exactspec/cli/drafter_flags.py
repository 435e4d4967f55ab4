"""The command line's drafter flags, the same for every command (generate, serve, batch,
bench-serve), one per drafter of the registry (`drafters/registry.py`) that has a flag.

    add_drafter_flags(parser)           --draft MODEL | --prompt-lookup | ... --tree --siblings
    drafter_spec(args) -> DrafterSpec   the flags as one spec, combinations refused by name
    drafter_from_args(args, target)     the drafter (or None) and its spec

Nothing here imports torch. Mistakes raise InvalidValue (exit code 2 on the command line) naming
the flag and the fix; the flags' own argument errors are argparse's.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from exactspec.drafters.quantized_formats import BACKENDS, BITS, bits_text
from exactspec.drafters.registry import DRAFTERS, SIBLINGS, DrafterSpec, build, drafter_flags
from exactspec.errors import InvalidValue


def _bits(text: str) -> int:
    """argparse type of --quantized-draft."""
    try:
        bits = int(text)
    except ValueError:
        bits = None
    if bits not in BITS:
        raise argparse.ArgumentTypeError(f"--quantized-draft takes {bits_text()} bits, got {text}")
    return bits


def _model_arg(metavar: str) -> dict:
    return {"metavar": metavar, "default": None}


@dataclass(frozen=True)
class Flag:
    """A drafter's flag: its help and how argparse reads it."""

    help: str  # the flag's help
    # argparse keywords: an argument (metavar, nargs, const, type) or a switch
    argument: dict = field(default_factory=lambda: {"action": "store_true"})


# registry name -> its flag (the flag itself is the registry's `Entry.flag`; dest: the name,
# "-" -> "_")
FLAGS: dict[str, Flag] = {
    "draft": Flag("draft model sharing the target's vocabulary", _model_arg("MODEL")),
    "cross-vocab-draft": Flag(
        "draft model with another tokenizer (es.CrossVocabDraft: tokens matched by the text "
        "they stand for; still exact)", _model_arg("MODEL")),
    "prompt-lookup": Flag("draft by copying n-grams from the prompt and output"),
    "eagle": Flag(
        "draft with an EAGLE-style head over the target's features: the shipped name "
        "(default smollm2-135m) or a directory from train-draft",
        {"metavar": "HEAD", "nargs": "?", "const": "smollm2-135m", "default": None}),
    "quantized-draft": Flag(
        "draft with the target itself, weight-only quantized to 8 (int8, the default) or 4 "
        "(int4) bits, or 16 (bfloat16); needs no training",
        {"metavar": "BITS", "nargs": "?", "const": 8, "type": _bits, "default": None}),
    "gguf-draft": Flag(
        "draft with llama.cpp running a GGUF of the target (default: the embedded model's "
        "own file); needs llama-cpp-python",
        {"metavar": "GGUF", "nargs": "?", "const": "", "default": None}),
}


def _dest(name: str) -> str:
    return name.replace("-", "_")


def _tree_type(text: str):
    """argparse type of --tree: '3,2,1' or 'dynamic:16[:4[:6]]' (drafters.tree_shape)."""
    from exactspec.drafters.tree_shape import parse_tree

    try:
        return parse_tree(text)
    except (InvalidValue, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _layers_type(text: str) -> tuple[int, ...]:
    """argparse type of --draft-layers: '0-3,7' -> (0, 1, 2, 3, 7)."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected layer indices like "
                                         "0-9,20-29") from None
    return tuple(out)


def _vocab_type(text: str) -> int | str:
    """argparse type of --draft-vocab: a number of tokens (>= 1), or a path."""
    if text.strip().lstrip("-").isdigit():
        n = int(text)
        if n < 1:
            raise argparse.ArgumentTypeError(f"--draft-vocab {text}: give a number of tokens "
                                             ">= 1, or a JSON file of token ids")
        return n
    return text


def add_drafter_flags(parser: argparse.ArgumentParser) -> None:
    """Every drafter's flag (at most one of them), and --tree, --siblings, --draft-backend,
    --draft-layers, --draft-vocab; `drafter_spec` reads them back."""
    group = parser.add_mutually_exclusive_group()
    for name, entry in DRAFTERS.items():
        if entry.flag is None:
            continue
        flag = FLAGS[name]
        group.add_argument(entry.flag, dest=_dest(name), help=flag.help, **flag.argument)
    parser.add_argument(
        "--tree", type=_tree_type, default=None, metavar="B1,B2,..|dynamic:N",
        help="draft a token tree: branching B1 at depth 1, B2 at depth 2, ... (e.g. --tree "
        "3,2,1), or dynamic:BUDGET[:TOP_K[:DEPTH]] for a tree grown where the draft is "
        "confident (EAGLE-2; e.g. --tree dynamic:16, default top-k 4, depth 6); with "
        f"{drafter_flags('any')} (torch backend), or {drafter_flags('fixed')} (fixed only: B1 "
        "matches as branches, depth = the count)")
    parser.add_argument(
        "--siblings", choices=SIBLINGS, default=None,
        help="how a tree's children are drafted: sampled without replacement (default), "
        "i.i.d., or the draft's top-k (deterministic; EAGLE-2's choice, best at temperature "
        "0); needs --tree")
    parser.add_argument(
        "--draft-backend", choices=BACKENDS, default=None,
        help="how --quantized-draft runs: llama.cpp (fastest; `make llama-cpp`), torch, or "
        "auto (llama.cpp when installed; default)")
    parser.add_argument(
        "--draft-layers", type=_layers_type, default=None, metavar="I,J,..",
        help="--quantized-draft keeps only these target layers (e.g. 0-9,20-29; torch "
        "backend)")
    parser.add_argument(
        "--draft-vocab", type=_vocab_type, default=None, metavar="N|FILE",
        help="--quantized-draft's LM head keeps only N tokens, the ones the target itself "
        "uses most (found once per model by letting it generate; cached), or the token ids "
        "of a JSON file; still exact (torch backend, Llama-family targets; e.g. 16384)")


def _given(args: argparse.Namespace, dest: str) -> bool:
    value = getattr(args, dest, None)
    return value is not None and value is not False


def _refuse(args: argparse.Namespace, flags: dict[str, str], allowed: bool, what: str) -> None:
    for dest, flag in flags.items():
        if not allowed and _given(args, dest):
            raise InvalidValue(f"{flag} only applies with {what}")


def drafter_spec(args: argparse.Namespace) -> DrafterSpec | None:
    """The drafter the flags of `add_drafter_flags` name (None: plain decoding), every flag
    that would be ignored in this combination refused with one line naming it. A command's
    --dtype, when it has one, is the spec's dtype (a draft model loaded by name)."""
    chosen = [name for name in DRAFTERS if _given(args, _dest(name))]
    assert len(chosen) <= 1, "argparse's mutually exclusive group lets one drafter through"
    name = chosen[0] if chosen else None
    entry = DRAFTERS[name] if name else None
    tree = getattr(args, "tree", None)
    _refuse(args, {"tree": "--tree"}, entry is not None and entry.trees != "none",
            drafter_flags("any+fixed"))
    _refuse(args, {"siblings": "--siblings"}, tree is not None, "--tree")
    if entry is not None and entry.trees == "fixed" and tree is not None and not tree.fixed:
        raise InvalidValue(f"{entry.flag} drafts fixed trees only (--tree B,1,1: B matches as "
                           f"branches); a dynamic tree needs {drafter_flags('any')}")
    if entry is not None and entry.trees == "fixed" and _given(args, "siblings"):
        raise InvalidValue(f"--siblings does not apply to {entry.flag}: its branches are "
                           "copied matches (point masses)")
    quantized = name == "quantized-draft"
    if quantized and tree is not None and getattr(args, "draft_backend", None) == "llama.cpp":
        raise InvalidValue("--draft-backend llama.cpp drafts chains only; --tree needs "
                           "--draft-backend torch (or auto, which picks torch for trees)")
    _refuse(args, {"draft_backend": "--draft-backend", "draft_layers": "--draft-layers",
                   "draft_vocab": "--draft-vocab"}, quantized, "--quantized-draft")
    if (quantized and getattr(args, "draft_vocab", None) is not None
            and getattr(args, "draft_backend", None) == "llama.cpp"):
        raise InvalidValue("--draft-backend llama.cpp runs the whole head; --draft-vocab needs "
                           "--draft-backend torch (or auto, which picks torch for it)")
    if name is None:
        return None
    source = getattr(args, _dest(name))
    return DrafterSpec(name, None if source is True else source, tree,
                       getattr(args, "siblings", None), getattr(args, "draft_backend", None),
                       getattr(args, "draft_layers", None), getattr(args, "dtype", "float32"),
                       getattr(args, "draft_vocab", None))


def drafter_from_args(args: argparse.Namespace,
                      target) -> tuple[object | None, DrafterSpec | None]:
    """The drafter the flags name, built for `target`, and its spec (None, None: plain
    decoding). `spec.label(drafter)` names it; call it after decoding for a quantized draft,
    whose backend is settled at `begin`."""
    spec = drafter_spec(args)
    return (None, None) if spec is None else (build(spec, target), spec)
