"""QuantizedDraft: the target itself, weight-only quantized, drafts for the target.

Self-speculation needs no training and no second model: at `begin` the drafter builds (once per
target and weight version, then cached) a copy of the target's weights in int8 per output
channel or int4 groups (`exactspec/models/formats.py`), optionally over a subset of its layers,
and runs the same lean forward on it with its own KV cache. q is its standardized distribution,
computed by the same function with the same parameters and history as the target's p, so the
verification is exact for every verify method; quantization only lowers how often drafts are
accepted. The copy follows in-place weight updates of the target (an RL policy step): its
weights' version counters are checked at every `begin`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from exactspec.drafters.base import DraftContext, TargetInfo
from exactspec.drafters.draft_model import DraftModel
from exactspec.errors import InvalidType, InvalidValue
from exactspec.models.adapter import TargetAdapter
from exactspec.models.lean import LeanLlama, lean_forward_for

BITS = {8: "int8", 4: "int4", 16: "bfloat16"}  # bits -> weight format


class QuantizedDraft(DraftModel):
    """Drafts with a weight-only quantized copy of the target it is asked to draft for.

    bits: 8 (int8 per output channel, bf16 activations), 4 (min-max int4 groups of
    `group_size` along the input, bf16 activations) or 16 (bfloat16 weights). layers: the
    target's decoder layers the draft keeps (None = all; layer skipping, LayerSkip / SWIFT
    style; on smollm2-135m it drafts badly, see the README). Only Llama-architecture targets
    have the lean forward this needs; others are refused at `begin`.
    """

    hidden_layers = None  # needs no target features

    def __init__(self, bits: int = 8, layers: Sequence[int] | None = None, *,
                 group_size: int = 32) -> None:
        if isinstance(bits, bool) or not isinstance(bits, int):
            raise InvalidType(f"bits must be an int (8, 4 or 16), got {type(bits).__name__}")
        if bits not in BITS:
            raise InvalidValue(f"bits={bits} is not supported; use 8 (int8), 4 (int4) or 16 "
                               "(bfloat16)")
        if layers is not None:
            if isinstance(layers, str | bytes) or not isinstance(layers, Sequence):
                raise InvalidType(f"layers must be a list of layer indices or None, got "
                                  f"{type(layers).__name__}")
            if any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
                raise InvalidType(f"layers must hold ints, got {list(layers)!r}")
            if len(set(layers)) != len(layers) or list(layers) != sorted(layers):
                raise InvalidValue(f"layers={list(layers)!r} must be increasing, without repeats")
        if isinstance(group_size, bool) or group_size not in (32, 64, 128, 256):
            raise InvalidValue(f"group_size={group_size!r} must be 32, 64, 128 or 256")
        self.bits = bits  # weight bits of the copy
        self.fmt = BITS[bits]  # its weight format
        self.layers = None if layers is None else tuple(layers)  # kept decoder layers
        self.group_size = group_size  # int4 group along the input dimension
        self.model = None  # the target's Model view, set at begin
        self.forward: LeanLlama | None = None  # the quantized forward in use
        self._adapter: TargetAdapter | None = None
        self._fed: torch.Tensor | None = None  # [B, S] long: tokens in the draft cache slots

    def __repr__(self) -> str:
        layers = "" if self.layers is None else f", layers={list(self.layers)}"
        return f"QuantizedDraft(bits={self.bits}{layers})"

    def begin(self, context: DraftContext, target: TargetInfo) -> None:
        model = target.model
        if model is None:
            raise InvalidValue("QuantizedDraft drafts with the target's own weights; the engine "
                               "did not pass the target model")
        n_layers = model.config.num_hidden_layers
        if self.layers is not None and not all(0 <= i < n_layers for i in self.layers):
            raise InvalidValue(f"layers={list(self.layers)} must lie in 0..{n_layers - 1} (the "
                               f"target has {n_layers} layers)")
        forward = lean_forward_for(model, self.fmt, layers=self.layers,
                                   group_size=self.group_size)
        if forward is None:
            raise InvalidValue(
                f"QuantizedDraft needs a Llama-architecture target (the lean forward); "
                f"{type(model).__name__} is not one: use DraftModel or PromptLookup instead")
        self.forward = forward
        self.model = _TargetView(model, target.vocab_size)
        self._start(TargetAdapter(model, forward=forward), context)

    def _start(self, adapter: TargetAdapter, context: DraftContext) -> None:
        """Prefill the draft cache with every row's context but its last token."""
        self._adapter = adapter
        prompts = [
            row[: int(n) - 1].tolist()
            for row, n in zip(context.tokens.cpu(), context.lengths.cpu(), strict=True)
        ]
        adapter.prefill(prompts)
        width = context.tokens.shape[1]
        self._fed = torch.full((len(prompts), width), -1, dtype=torch.long,
                               device=adapter.device)
        for i, p in enumerate(prompts):
            self._fed[i, : len(p)] = torch.tensor(p, dtype=torch.long)


class _TargetView:
    """What DraftModel.propose reads of `self.model`: the vocabulary size and a name."""

    def __init__(self, model, vocab_size: int) -> None:
        self.model = model  # the target's transformers model
        self.vocab_size = vocab_size  # logits width
        self.name = "target"
