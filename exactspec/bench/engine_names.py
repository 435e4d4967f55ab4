"""The words `exactspec bench` names its engines by, per drafter of the registry
(`drafters/registry.py`): "exactspec WORD K=4", "exactspec WORD auto", "exactspec WORD tree 3x4".

    BENCH_USES["prompt-lookup"]  (BenchUse("lookup", ...),): the drafter's engines
    bench_uses()                 every word -> (the drafter's registry name, its BenchUse)
    match_words()                the words of the point-mass drafters (trees spelled "MxD")

Benching a drafter of the registry is one line of BENCH_USES; a drafter without one is not
benched. Nothing here imports torch (`exactspec bench --help` reads it).
"""

from __future__ import annotations

from dataclasses import dataclass

from exactspec.drafters.registry import DRAFTERS


@dataclass(frozen=True)
class BenchUse:
    """How `exactspec bench` runs a drafter of the registry: the word its engines are named by
    ("exactspec WORD K=4", "exactspec WORD auto", "exactspec WORD tree 3x4") and the spec
    options that word fixes."""

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
    vocab: int | None = None  # a quantized draft's --draft-vocab (its head's kept tokens)


VOCABS = (8192, 16384, 32768)  # the reduced heads' sizes the bench can name

# registry name -> the words its engines are named by, in the order they are listed
BENCH_USES: dict[str, tuple[BenchUse, ...]] = {
    "draft": (BenchUse("draft", engines=("K", "K block", "auto")),),
    "cross-vocab-draft": (BenchUse("cross-vocab", default="smollm2-135m", reuse=True),),
    "prompt-lookup": (BenchUse("lookup", engines=("K", "K block", "auto")),),
    "eagle": (BenchUse("eagle", reuse=True),),
    # int8 / int4 on auto's backend (fixed K and auto K) and on torch's (fixed K)
    "quantized-draft": tuple(
        BenchUse(f"qdraft {fmt}{' torch' * on_torch}", bits, "torch" if on_torch else None,
                 "qk", ("K",) if on_torch else ("K", "auto"))
        for fmt, bits in (("int8", 8), ("int4", 4)) for on_torch in (False, True))
    # the reduced head (--draft-vocab N: the target's N most used tokens), torch backend; no
    # default engines: named, e.g. --engines 'qdraft int8 torch vocab=16384 K=6'
    + tuple(BenchUse(f"qdraft {fmt} torch vocab={n}", bits, "torch", "qk", (), vocab=n)
            for fmt, bits in (("int8", 8), ("int4", 4)) for n in VOCABS),
    "suffix": (BenchUse("suffix"),),
}


def bench_uses() -> dict[str, tuple[str, BenchUse]]:
    """Every word `exactspec bench` names engines by -> (the drafter's name, its BenchUse),
    in the registry's order (a word whose drafter is not in the registry is not used)."""
    return {use.word: (name, use) for name in DRAFTERS for use in BENCH_USES.get(name, ())}


def match_words() -> set[str]:
    """The bench words of the point-mass drafters (trees "fixed"): their trees are M matches
    of depth D, tree (M, 1, ..., 1), spelled "MxD" in engine names and tables."""
    return {word for word, (name, _) in bench_uses().items() if DRAFTERS[name].trees == "fixed"}
