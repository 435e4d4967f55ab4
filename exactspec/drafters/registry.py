"""One table from a drafter's name and options to its constructor, and the command line's
drafter flags built from it, the same for every command (generate, serve, batch).

    DRAFTERS["draft"].build(DrafterSpec("draft", "smollm2-135m"), target) -> a DraftModel
    add_drafter_flags(parser)           --draft MODEL | --prompt-lookup | ... --tree --siblings
    drafter_spec(args) -> DrafterSpec   the flags as one spec, combinations refused by name
    drafter_from_args(args, target)     the drafter (or None) and its label

Adding a drafter is one `Entry` line here (its flag, its constructor, whether it drafts trees,
the words `exactspec bench` names its engines by: `BenchUse`).
Nothing here imports torch: the constructors import their drafter when called, so `exactspec
--help` stays fast. Mistakes raise InvalidValue (exit code 2 on the command line) naming the
flag and the fix; the flags' own argument errors are argparse's.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field

from exactspec.errors import InvalidValue

BITS = (8, 4, 16)  # --quantized-draft: int8, int4, bfloat16
SIBLINGS = ("without_replacement", "iid", "deterministic")  # sampling.SIBLING_KINDS, in help order
BACKENDS = ("auto", "torch", "llama.cpp")  # --draft-backend


@dataclass(frozen=True)
class DrafterSpec:
    """A drafter by name and options: what the flags say, and what a Ray worker is sent."""

    name: str  # a key of DRAFTERS: "draft", "prompt-lookup", "quantized-draft", ...
    # the flag's argument: MODEL (or a loaded model), HEAD, GGUF, BITS; None: the flag has none
    source: object = None
    tree: object | None = None  # a TreeSpec (Branching / DynamicTree); None: chains
    siblings: str | None = None  # how a tree's children are drawn; None: the drafter's default
    backend: str | None = None  # --draft-backend of a quantized draft; None: "auto"
    layers: tuple[int, ...] | None = None  # target layers a quantized draft keeps; None: all
    dtype: str = "float32"  # weights of a draft model loaded by name

    @property
    def entry(self) -> Entry:
        return DRAFTERS[self.name]

    def label(self, drafter=None) -> str:
        """What reports call this drafter ("draft smollm2-135m, tree (2, 2), siblings iid");
        a quantized draft's backend is read from the built `drafter` (settled at `begin`)."""
        text = self.entry.label(self, drafter)
        if self.tree is not None and self.entry.trees == "any":
            text += f", tree {self.tree}, siblings {self.siblings or SIBLINGS[0]}"
        return text


@dataclass(frozen=True)
class BenchUse:
    """How `exactspec bench` runs a drafter of the table: the word its engines are named by
    ("exactspec WORD K=4", "exactspec WORD auto", "exactspec WORD tree 3x4") and the spec
    options that word fixes; a drafter without one is not benched."""

    word: str  # in engine names: "lookup", "qdraft int8", "cross-vocab", ...
    source: object = None  # the spec's source; None: the bench's own (its draft model, ...)
    backend: str | None = None  # a quantized draft's --draft-backend; None: auto
    k: str = "k"  # the default engines' K: "k" (the bench's K, 4) or "qk" (its quantized K, 6)
    # the default engines: "K" (fixed K), "K block" (block verification, sampling modes only),
    # "auto" (K per step from measured costs)
    engines: tuple[str, ...] = ("K", "auto")
    default: str | None = None  # the bench's source when the user gives none (a model name)
    reuse: bool = False  # one drafter for every run of an engine (a per-target map built at
    # its first `begin`); False: a fresh one per run, as a user's first call sees it


@dataclass(frozen=True)
class Entry:
    """One drafter of the table."""

    flag: str | None  # its command-line flag; None: the library and the bench only
    build: Callable[[DrafterSpec, object], object]  # (spec, target Model) -> the drafter
    label: Callable[[DrafterSpec, object], str]  # (spec, the built drafter or None) -> name
    help: str  # the flag's help
    trees: str = "none"  # "any": fixed and dynamic trees; "fixed": branching only; "none"
    # argparse keywords of the flag: an argument (metavar, nargs, const, type) or a switch
    argument: dict = field(default_factory=lambda: {"action": "store_true"})
    bench: tuple[BenchUse, ...] = ()  # its engines in `exactspec bench`; (): not benched
    supports: Callable[[object], bool] | None = None  # (target model) -> can it draft for it

    @property
    def takes_source(self) -> bool:
        """Whether the drafter is built from an argument (a model, a head, bits)."""
        return "metavar" in self.argument


def _trees(spec: DrafterSpec) -> dict:
    """The tree keywords of a drafter that takes `tree=` / `siblings=`."""
    if spec.tree is None:
        return {}
    return {"tree": spec.tree, "siblings": spec.siblings or SIBLINGS[0]}


def _model(spec: DrafterSpec):
    """The draft model the spec names: loaded by name or path, or already loaded (the bench)."""
    if not isinstance(spec.source, str):
        return spec.source  # an exactspec Model or a transformers model
    from exactspec.models import load

    return load(spec.source, dtype=spec.dtype)


def _draft(spec: DrafterSpec, target):
    from exactspec.drafters.draft_model import DraftModel

    return DraftModel(_model(spec), **_trees(spec))


def _cross_vocab(spec: DrafterSpec, target):
    from exactspec.drafters.cross_vocab import CrossVocabDraft

    return CrossVocabDraft(_model(spec))


def _matches(spec: DrafterSpec) -> dict:
    """A point-mass drafter's tree (M, 1, ..., 1): M matches as branches, depth D."""
    return {} if spec.tree is None else {"branches": spec.tree[0], "depth": len(spec.tree)}


def _prompt_lookup(spec: DrafterSpec, target):
    from exactspec.drafters.prompt_lookup import PromptLookup

    return PromptLookup(**_matches(spec))


def _suffix(spec: DrafterSpec, target):
    from exactspec.drafters.suffix import SuffixDrafter

    m = _matches(spec)
    return SuffixDrafter(**m, tree_nodes=m["branches"] * m["depth"]) if m else SuffixDrafter()


def _eagle(spec: DrafterSpec, target):
    from exactspec.drafters.eagle import load_drafter

    return load_drafter(spec.source, target=target, **_trees(spec))


def _quantized(spec: DrafterSpec, target):
    from exactspec.drafters.quantized import QuantizedDraft

    return QuantizedDraft(int(spec.source), layers=spec.layers, backend=spec.backend or "auto",
                          **_trees(spec))


def _quantized_supports(model) -> bool:
    from exactspec.drafters.quantized import QuantizedDraft

    return QuantizedDraft.supports(model)


def _gguf(spec: DrafterSpec, target):
    from exactspec.drafters.gguf_draft import GgufDraft

    return GgufDraft(spec.source or getattr(target, "name", "smollm2-135m"))  # default: its own


def _bits(text: str) -> int:
    """argparse type of --quantized-draft."""
    try:
        bits = int(text)
    except ValueError:
        bits = None
    if bits not in BITS:
        raise argparse.ArgumentTypeError(f"--quantized-draft takes 8 (int8), 4 (int4) or 16 "
                                         f"(bfloat16) bits, got {text}")
    return bits


def _model_arg(metavar: str) -> dict:
    return {"metavar": metavar, "default": None}


# the table, in the order the flags are listed; the dest of each flag is its name, "-" -> "_"
DRAFTERS: dict[str, Entry] = {
    "draft": Entry("--draft", _draft, lambda s, d: f"draft {s.source}",
                   "draft model sharing the target's vocabulary", "any", _model_arg("MODEL"),
                   (BenchUse("draft", engines=("K", "K block", "auto")),)),
    "cross-vocab-draft": Entry(
        "--cross-vocab-draft", _cross_vocab, lambda s, d: f"cross-vocabulary draft {s.source}",
        "draft model with another tokenizer (es.CrossVocabDraft: tokens matched by the text "
        "they stand for; still exact)", "none", _model_arg("MODEL"),
        (BenchUse("cross-vocab", default="smollm2-135m", reuse=True),)),
    "prompt-lookup": Entry(
        "--prompt-lookup", _prompt_lookup,
        lambda s, d: "prompt lookup" + (f", {s.tree[0]} branches" if s.tree else ""),
        "draft by copying n-grams from the prompt and output", "fixed",
        bench=(BenchUse("lookup", engines=("K", "K block", "auto")),)),
    "eagle": Entry(
        "--eagle", _eagle, lambda s, d: f"eagle {s.source}",
        "draft with an EAGLE-style head over the target's features: the shipped name "
        "(default smollm2-135m) or a directory from train-draft", "any",
        {"metavar": "HEAD", "nargs": "?", "const": "smollm2-135m", "default": None},
        (BenchUse("eagle", reuse=True),)),
    "quantized-draft": Entry(
        "--quantized-draft", _quantized,
        lambda s, d: f"quantized draft {s.source}-bit ({getattr(d, 'backend', 'auto')})",
        "draft with the target itself, weight-only quantized to 8 (int8, the default) or 4 "
        "(int4) bits, or 16 (bfloat16); needs no training", "any",
        {"metavar": "BITS", "nargs": "?", "const": 8, "type": _bits, "default": None},
        tuple(BenchUse(f"qdraft {fmt}{' torch' * torch}", bits, "torch" if torch else None,
                       "qk", ("K",) if torch else ("K", "auto"))
              for fmt, bits in (("int8", 8), ("int4", 4)) for torch in (False, True)),
        _quantized_supports),
    "gguf-draft": Entry(
        "--gguf-draft", _gguf, lambda s, d: f"gguf draft {d!r}",
        "draft with llama.cpp running a GGUF of the target (default: the embedded model's "
        "own file); needs llama-cpp-python", "none",
        {"metavar": "GGUF", "nargs": "?", "const": "", "default": None}),
    "suffix": Entry(
        None, _suffix,
        lambda s, d: "suffix" + (f", {s.tree[0]} branches" if s.tree else ""),
        "draft from suffix tries over the context and earlier outputs (es.SuffixDrafter)",
        "fixed", bench=(BenchUse("suffix"),)),
}


def _dest(name: str) -> str:
    return name.replace("-", "_")


def _flags(kind: str) -> str:
    """'--draft, --eagle or --quantized-draft': the flags of the drafters whose `trees` is
    `kind` ("any", "fixed", "any+fixed", or "all" for every drafter)."""
    if kind == "all":
        names = [e.flag for e in DRAFTERS.values() if e.flag]
    else:  # "any+fixed": the drafters of every tree kind, kind by kind
        names = [e.flag for k in kind.split("+") for e in DRAFTERS.values()
                 if e.flag and e.trees == k]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


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


def add_drafter_flags(parser: argparse.ArgumentParser) -> None:
    """Every drafter's flag (at most one of them), and --tree, --siblings, --draft-backend,
    --draft-layers; `drafter_spec` reads them back."""
    group = parser.add_mutually_exclusive_group()
    for name, entry in DRAFTERS.items():
        if entry.flag is None:
            continue
        group.add_argument(entry.flag, dest=_dest(name), help=entry.help, **entry.argument)
    parser.add_argument(
        "--tree", type=_tree_type, default=None, metavar="B1,B2,..|dynamic:N",
        help="draft a token tree: branching B1 at depth 1, B2 at depth 2, ... (e.g. --tree "
        "3,2,1), or dynamic:BUDGET[:TOP_K[:DEPTH]] for a tree grown where the draft is "
        "confident (EAGLE-2; e.g. --tree dynamic:16, default top-k 4, depth 6); with "
        f"{_flags('any')} (torch backend), or {_flags('fixed')} (fixed only: B1 matches as "
        "branches, depth = the count)")
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
            _flags("any+fixed"))
    _refuse(args, {"siblings": "--siblings"}, tree is not None, "--tree")
    if entry is not None and entry.trees == "fixed" and tree is not None and not tree.fixed:
        raise InvalidValue(f"{entry.flag} drafts fixed trees only (--tree B,1,1: B matches as "
                           f"branches); a dynamic tree needs {_flags('any')}")
    if entry is not None and entry.trees == "fixed" and _given(args, "siblings"):
        raise InvalidValue(f"--siblings does not apply to {entry.flag}: its branches are "
                           "copied matches (point masses)")
    quantized = name == "quantized-draft"
    if quantized and tree is not None and getattr(args, "draft_backend", None) == "llama.cpp":
        raise InvalidValue("--draft-backend llama.cpp drafts chains only; --tree needs "
                           "--draft-backend torch (or auto, which picks torch for trees)")
    _refuse(args, {"draft_backend": "--draft-backend", "draft_layers": "--draft-layers"},
            quantized, "--quantized-draft")
    if name is None:
        return None
    source = getattr(args, _dest(name))
    return DrafterSpec(name, None if source is True else source, tree,
                       getattr(args, "siblings", None), getattr(args, "draft_backend", None),
                       getattr(args, "draft_layers", None), getattr(args, "dtype", "float32"))


def build(spec: DrafterSpec, target) -> object:
    """The drafter `spec` names, for `target` (an exactspec Model)."""
    if spec.name not in DRAFTERS:
        raise InvalidValue(f"unknown drafter {spec.name!r}; choose one of "
                           f"{', '.join(DRAFTERS)}")
    return DRAFTERS[spec.name].build(spec, target)


def drafter_from_args(args: argparse.Namespace,
                      target) -> tuple[object | None, DrafterSpec | None]:
    """The drafter the flags name, built for `target`, and its spec (None, None: plain
    decoding). `spec.label(drafter)` names it; call it after decoding for a quantized draft,
    whose backend is settled at `begin`."""
    spec = drafter_spec(args)
    return (None, None) if spec is None else (build(spec, target), spec)


def drafter_flags() -> str:
    """'--draft, --cross-vocab-draft, ... or --gguf-draft': every drafter flag (messages)."""
    return _flags("all")


def bench_uses() -> dict[str, tuple[str, BenchUse]]:
    """Every word `exactspec bench` names engines by -> (the drafter's name, its BenchUse),
    in the table's order."""
    return {use.word: (name, use) for name, entry in DRAFTERS.items() for use in entry.bench}


def match_words() -> set[str]:
    """The bench words of the point-mass drafters (trees "fixed"): their trees are M matches
    of depth D, tree (M, 1, ..., 1), spelled "MxD" in engine names and tables."""
    return {word for word, (name, _) in bench_uses().items() if DRAFTERS[name].trees == "fixed"}
