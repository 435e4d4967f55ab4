"""Drafters behind one small Protocol (see `exactspec.drafters.base`)."""

from exactspec.drafters.base import DraftContext, Drafter, TargetInfo
from exactspec.drafters.cross_vocab import CrossVocabDraft
from exactspec.drafters.draft_model import DraftModel
from exactspec.drafters.dynamic_tree import DynamicTree
from exactspec.drafters.eagle import EagleDrafter, load_drafter
from exactspec.drafters.prompt_lookup import PromptLookup
from exactspec.drafters.quantized import QuantizedDraft
from exactspec.drafters.suffix import SuffixDrafter

__all__ = ["CrossVocabDraft", "DraftContext", "DraftModel", "Drafter", "DynamicTree",
           "EagleDrafter",
           "PromptLookup", "QuantizedDraft", "SuffixDrafter", "TargetInfo", "load_drafter"]
