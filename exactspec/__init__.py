"""exactspec: lossless speculative decoding, with an audit that proves it.

p is always the target distribution and q the draft distribution (Leviathan et al. 2023).
"""

from exactspec.drafters import (
    DraftContext,
    Drafter,
    DraftModel,
    EagleDrafter,
    PromptLookup,
    TargetInfo,
    load_drafter,
)
from exactspec.engine import Generation, GenerationStats, TextStream, generate, stream
from exactspec.models import Model, as_model, load
from exactspec.sampling import SamplingParams, Verdict, probs_from_logits, verify

__all__ = [
    "DraftContext", "DraftModel", "Drafter", "EagleDrafter", "Generation", "GenerationStats", "Model",
    "PromptLookup", "SamplingParams", "TargetInfo", "TextStream", "Verdict", "as_model",
    "generate", "load", "load_drafter", "probs_from_logits", "stream", "verify",
]
__version__ = "0.1.0"
