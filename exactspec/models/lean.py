"""The lean forward: decode steps of the Llama family over a SlotCache, one code path for every
weight format (float32, bfloat16, int8, int4; `exactspec/models/formats.py`) and every
architecture of `lean_arch.ARCHS` (Llama / Llama 3, Mistral, Qwen 2 / 2.5, Qwen 3, Gemma 3
text), their differences declared there.

The target runs it on its own float32 (or bfloat16) weights; `QuantizedDraft` runs the same
forward on a weight-only quantized copy of the target, optionally over a subset of its layers
and with its LM head restricted to the rows of frequent tokens (`head_rows`: FR-Spec /
VocabTrim; the other tokens get the logit OFF_HEAD, so their draft probability is 0).
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from exactspec import kernels
from exactspec.errors import InvalidValue
from exactspec.models.cache import SlotCache
from exactspec.models.formats import FORMATS, Matrix, make_matrix
from exactspec.models.lean_arch import ARCHS, layer_kinds, refusal
from exactspec.models.lean_kernels import forward_kernels
from exactspec.models.lean_layer import LayerShape, LeanLayer

log = logging.getLogger(__name__)

Masks = torch.Tensor | dict[str, torch.Tensor] | None  # one bool mask, or one per layer kind

# the LM head's format where it differs from the layers': an int4 draft keeps its head in int8
# (as llama.cpp's Q4_K_M keeps it in Q6_K): on smollm2-135m an int4 head took the int4
# self-draft's acceptance from 0.93 to 0.68 (greedy), for 10 MB of 85 (docs/performance.md,
# "The int4 kernel")
HEAD_FORMAT = {"int4": "int8"}

# the logit of a token outside a reduced head's rows: finite (probs_from_logits refuses inf),
# and so far below any real logit that its probability is exactly 0 in float32 after every
# sampling transform (penalties, bias, temperatures down to ~1e-28 of the logits' spread),
# as long as some kept token is possible (docs/quantized.md)
OFF_HEAD = -1e30


def _eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", None) or norm.eps)


class LeanLlama:
    """A lean forward of a Llama-family model over a SlotCache, for decode steps.

    Same math as transformers' forward of each architecture in `lean_arch.ARCHS` (RMSNorm,
    RoPE from the model's own rotary module, GQA attention, gated MLP, plus the declared
    differences: q/k/v biases, q / k norms, Gemma's sandwich norms, (1 + w) norms, GeGLU,
    per-kind RoPE bases, the attention scale) with less per-op overhead: q/k/v and gate/up
    fused into one product each (float32 keeps the model's own matrices and fuses only the
    one-row copy), `rms_norm` as one op, a boolean mask only when rows are ragged, several
    tokens are fed or the model has sliding windows (one mask per layer kind). `fmt` picks the
    weight format (see formats.py for the kernel each uses and why); `layers` keeps only
    those decoder layers (layer-skipping self-speculation: a draft, not the target).
    Activations run in the model's own dtype; logits are returned in float32, so p and q are
    always standardized in float32. `head_rows` ([N] long, sorted, distinct: `head_rows_of`)
    keeps only those rows of the LM head (a draft's reduced head: its bytes shrink to N / V);
    the logits are still [.., V], OFF_HEAD outside those rows. In float32 the results agree
    with transformers' forward to float rounding (tested per architecture).

    On the CPU it runs on our own batch-invariant kernels (`exactspec/kernels`) when they are
    built: every product, norm, RoPE, activation and attention output is reduced in a fixed
    order, so the logits of a position are the same bits whether it is scored alone, inside
    a verify or a tree, in any batch, with any thread count (activations and cache in float32
    there). Without them (or EXACTSPEC_KERNELS=0) it runs on torch operators, which lack that
    property.
    """

    def __init__(self, model: PreTrainedModel, fmt: str = "float32", *,
                 layers: Sequence[int] | None = None, group_size: int = 32,
                 head_rows: torch.Tensor | None = None) -> None:
        if fmt not in FORMATS:
            raise InvalidValue(f"weight format {fmt!r} must be one of {list(FORMATS)}")
        why = refusal(model)
        if why is not None:
            raise InvalidValue(f"the lean forward does not run this model: {why}")
        inner, cfg = model.model, model.config
        n_layers = cfg.num_hidden_layers
        self.layer_ids = list(range(n_layers)) if layers is None else list(layers)
        if not self.layer_ids or any(not 0 <= i < n_layers for i in self.layer_ids):
            raise InvalidValue(f"layers={layers!r} must be a non-empty subset of 0..{n_layers - 1}")
        self.arch = ARCHS[cfg.model_type]  # the declared differences from Llama
        self._model = weakref.ref(model)  # weak: the cache below is keyed by the model
        self.fmt = fmt  # weight format of every product
        self.group_size = group_size  # int4 group along the input dimension
        # activations and KV cache in the model's own dtype (float32, or bfloat16 for a bf16
        # model): a quantized draft casts only each product's input, since bf16 attention and
        # norms are slow on CPUs without native bf16 (docs/performance.md)
        self.dtype = next(model.parameters()).dtype
        # our kernels (CPU, built): activations and cache in float32, else torch's operators
        self.kernels = next(model.parameters()).device.type == "cpu" and kernels.enabled()
        # kernels: per layer kind, [P, d] float32 RoPE tables (models/rope_table.py)
        self._rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rotary = inner.rotary_emb  # the model's own RoPE (scaling variants included)
        self.embed = inner.embed_tokens  # shared with the model (no copy; Gemma's scales)
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        scale_base = getattr(cfg, self.arch.scale_attr) if self.arch.scale_attr else self.head_dim
        self.scaling = scale_base ** -0.5  # of the attention scores
        kinds = layer_kinds(cfg)
        self.layers: list[LeanLayer] = []  # the kept decoder layers
        with torch.no_grad():
            for i in self.layer_ids:
                self.layers.append(self._layer(inner.layers[i], kinds[i]))
            self.norm = (self._norm_weight(inner.norm.weight), _eps(inner.norm))
            head = model.lm_head.weight  # [V, H]
            self.vocab_size = int(head.shape[0])  # width of the logits
            # the head's rows kept ([N] long on the model's device; None: all)
            self.head_rows = None if head_rows is None else head_rows_of(
                head_rows, self.vocab_size).to(head.device)
            self.head = self._matrix([head if self.head_rows is None
                                      else head.index_select(0, self.head_rows)],
                                     HEAD_FORMAT.get(fmt, fmt))
        self.sliding = any(x.kind == "sliding_attention" for x in self.layers)  # masks per kind
        self.versions = self._versions(model)

    @property
    def shape(self) -> LayerShape:
        """What every layer shares, as the three paths of a layer read it (lean_layer.py)."""
        return LayerShape(heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                          scale=self.scaling, act=self.arch.act)

    def _layer(self, layer, kind: str) -> LeanLayer:
        a, m, sandwich = layer.self_attn, layer.mlp, self.arch.sandwich
        bias = None
        if self.arch.qkv_bias:
            bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).detach()
            bias = bias.to(torch.float32 if self.kernels else self.dtype)
        qk = self.arch.qk_norm
        return LeanLayer(
            kind=kind, eps=_eps(layer.input_layernorm),
            norm_in=self._norm_weight(layer.input_layernorm.weight),
            qkv=self._matrix([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            qkv_bias=bias,
            q_norm=self._norm_weight(a.q_norm.weight) if qk else None,
            k_norm=self._norm_weight(a.k_norm.weight) if qk else None,
            o=self._matrix([a.o_proj.weight]),
            norm_attn_out=(self._norm_weight(layer.post_attention_layernorm.weight)
                           if sandwich else None),
            norm_mlp_in=self._norm_weight(layer.pre_feedforward_layernorm.weight if sandwich
                                          else layer.post_attention_layernorm.weight),
            gate_up=self._matrix([m.gate_proj.weight, m.up_proj.weight]),
            down=self._matrix([m.down_proj.weight]),
            norm_mlp_out=(self._norm_weight(layer.post_feedforward_layernorm.weight)
                          if sandwich else None))

    def _matrix(self, parts: list[torch.Tensor], fmt: str | None = None) -> Matrix:
        fmt = fmt or self.fmt
        if fmt == "float32":  # the model's own tensors; fused only in the one-row copy
            return Matrix.float32_parts([p.float() for p in parts])
        w = parts[0] if len(parts) == 1 else torch.cat(parts)
        return make_matrix(w if fmt == "bfloat16" else w.float(), fmt,
                           group_size=self.group_size, for_kernels=self.kernels)

    def _norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        if self.arch.unit_offset:  # (1 + w) in float32, as Gemma's norms compute it
            return 1.0 + w.detach().float()
        dtype = torch.float32 if self.kernels else self.dtype
        return w if w.dtype == dtype else w.detach().to(dtype)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """The torch path's RMSNorm (Gemma's in float32, cast back, as transformers does)."""
        if self.arch.unit_offset:
            return F.rms_norm(x.float(), w.shape, w, eps).to(x.dtype)
        return F.rms_norm(x, w.shape, w, eps)

    def rope_of(self, x: torch.Tensor, positions: torch.Tensor, kind: str):
        """cos, sin [B, T, d] of the model's rotary module for layers of `kind`."""
        if self.arch.rope_per_kind:
            return self.rotary(x, positions, kind)
        return self.rotary(x, positions)

    @staticmethod
    def supports(model) -> bool:
        """Whether the lean forward runs `model` (`lean_arch.refusal` says why not)."""
        return refusal(model) is None

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
        mats = [m for layer in self.layers for m in layer.matrices]
        return sum(m.nbytes for m in [*mats, self.head])

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:  # [..., N] -> [..., V]
        """The head's logits over the whole vocabulary: a reduced head's N columns placed at
        their token ids, OFF_HEAD elsewhere (copies, exact); the full head's as they are."""
        if self.head_rows is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), OFF_HEAD)
        return full.index_copy_(-1, self.head_rows, logits)

    def mask_of(self, mask: Masks, kind: str) -> torch.Tensor | None:
        """The [B, 1, T, S] bool mask (or None: all visible) of layers of `kind`."""
        if isinstance(mask, dict):
            return mask[kind]
        if self.sliding:
            raise InvalidValue("a model with sliding-window layers needs its masks per layer "
                               "kind (AttentionLayout.visibility), not one mask")
        return mask

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: SlotCache,
                mask: Masks, logits_to_keep: int,
                hidden_layers: tuple[int, ...] | None = None, one_row_copy: bool = True,
                tail=None):
        """Logits [B, T', V] float32; with `hidden_layers`, also the features transformers'
        `hidden_states` would give at those indices (embeddings, each layer's output, the
        last one after the final norm), concatenated: [B, T, F]. `mask`: [B, 1, T, S] bool
        (True = visible) or None (all), or a dict of them by layer kind (required with
        sliding windows). `one_row_copy`: see `Matrix.__call__` (False: a one-row step does
        not build the float32 [in, out] copy). `tail`: on the kernels only, replaces the
        final norm and head (`forward_kernels`)."""
        if self.kernels:
            return forward_kernels(self, tokens, positions, cache, mask, logits_to_keep,
                                   hidden_layers, tail)
        assert tail is None, "a tail needs the kernels"
        c = one_row_copy
        # tokens, positions: [B, T]
        b, t = tokens.shape
        n_states = len(self.layers) + 1
        want = None if hidden_layers is None else {j % n_states for j in hidden_layers}
        states: dict[int, torch.Tensor] = {}
        shape = self.shape
        h, kv, d = shape.heads, shape.kv_heads, shape.head_dim
        x = self.embed(tokens).to(self.dtype)  # [B, T, H]
        ropes = {}
        for kind in {layer.kind for layer in self.layers}:
            cos, sin = self.rope_of(x, positions, kind)  # [B, T, d]
            ropes[kind] = (cos[:, :, None], sin[:, :, None])  # [B, T, 1, d]
        norm = self.rms_norm
        for i, layer in enumerate(self.layers):
            if want is not None and i in want:
                states[i] = x
            y = layer.qkv(norm(x, layer.norm_in, layer.eps), c)  # [B, T, (h + 2 kv) d]
            if layer.qkv_bias is not None:
                y = y + layer.qkv_bias
            q = y[..., : h * d].view(b, t, h, d)
            k = y[..., h * d: (h + kv) * d].view(b, t, kv, d)
            if layer.q_norm is not None:
                q = norm(q, layer.q_norm, layer.eps)
                k = norm(k, layer.k_norm, layer.eps)
            cos, sin = ropes[layer.kind]
            q = _rotate(q, cos, sin).transpose(1, 2)  # [B, h, T, d]
            k = _rotate(k, cos, sin).transpose(1, 2)  # [B, kv, T, d]
            v = y[..., (h + kv) * d:].view(b, t, kv, d).transpose(1, 2)  # [B, kv, T, d]
            k, v = cache.update(k, v, i)  # [B, kv, S, d]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask_of(mask, layer.kind),
                                               scale=shape.scale, enable_gqa=h != kv)
            o = layer.o(o.transpose(1, 2).reshape(b, t, h * d), c)  # [B, T, H]
            if layer.norm_attn_out is not None:
                o = norm(o, layer.norm_attn_out, layer.eps)
            x = x + o
            gate, up = layer.gate_up(norm(x, layer.norm_mlp_in, layer.eps), c).chunk(2, dim=-1)
            act = F.silu(gate) if shape.act == "silu" else F.gelu(gate, approximate="tanh")
            out = layer.down(act * up, c)
            if layer.norm_mlp_out is not None:
                out = norm(out, layer.norm_mlp_out, layer.eps)
            x = x + out
        feats = None
        if want is not None:
            if n_states - 1 in want:
                states[n_states - 1] = norm(x, *self.norm)
            feats = torch.cat([states[j % n_states] for j in hidden_layers], dim=-1)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.full_logits(self.head(norm(x, *self.norm), c).float())  # [B, T', V]
        return logits if feats is None else (logits, feats)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half) of x [B, T, heads, d] with cos, sin [B, T, 1, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def head_rows_of(rows, vocab_size: int | None) -> torch.Tensor:  # [N] long, sorted, distinct
    """The rows a reduced head keeps, from token ids (a tensor or a sequence of ints), checked:
    integers in [0, vocab_size) (None: >= 0, the vocabulary not known yet), at least one;
    sorted, repeats dropped."""
    if not isinstance(rows, torch.Tensor):
        try:
            rows = torch.tensor(list(rows), dtype=torch.long)
        except (TypeError, ValueError, RuntimeError):
            raise InvalidValue(f"head rows must be token ids (ints), got {rows!r:.80}") from None
    if rows.dtype == torch.bool or rows.is_floating_point() or rows.is_complex():
        raise InvalidValue(f"head rows must be integer token ids, got a {rows.dtype} tensor")
    rows = rows.reshape(-1).long()
    if rows.numel() == 0:
        raise InvalidValue("a reduced head needs at least one token id; got none")
    lo, hi = int(rows.min()), int(rows.max())
    if vocab_size is None and lo < 0:
        raise InvalidValue(f"head rows must be token ids >= 0, got {lo}")
    if vocab_size is not None and (lo < 0 or hi >= vocab_size):
        raise InvalidValue(f"head rows must be token ids in [0, {vocab_size}) (the model's "
                           f"vocabulary), got ids from {lo} to {hi}")
    return torch.unique(rows.cpu(), sorted=True)


def _rows_key(rows: torch.Tensor) -> str:
    """A digest of head rows ([N] long, as head_rows_of gives them), for the cache key."""
    return f"{rows.numel()}:" + hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16]


# One LeanLlama per (model object, format, layers, group, kinds, head rows), rebuilt when its
# weights change.
_LEAN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_REFUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> why not lean


def lean_forward_for(model: PreTrainedModel, fmt: str | None = None, *,
                     layers: Sequence[int] | None = None, group_size: int = 32,
                     head_rows: torch.Tensor | Sequence[int] | None = None) -> LeanLlama | None:
    """The cached LeanLlama of `model` in weight format `fmt` (default: the model's own dtype,
    float32 or bfloat16), with its head over `head_rows` (None: all), or None when its
    architecture is not supported."""
    why = refusal(model)
    if why is not None:
        if model not in _REFUSED:
            _REFUSED[model] = why
            log.info("%s runs on transformers' forward, not the lean one: %s",
                     type(model).__name__, why)
        return None
    if fmt is None:
        fmt = "bfloat16" if next(model.parameters()).dtype == torch.bfloat16 else "float32"
    # the layer kinds too: the masks it takes follow the declared layout (architectures.py)
    if head_rows is not None:
        head_rows = head_rows_of(head_rows, int(model.lm_head.weight.shape[0]))
    key = (fmt, None if layers is None else tuple(layers), group_size,
           tuple(layer_kinds(model.config)), None if head_rows is None else _rows_key(head_rows))
    per_model = _LEAN.setdefault(model, {})
    lean = per_model.get(key)
    if lean is None or lean.stale():
        lean = per_model[key] = LeanLlama(model, fmt, layers=layers, group_size=group_size,
                                          head_rows=head_rows)
    return lean
