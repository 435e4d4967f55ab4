"""The decode loop: batching, ragged acceptance, stopping, streaming, logprobs, draft length.

`Decoder` is the engine's one boundary: `generate`, `batch` and the server admit rows (each
with its own budget, stop rule and sampling parameters), step them and drop them through it.

api.py        `generate` and `stream` (their defaults, `DEFAULTS`); arguments.py validates
              their arguments and parses `verify` once
decoder.py    `Decoder`: admit / step / drop; it builds its parts once and hands them to the
              step: rows.py `RowBatch` (the rows and their tensors), drafting.py `DraftSide`
              (the drafter, its features and faults), verifier.py `Verifier` (each step's
              verdict), policy.py `DraftLengthPolicy` (draft lengths, fixed or "auto"; plan.py:
              its arithmetic, pure functions)
step.py       one chain step: propose -> forward -> standardize -> verify -> commit
tree_step.py  the same step for token trees; commit.py: a step's end, shared by both
stopping.py   EOS, stop strings, budgets; grammar.py: the rows' grammar matchers
results.py    `Generation` and its stats (mean acceptance length defined once, totals merged)
engine.py     `Engine`: a long-lived engine for RL loops and batch jobs (`update_weights`)
(docs/generate.md, docs/architecture.md)
"""

from exactspec.lazy import lazy_names

# public name -> module defining it, imported on first use (PEP 562): a light module of the
# package (results.py for the bench's llama.cpp child) is imported without the decode loop
# and, through it, torch's models and transformers
_LAZY: dict[str, str] = {
    **dict.fromkeys(["TextStream", "generate", "stream"], "exactspec.engine.api"),
    **dict.fromkeys(["DecodeConfig", "Decoder"], "exactspec.engine.decoder"),
    **dict.fromkeys(["Generation", "GenerationStats"], "exactspec.engine.results"),
    **dict.fromkeys(["Row", "RowOutput"], "exactspec.engine.rows"),
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_names("exactspec.engine", _LAZY, globals())
