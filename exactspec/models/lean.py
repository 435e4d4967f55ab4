"""The lean forward: Llama-architecture decode steps over a SlotCache, one code path for every
weight format (float32, bfloat16, int8, int4; `exactspec/models/formats.py`).

The target runs it on its own float32 (or bfloat16) weights; `QuantizedDraft` runs the same
forward on a weight-only quantized copy of the target, optionally over a subset of its layers.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from exactspec import kernels
from exactspec.errors import InvalidValue
from exactspec.models.cache import SlotCache
from exactspec.models.formats import FORMATS, Matrix, make_matrix
from exactspec.models.lean_kernels import forward_kernels


class LeanLlama:
    """A lean forward of a Llama-architecture model over a SlotCache, for decode steps.

    Same math as transformers' LlamaForCausalLM (RMSNorm, RoPE from the model's own rotary
    module, GQA attention via SDPA, SwiGLU) with less per-op overhead: q/k/v and gate/up fused
    into one product each (float32 keeps the model's own matrices and fuses only the one-row
    copy), RoPE applied to q and k in one go, `rms_norm` as one op, a boolean mask only when
    rows are ragged or several tokens are fed. `fmt` picks the weight format (see formats.py
    for the kernel each uses and why); `layers` keeps only those decoder layers (layer-skipping
    self-speculation: a draft, not the target). Activations run in the model's own dtype;
    logits are returned in float32, so p and q are always standardized in float32. In float32 the results agree with transformers' forward to float
    rounding (tested).

    On the CPU it runs on our own batch-invariant kernels (`exactspec/kernels`) when they are
    built: every product, norm, RoPE and attention output is reduced in a fixed order, so the
    logits of a position are the same bits whether it is scored alone, inside a verify or a
    tree, in any batch, with any thread count (activations and cache in float32 there). Without
    them (or EXACTSPEC_KERNELS=0) it runs on torch operators, which lack that property.
    """

    def __init__(self, model: PreTrainedModel, fmt: str = "float32", *,
                 layers: Sequence[int] | None = None, group_size: int = 32) -> None:
        if fmt not in FORMATS:
            raise InvalidValue(f"weight format {fmt!r} must be one of {list(FORMATS)}")
        inner, cfg = model.model, model.config
        n_layers = cfg.num_hidden_layers
        self.layer_ids = list(range(n_layers)) if layers is None else list(layers)
        if not self.layer_ids or any(not 0 <= i < n_layers for i in self.layer_ids):
            raise InvalidValue(f"layers={layers!r} must be a non-empty subset of 0..{n_layers - 1}")
        self._model = weakref.ref(model)  # weak: the cache below is keyed by the model
        self.fmt = fmt  # weight format of every product
        self.group_size = group_size  # int4 group along the input dimension
        # activations and KV cache in the model's own dtype (float32, or bfloat16 for a bf16
        # model): a quantized draft casts only each product's input, since bf16 attention and
        # norms are slow on CPUs without native bf16 (SDPA 433 vs 66 us a layer, AVX2)
        self.dtype = next(model.parameters()).dtype
        # our kernels (CPU, built): activations and cache in float32, else torch's operators
        self.kernels = next(model.parameters()).device.type == "cpu" and kernels.enabled()
        self._rope_cos: torch.Tensor | None = None  # kernels: [P, d] float32 RoPE tables,
        self._rope_sin: torch.Tensor | None = None  # grown in chunks of ROPE_CHUNK positions
        self.rotary = inner.rotary_emb  # the model's own RoPE (scaling variants included)
        self.embed = inner.embed_tokens  # shared with the model (no copy)
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scaling = self.head_dim ** -0.5
        self.layers: list[tuple] = []  # per kept layer: (ln1, eps1, qkv, o, ln2, eps2, gu, down)
        with torch.no_grad():
            for i in self.layer_ids:
                layer = inner.layers[i]
                a, m = layer.self_attn, layer.mlp
                self.layers.append((
                    self._norm_weight(layer.input_layernorm.weight),
                    layer.input_layernorm.variance_epsilon,
                    self._matrix([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                    self._matrix([a.o_proj.weight]),
                    self._norm_weight(layer.post_attention_layernorm.weight),
                    layer.post_attention_layernorm.variance_epsilon,
                    self._matrix([m.gate_proj.weight, m.up_proj.weight]),
                    self._matrix([m.down_proj.weight]),
                ))
            self.norm = (self._norm_weight(inner.norm.weight), inner.norm.variance_epsilon)
            self.head = self._matrix([model.lm_head.weight])
        self.versions = self._versions(model)

    def _matrix(self, parts: list[torch.Tensor]) -> Matrix:
        if self.fmt == "float32":  # the model's own tensors; fused only in the one-row copy
            return Matrix.float32_parts([p.float() for p in parts])
        w = parts[0] if len(parts) == 1 else torch.cat(parts)
        return make_matrix(w if self.fmt == "bfloat16" else w.float(), self.fmt,
                           group_size=self.group_size, for_kernels=self.kernels)

    def _norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if self.kernels else self.dtype
        return w if w.dtype == dtype else w.detach().to(dtype)

    @staticmethod
    def supports(model) -> bool:
        cfg = getattr(model, "config", None)
        return (
            getattr(cfg, "model_type", None) == "llama"
            and not getattr(cfg, "attention_bias", False)
            and not getattr(cfg, "mlp_bias", False)
            and getattr(cfg, "hidden_act", None) == "silu"
            and not getattr(cfg, "pretraining_tp", 1) > 1
            and hasattr(getattr(model, "model", None), "rotary_emb")
        )

    @staticmethod
    def _versions(model) -> tuple[int, ...]:
        return tuple(p._version for p in model.parameters())

    def stale(self) -> bool:
        """Whether the model's weights were modified in place since this forward was built."""
        model = self._model()
        return model is None or self._versions(model) != self.versions

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (every product, the embedding row excluded)."""
        mats = [m for layer in self.layers for m in (layer[2], layer[3], layer[6], layer[7])]
        return sum(m.nbytes for m in [*mats, self.head])

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: SlotCache,
                mask: torch.Tensor | None, logits_to_keep: int,
                hidden_layers: tuple[int, ...] | None = None, one_row_copy: bool = True):
        """Logits [B, T', V] float32; with `hidden_layers`, also the features transformers'
        `hidden_states` would give at those indices (embeddings, each layer's output, the
        last one after the final norm), concatenated: [B, T, F]. `one_row_copy`: see
        `Matrix.__call__` (False: a one-row step does not build the float32 [in, out] copy)."""
        if self.kernels:
            return forward_kernels(self, tokens, positions, cache, mask, logits_to_keep,
                                   hidden_layers)
        c = one_row_copy
        # tokens, positions: [B, T]; mask: [B, 1, T, S] bool (True = visible) or None
        b, t = tokens.shape
        n_states = len(self.layers) + 1
        want = None if hidden_layers is None else {j % n_states for j in hidden_layers}
        states: dict[int, torch.Tensor] = {}
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        x = self.embed(tokens).to(self.dtype)  # [B, T, H]
        cos, sin = self.rotary(x, positions)  # [B, T, d]
        cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, d]
        half = d // 2
        for i, (w1, e1, qkv, wo, w2, e2, gu, wd) in enumerate(self.layers):
            if want is not None and i in want:
                states[i] = x
            y = qkv(F.rms_norm(x, w1.shape, w1, e1), c)  # [B, T, (h + 2 kv) d]
            qk = y[..., : (h + kv) * d].view(b, t, h + kv, d)  # RoPE on q and k at once
            qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], -1) * sin
            q = qk[:, :, :h].transpose(1, 2)  # [B, h, T, d]
            k = qk[:, :, h:].transpose(1, 2)  # [B, kv, T, d]
            v = y[..., (h + kv) * d:].view(b, t, kv, d).transpose(1, 2)  # [B, kv, T, d]
            k, v = cache.update(k, v, i)  # [B, kv, S, d]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                               enable_gqa=h != kv)  # [B, h, T, d]
            x = x + wo(o.transpose(1, 2).reshape(b, t, h * d), c)
            gate, up = gu(F.rms_norm(x, w2.shape, w2, e2), c).chunk(2, dim=-1)
            x = x + wd(F.silu(gate) * up, c)
        feats = None
        if want is not None:
            if n_states - 1 in want:
                states[n_states - 1] = F.rms_norm(x, self.norm[0].shape, *self.norm)
            feats = torch.cat([states[j % n_states] for j in hidden_layers], dim=-1)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.head(F.rms_norm(x, self.norm[0].shape, *self.norm), c).float()  # [B, T', V]
        return logits if feats is None else (logits, feats)


# One LeanLlama per (model object, format, layers, group), rebuilt when its weights change.
_LEAN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def lean_forward_for(model: PreTrainedModel, fmt: str | None = None, *,
                     layers: Sequence[int] | None = None,
                     group_size: int = 32) -> LeanLlama | None:
    """The cached LeanLlama of `model` in weight format `fmt` (default: the model's own dtype,
    float32 or bfloat16), or None when its architecture is not supported."""
    if not LeanLlama.supports(model):
        return None
    if fmt is None:
        fmt = "bfloat16" if next(model.parameters()).dtype == torch.bfloat16 else "float32"
    key = (fmt, None if layers is None else tuple(layers), group_size)
    per_model = _LEAN.setdefault(model, {})
    lean = per_model.get(key)
    if lean is None or lean.stale():
        lean = per_model[key] = LeanLlama(model, fmt, layers=layers, group_size=group_size)
    return lean
