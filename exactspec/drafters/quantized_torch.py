"""QuantizedDraft's torch backend: a weight-only quantized copy of the target, drafting as a
DraftModel does.

A target the lean forward runs (`LeanLlama.supports`: the Llama family of `models/lean_arch.py`)
is drafted by the lean forward over int8 per output channel, int4 groups or bfloat16 weights
(`models/lean.py`, `models/formats.py`; on the CPU int8 runs on our own kernel with float32
activations), optionally over a subset of its layers. With every layer and the target's cache
layout it drafts on the target's own KV cache (DraftModel._shared): nothing is prefilled or caught
up. Any other transformers model is drafted by a copy of it with every linear layer quantized the
same way (`models/quantize_modules.py`), through transformers' forward, with all its layers.

`vocab` (lean forward only) keeps the LM head's rows of those tokens only (FR-Spec / VocabTrim:
the target's frequent tokens, `drafters/frequent_tokens.py`), so a draft step reads N / V of the
head's bytes; q is 0 outside them and the verifier's residual still covers the whole vocabulary.
"""

from __future__ import annotations

import torch

from exactspec.drafters.base import DraftContext, TargetInfo
from exactspec.drafters.draft_model import DraftModel
from exactspec.drafters.frequent_tokens import kept_tokens
from exactspec.drafters.quantized_formats import BITS
from exactspec.errors import InvalidValue
from exactspec.models.adapter import TargetAdapter
from exactspec.models.lean import LeanLlama, lean_forward_for
from exactspec.models.quantize_modules import quantized_copy_for


class TorchBackend(DraftModel):
    """Drafts with a quantized copy of the target it is asked to draft for (see the module
    docstring); QuantizedDraft checks the arguments and builds it."""

    standardized_q = True  # q from DraftContext.standardize, not re-checked (base.trusts_q)

    hidden_layers = None  # needs no target features

    def __init__(self, bits: int, layers: tuple[int, ...] | None, group_size: int, tree,
                 siblings: str, vocab=None) -> None:
        self.tree, self.siblings = tree, siblings  # checked by QuantizedDraft (check_tree)
        self.fmt = BITS[bits]  # weight format of the copy
        self.layers = layers  # kept decoder layers (None: all)
        self.group_size = group_size  # int4 group along the input dimension
        # the head's kept tokens: a count (the target's most frequent), ids, a JSON file; None
        # keeps them all (resolved per target at begin: frequent_tokens.kept_tokens)
        self.vocab = vocab
        self.head_rows = None  # [N] long: the kept token ids in use (None: the whole head)
        self._rows_for = None  # the target model head_rows were resolved for
        self.model = None  # the target's view (vocabulary size, name), set at begin
        self.forward: LeanLlama | None = None  # the quantized lean forward in use (Llama)
        self.copy = None  # the quantized transformers copy in use (other architectures)
        self._adapter: TargetAdapter | None = None
        self._fed = None  # [B, S] long: tokens in the draft cache slots

    def begin(self, context: DraftContext, target: TargetInfo, *, share: bool = True) -> None:
        """Build (or take from the cache) the copy of `target.model`'s current weights and
        start drafting; `share`: on the target's KV cache where the layout allows."""
        model = target.model
        n_layers = model.config.num_hidden_layers
        if self.layers is not None and not all(0 <= i < n_layers for i in self.layers):
            raise InvalidValue(f"layers={list(self.layers)} must lie in 0..{n_layers - 1} (the "
                               f"target has {n_layers} layers)")
        self.model = _TargetView(model, target.vocab_size)
        if not LeanLlama.supports(model):  # the generic path: a quantized transformers copy
            for name, value in (("layers", self.layers), ("vocab", self.vocab)):
                if value is not None:
                    raise InvalidValue(
                        f"{name}={_short(value)} needs the lean forward (a Llama-architecture "
                        f"target); {type(model).__name__} is drafted by a quantized copy of all "
                        f"its layers and its whole head: drop {name}=")
            self.forward, self._shared = None, None
            self.copy = quantized_copy_for(model, self.fmt, group_size=self.group_size)
            self._start(TargetAdapter(self.copy, lean=False, strict=False), context)
            return
        self.copy = None
        if self._rows_for is not model:  # once per target (its weights may change: the kept
            # tokens then stay, which can lower acceptance, never change the output's law)
            self.head_rows = (None if self.vocab is None
                              else kept_tokens(self.vocab, model, target.tokenizer))
            self._rows_for = model  # the target the kept tokens were resolved for
        self.forward = lean_forward_for(model, self.fmt, layers=self.layers,
                                        group_size=self.group_size, head_rows=self.head_rows)
        same = share and shares_cache(target.adapter, model, self.layers, self.forward)
        self._shared = target.adapter if same else None
        self._start(TargetAdapter(model, forward=self.forward, strict=False), context)


def _short(value) -> str:
    """A value for an error message: lists and tensors of ids cut short."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    text = repr(list(value) if isinstance(value, tuple) else value)
    return text if len(text) <= 60 else text[:57] + "..."


def shares_cache(adapter, model, layers, forward: LeanLlama | None = None) -> bool:
    """Whether a lean draft of `model` over `layers` (None: all) drafts on the target's KV cache
    held by `adapter` (the engine's TargetAdapter of the target; None: none to share): the same
    model, run by a lean forward over the same layers, and, once the draft's `forward` is built,
    the same cache layout (kernels or not, dtype)."""
    lean = getattr(adapter, "lean", None)
    n_layers = model.config.num_hidden_layers
    if not (isinstance(adapter, TargetAdapter) and lean is not None and adapter.model is model
            and list(range(n_layers) if layers is None else layers) == lean.layer_ids):
        return False
    return forward is None or (lean.kernels, lean.dtype) == (forward.kernels, forward.dtype)


class _TargetView:
    """What DraftModel.propose reads of `self.model`: the vocabulary size and a name."""

    def __init__(self, model, vocab_size: int) -> None:
        self.model = model  # the target's transformers model
        self.vocab_size = vocab_size  # logits width
        self.name = "target"
