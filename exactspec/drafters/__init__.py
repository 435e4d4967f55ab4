"""Drafters behind one small Protocol (see `exactspec.drafters.base`; trees: `tree_shape`):
draft models (`draft_model`, `gguf_draft`, `cross_vocab`), the quantized self-draft (`quantized`,
a front over `quantized_torch` and `quantized_llama_cpp`; `quantized_formats`, `quantized_auto`),
EAGLE-style heads (`eagle`, `eagle_head`, `eagle_tree`), point-mass drafters (`prompt_lookup`,
`suffix`), how trees grow (`tree_draft`, `dynamic_tree`, `siblings`), and `registry`: one table
from a drafter's name and options to its constructor (the command line's flags over it are
`exactspec.cli.drafter_flags`, the bench's words `exactspec.bench.engine_names`).

Names are imported on first use (PEP 562), so the command line can read the registry's flags
without importing torch. Also: `vocab_map` (the byte matching of `cross_vocab`) and `weights/`
(the shipped EAGLE head). docs/: quantized.md, trees.md, suffix.md, eagle.md, cross_vocab.md.
"""

from __future__ import annotations

from exactspec.lazy import lazy_names

# public name -> module defining it; imported when the name is first used
_LAZY: dict[str, str] = {
    "Branching": "exactspec.drafters.tree_shape",
    "CrossVocabDraft": "exactspec.drafters.cross_vocab",
    "DraftContext": "exactspec.drafters.base",
    "DraftModel": "exactspec.drafters.draft_model",
    "Drafter": "exactspec.drafters.base",
    "DynamicTree": "exactspec.drafters.tree_shape",
    "EagleDrafter": "exactspec.drafters.eagle",
    "PromptLookup": "exactspec.drafters.prompt_lookup",
    "QuantizedDraft": "exactspec.drafters.quantized",
    "SuffixDrafter": "exactspec.drafters.suffix",
    "TargetInfo": "exactspec.drafters.base",
    "TreeDrafter": "exactspec.drafters.base",
    "TreeSpec": "exactspec.drafters.base",
    "load_drafter": "exactspec.drafters.eagle",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_names("exactspec.drafters", _LAZY, globals())
