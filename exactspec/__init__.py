"""exactspec: lossless speculative decoding, with an audit that proves it.

p is always the target distribution and q the draft distribution (Leviathan et al. 2023).

Names are imported on first use (PEP 562 `__getattr__`), so `import exactspec` and
`exactspec --help` do not pay for torch and transformers. To export a new name, add one line
to `_LAZY`: public name -> the module that defines it. Subpackages (`es.sampling`,
`es.drafters`, `es.audit`, ...) are imported on first use the same way.

What lives where, the lowest layer first (sampling/ imports nothing from the rest; the
layers are in docs/architecture.md; docs/ has a page per topic):
sampling/      pure batched math: SamplingParams, p and q from logits, the verify rules
kernels/       our batch-invariant C++ CPU operators (built at set-up)
models/        loading, the cache, the target adapter and lean forward, tree attention
drafters/      every drafter behind one Protocol, and their registry (a table)
engine/        the decode step and its parts: generate / stream, Decoder, Engine for RL
invariant/     the batch-invariant mode for trainers: batch_invariant(), token_logprobs
audit/         exact and statistical proofs of losslessness; the seeds' pitfalls
serve/  batch/ the OpenAI-compatible server; resumable JSONL batch jobs (local or Ray)
bench/         `exactspec bench`: engines compared on shipped workloads; study tools
training/      `exactspec train-draft`: data, training and evaluation of EAGLE-style heads
integrations/  glue for training frameworks (TRL's GRPOTrainer)
cli/           the `exactspec` command line, one module per subcommand
errors.py      InvalidValue / InvalidType: the user-mistake errors everything raises
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"

# OpenMP's idle threads (libgomp, torch's and our kernels') spin 300,000 times after each
# parallel region before they sleep. On a busy machine a spinning thread takes the core that
# the forward it left, run on fewer threads (kernels/threads.py), or another process needs
# (the measurements: docs/performance.md, "A busy machine: OpenMP's spinning threads").
# libgomp reads this once, when torch loads it: set here, before torch is imported (a user's
# own setting wins; a process that imported torch first keeps libgomp's default: README, "A
# busy machine").
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

# public name -> module defining it; imported when the name is first used
_LAZY: dict[str, str] = {
    "CrossVocabDraft": "exactspec.drafters",
    "DraftContext": "exactspec.drafters",
    "DraftModel": "exactspec.drafters",
    "Drafter": "exactspec.drafters",
    "EagleDrafter": "exactspec.drafters",
    "GgufDraft": "exactspec.drafters.gguf_draft",
    "PromptLookup": "exactspec.drafters",
    "QuantizedDraft": "exactspec.drafters",
    "SuffixDrafter": "exactspec.drafters",
    "TargetInfo": "exactspec.drafters",
    "load_drafter": "exactspec.drafters",
    "Engine": "exactspec.engine.engine",
    "Generation": "exactspec.engine",
    "GenerationStats": "exactspec.engine",
    "TextStream": "exactspec.engine",
    "generate": "exactspec.engine",
    "stream": "exactspec.engine",
    "Model": "exactspec.models",
    "as_model": "exactspec.models",
    "load": "exactspec.models",
    "Grammar": "exactspec.sampling.grammar",
    "SamplingParams": "exactspec.sampling",
    "Verdict": "exactspec.sampling",
    "probs_from_logits": "exactspec.sampling",
    "verify": "exactspec.sampling",
    "batch_invariant": "exactspec.invariant",
    "is_batch_invariant": "exactspec.invariant",
    "set_batch_invariant": "exactspec.invariant",
    "token_logprobs": "exactspec.invariant",
    "InvalidType": "exactspec.errors",
    "InvalidValue": "exactspec.errors",
    "UserError": "exactspec.errors",
}

__all__ = sorted(_LAZY)  # built from the table, so it never drifts from it


def __getattr__(name: str) -> Any:
    """Import the module defining `name` (or the subpackage `name`) on first use and cache
    the value in this module."""
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name in _subpackages():
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'exactspec' has no attribute {name!r}")
    globals()[name] = value
    return value


def _subpackages() -> set[str]:
    """The modules and subpackages directly inside exactspec (`es.sampling`, ...)."""
    import pkgutil

    return {m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _subpackages())

