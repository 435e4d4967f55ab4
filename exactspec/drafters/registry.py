"""One table from a drafter's name and options to its constructor: what every front end builds
its drafter with (the command line's flags, `cli/drafter_flags.py`; the server; batch jobs;
`exactspec bench`, whose engine words are `bench/engine_names.py`).

    DRAFTERS["draft"].build(DrafterSpec("draft", "smollm2-135m"), target) -> a DraftModel
    build(spec, target)                 the drafter a spec names, unknown names refused
    spec.label(drafter)                 what reports call it
    drafter_flags()                     '--draft, ... or --gguf-draft' (messages)

Adding a drafter is one `Entry` here (its flag, its constructor, whether it drafts trees), its
flag's help and argument in cli/drafter_flags.py and, to bench it, its words in
bench/engine_names.py. Nothing here imports torch: the constructors import their drafter when
called, so `exactspec --help` stays fast. Mistakes raise InvalidValue naming the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from exactspec.errors import InvalidValue

SIBLINGS = ("without_replacement", "iid", "deterministic")  # sampling.SIBLING_KINDS, in help order


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
    # the tokens a quantized draft's LM head keeps: a count (the target's most frequent) or a
    # JSON file of token ids (--draft-vocab); None: the whole head
    vocab: int | str | None = None

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
class Entry:
    """One drafter of the table."""

    flag: str | None  # its flag on every command line; None: the library and the bench only
    build: Callable[[DrafterSpec, object], object]  # (spec, target Model) -> the drafter
    label: Callable[[DrafterSpec, object], str]  # (spec, the built drafter or None) -> name
    trees: str = "none"  # "any": fixed and dynamic trees; "fixed": branching only; "none"
    # what DrafterSpec.source names: "model", "head", "bits" or "gguf"; None: it takes none
    source: str | None = None
    supports: Callable[[object], bool] | None = None  # (target model) -> can it draft for it

    @property
    def takes_source(self) -> bool:
        """Whether the drafter is built from an argument (a model, a head, bits)."""
        return self.source is not None


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
                          vocab=spec.vocab, **_trees(spec))


def _quantized_supports(model) -> bool:
    from exactspec.drafters.quantized import QuantizedDraft

    return QuantizedDraft.supports(model)


def _gguf(spec: DrafterSpec, target):
    from exactspec.drafters.gguf_draft import GgufDraft

    return GgufDraft(spec.source or getattr(target, "name", "smollm2-135m"))  # default: its own


# the table, in the order the flags are listed
DRAFTERS: dict[str, Entry] = {
    "draft": Entry("--draft", _draft, lambda s, d: f"draft {s.source}", "any", "model"),
    "cross-vocab-draft": Entry(
        "--cross-vocab-draft", _cross_vocab,
        lambda s, d: f"cross-vocabulary draft {s.source}", "none", "model"),
    "prompt-lookup": Entry(
        "--prompt-lookup", _prompt_lookup,
        lambda s, d: "prompt lookup" + (f", {s.tree[0]} branches" if s.tree else ""), "fixed"),
    "eagle": Entry("--eagle", _eagle, lambda s, d: f"eagle {s.source}", "any", "head"),
    "quantized-draft": Entry(
        "--quantized-draft", _quantized,
        lambda s, d: (f"quantized draft {s.source}-bit ({getattr(d, 'backend', 'auto')})"
                      + ("" if s.vocab is None else f", vocab {s.vocab}")), "any",
        "bits", _quantized_supports),
    "gguf-draft": Entry("--gguf-draft", _gguf, lambda s, d: f"gguf draft {d!r}", "none", "gguf"),
    "suffix": Entry(
        None, _suffix, lambda s, d: "suffix" + (f", {s.tree[0]} branches" if s.tree else ""),
        "fixed"),
}


def build(spec: DrafterSpec, target) -> object:
    """The drafter `spec` names, for `target` (an exactspec Model)."""
    if spec.name not in DRAFTERS:
        raise InvalidValue(f"unknown drafter {spec.name!r}; choose one of "
                           f"{', '.join(DRAFTERS)}")
    return DRAFTERS[spec.name].build(spec, target)


def drafter_flags(trees: str = "all") -> str:
    """'--draft, --cross-vocab-draft, ... or --gguf-draft': the flags of every drafter ("all"),
    or of the drafters whose `trees` is `trees` ("any", "fixed"; "any+fixed": kind by kind)."""
    if trees == "all":
        names = [e.flag for e in DRAFTERS.values() if e.flag]
    else:
        names = [e.flag for k in trees.split("+") for e in DRAFTERS.values()
                 if e.flag and e.trees == k]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
