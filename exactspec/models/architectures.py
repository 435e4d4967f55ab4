"""What the engine supports of a transformers architecture: the declared contract of its masks.

The engine runs every forward on its own slot cache with its own attention mask (ragged rows,
free rollback, token trees), so what a model's attention sees is decided here, not by
transformers' mask builders. Each supported model type declares how its attention is laid out
(transformers 5.x):

- ``causal``: every layer sees every earlier position (Llama, GPT-2, GPT-NeoX, ...);
- ``window``: every layer sees only the last ``config.sliding_window`` positions when that is
  set (Mistral, Mixtral, Phi-3, Starcoder2, Qwen3-MoE: the model picks transformers'
  sliding-window mask for all its layers from the config alone, without ``layer_types``);
- ``layer_types``: ``config.layer_types`` names each layer ``full_attention`` or
  ``sliding_attention`` (Qwen 2 / 3 with their windows, Gemma 2 / 3, Ministral, SmolLM3, ...),
  and the model takes one mask per kind.

A window of w at the query in position i keeps the keys in positions i - w < j <= i (transformers'
``sliding_window_overlay``); windows are measured in positions, not cache slots (token trees put
nodes of equal depth in different slots).

Anything else is refused by `check_target` with one line naming the feature, never run: an
unknown model type, a layer kind other than the two above (chunked, linear or bidirectional
attention), or a RoPE whose frequencies change with the sequence length inside the model's
context (``longrope`` past its original context), which a cached forward cannot reproduce. Every model type in `LAYOUTS` passes the law test of
``tests/models/test_architecture_law.py`` (the law of the first tokens through `es.generate`
equals the law of transformers' own full forward); a type joins the table only with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from exactspec.errors import InvalidValue

log = logging.getLogger(__name__)

# model_type -> how its layers' attention is laid out (see the module docstring)
LAYOUTS: dict[str, str] = {
    "llama": "causal", "gemma": "causal", "gpt2": "causal", "gpt_neox": "causal",
    "olmo2": "causal", "granite": "causal",
    "mistral": "window", "mixtral": "window", "phi3": "window", "starcoder2": "window",
    "qwen3_moe": "window",
    "qwen2": "layer_types", "qwen2_moe": "layer_types", "qwen3": "layer_types",
    "gemma2": "layer_types", "gemma3_text": "layer_types", "ministral": "layer_types",
    "smollm3": "layer_types",
}
_KINDS = ("full_attention", "sliding_attention")  # the layer kinds our masks implement
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")  # frequencies recomputed from the length


@dataclass(frozen=True)
class AttentionLayout:
    """The masks one model's layers need."""

    window: int | None  # keys within the last `window` positions (None: no sliding layer)
    per_layer_type: bool  # True: the model takes {"full_attention": m, "sliding_attention": m}

    @property
    def sliding(self) -> bool:
        return self.window is not None

    def mask(self, visible: torch.Tensor, query_pos: torch.Tensor, slot_pos: torch.Tensor,
             dtype: torch.dtype):
        """The additive mask(s) transformers' forward takes.

        visible [B, T, S] bool: causal / tree visibility of slot s to query t; query_pos [B, T]
        and slot_pos [B, S]: the positions they hold. Returns a [B, 1, T, S] tensor of 0 / min,
        or a dict of them by layer kind.
        """
        neg = torch.finfo(dtype).min
        full = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        full = full.masked_fill(~visible, neg)[:, None]  # [B, 1, T, S]
        if self.window is None:
            return {"full_attention": full} if self.per_layer_type else full
        near = slot_pos[:, None, :] > query_pos[:, :, None] - self.window  # [B, T, S]
        sliding = full.masked_fill(~near[:, None], neg)  # [B, 1, T, S]
        if not self.per_layer_type:
            return sliding
        return {"full_attention": full, "sliding_attention": sliding}


    def visibility(self, visible: torch.Tensor, query_pos: torch.Tensor,
                   slot_pos: torch.Tensor) -> dict[str, torch.Tensor]:
        """`mask`'s boolean form for the lean forward: {layer kind: [B, 1, T, S] bool} (True =
        visible), the sliding kind present only when the model has a window."""
        full = visible[:, None]  # [B, 1, T, S]
        if self.window is None:
            return {"full_attention": full}
        near = slot_pos[:, None, :] > query_pos[:, :, None] - self.window  # [B, T, S]
        return {"full_attention": full, "sliding_attention": full & near[:, None]}


def _refuse(model_type: str, what: str) -> InvalidValue:
    return InvalidValue(f"{what} is not supported by exactspec's engine (model type "
                        f"{model_type!r}): its output law would not be the model's; "
                        f"use a model without it")


def attention_layout(config, *, strict: bool = True) -> AttentionLayout:
    """The declared layout of `config`'s model (its text config for multimodal wrappers).

    strict (a target): anything outside the contract raises InvalidValue naming it. Not strict
    (a drafter, which may approximate without changing the output law): the best layout we
    have, with a log line saying what is not honoured.
    """
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = getattr(cfg, "model_type", None) or "unknown"
    try:
        return _layout(cfg, model_type)
    except InvalidValue:
        if strict:
            raise
        log.warning("drafter of model type %r: attention features beyond exactspec's contract "
                    "are approximated (the output law stays the target's)", model_type)
        window = getattr(cfg, "sliding_window", None)
        return AttentionLayout(window or None, bool(getattr(cfg, "layer_types", None)))


def _layout(cfg, model_type: str) -> AttentionLayout:
    kind = LAYOUTS.get(model_type)
    if kind is None:
        raise InvalidValue(
            f"model type {model_type!r} is not among the architectures whose output law "
            f"exactspec has tested ({', '.join(sorted(LAYOUTS))}); it is refused rather than "
            f"run with masks that may not be its own")
    window = getattr(cfg, "sliding_window", None)
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    other = sorted(set(layer_types) - set(_KINDS))
    if other:
        raise _refuse(model_type, f"layer_types {other} on layer "
                                  f"{next(i for i, t in enumerate(layer_types) if t in other)}")
    if getattr(cfg, "attention_chunk_size", None):
        raise _refuse(model_type, f"attention_chunk_size={cfg.attention_chunk_size}")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise _refuse(model_type, "use_bidirectional_attention=True")
    _check_rope(cfg, model_type)
    if kind == "causal":
        return AttentionLayout(None, False)
    if kind == "window":
        return AttentionLayout(window if window else None, False)
    sliding = "sliding_attention" in layer_types
    if sliding and not window:
        raise _refuse(model_type, f"sliding_attention layers with sliding_window={window!r}")
    return AttentionLayout(window if sliding else None, True)


def _check_rope(cfg, model_type: str) -> None:
    """Refuse a RoPE that recomputes its frequencies from the sequence length inside the
    model's context: then keys cached early were rotated by other frequencies than a full
    forward over the whole sequence uses. `dynamic` (NTK) rescales only past
    max_position_embeddings, which the engine never reaches (longer sequences are refused);
    `longrope` switches factors past original_max_position_embeddings."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    per_kind = [v for v in params.values() if isinstance(v, dict)] or [params]
    max_pos = getattr(cfg, "max_position_embeddings", None)
    for rope in per_kind:
        rope_type = str(rope.get("rope_type", rope.get("type", "default")))
        if not any(t in rope_type for t in _LENGTH_DEPENDENT_ROPE):
            continue
        original = max_pos if "dynamic" in rope_type else rope.get(
            "original_max_position_embeddings", getattr(cfg, "original_max_position_embeddings",
                                                        None))
        if original is None or max_pos is None or max_pos > original:
            raise _refuse(model_type, f"rope_type={rope_type!r} (its frequencies change once a "
                                      f"sequence passes {original} of the {max_pos} positions)")


def check_target(model) -> AttentionLayout:
    """The layout of a target model (a transformers model or anything with `.config`);
    raises InvalidValue naming the unsupported feature."""
    return attention_layout(model.config, strict=True)
