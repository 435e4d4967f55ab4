"""The lean forward: Llama-architecture decode steps over a SlotCache, with less per-op overhead
than transformers' forward (fused q/k/v and gate/up, masks only when needed)."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from exactspec.models.cache import SlotCache

LINEAR_ROWS = (4, 36)  # B*T range where the lean forward uses linear on [out, in] weights


class LeanLlama:
    """A lean forward of a Llama-architecture model over a SlotCache, for decode steps.

    Same weights and math as transformers' LlamaForCausalLM (RMSNorm, RoPE from the model's
    own rotary module, GQA attention via SDPA, SwiGLU), with less per-token overhead: q/k/v and
    gate/up fused into one matrix each, weights stored [in, out] (x @ W), a boolean mask built
    only when rows are ragged or several tokens are fed. On this 2-core CPU a one-token
    matrix-vector product streams a [in, out] weight about 1.8x faster than torch's linear
    does its [out, in] one (100 SmolLM2 MLP matrices, 1 thread: 17.6 vs 31.3 ms). Costs one
    copy of the weights. Results agree with transformers' forward to float rounding.

    For LINEAR_ROWS[0] <= B*T <= LINEAR_ROWS[1] rows (a verify step of a few rows) the layers
    instead call `linear` on the model's own [out, in] weights (no copy): MKL's small-M
    kernels are faster on that layout here (smollm2-135m, 2 threads, medians, three runs:
    1 row x 5 tokens 62-78 -> 52-63 ms, 1 x 9 87-102 -> 81-86 ms, 1 x 12 108 -> 80 ms,
    8 x 1 72-83 -> 64-69 ms, 8 x 2 103-130 -> 90-100 ms; but 1 x 1 37-39 -> 46 ms, 1 x 2
    50 -> 63-67 ms, 1 x 3 64 -> 83 ms, and no consistent gain past ~36 rows).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        inner = model.model
        cfg = model.config
        self._model = weakref.ref(model)  # weak: the cache below is keyed by the model
        self.rotary = inner.rotary_emb  # the model's own RoPE (scaling variants included)
        self.embed = inner.embed_tokens
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scaling = self.head_dim ** -0.5
        self.layers = []  # per layer: (ln1, eps1, wqkv [H, (h+2kv)d], wo, ln2, eps2, wgu, wd)
        self.linear_layers = []  # per layer, the model's own [out, in] weights (no copies):
        # (q, k, v, o, gate, up, down), for the LINEAR_ROWS range
        with torch.no_grad():
            for layer in inner.layers[: cfg.num_hidden_layers]:
                a, m = layer.self_attn, layer.mlp
                self.linear_layers.append((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
                                           a.o_proj.weight, m.gate_proj.weight,
                                           m.up_proj.weight, m.down_proj.weight))
                wqkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).t()
                wgu = torch.cat([m.gate_proj.weight, m.up_proj.weight]).t()
                self.layers.append((
                    layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                    wqkv.contiguous(), a.o_proj.weight.t().contiguous(),
                    layer.post_attention_layernorm.weight,
                    layer.post_attention_layernorm.variance_epsilon,
                    wgu.contiguous(), m.down_proj.weight.t().contiguous(),
                ))
            self.norm = (inner.norm.weight, inner.norm.variance_epsilon)
            self.head = model.lm_head.weight.t().contiguous()  # [H, V], for one row
            self.head_vh = model.lm_head.weight  # [V, H] (no copy), for 2..8 rows
        self.versions = self._versions(model)

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
        """Whether the model's weights were modified in place since the copy was made."""
        model = self._model()
        return model is None or self._versions(model) != self.versions

    @staticmethod
    def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return w * x.to(dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: SlotCache,
                mask: torch.Tensor | None, logits_to_keep: int,
                hidden_layers: tuple[int, ...] | None = None):
        """Logits [B, T', V]; with `hidden_layers`, also the features transformers'
        `hidden_states` would give at those indices (embeddings, each layer's output, the
        last one after the final norm), concatenated: [B, T, F]."""
        # tokens, positions: [B, T]; mask: [B, 1, T, S] bool (True = visible) or None
        b, t = tokens.shape
        n_states = len(self.layers) + 1
        want = None if hidden_layers is None else {j % n_states for j in hidden_layers}
        states: dict[int, torch.Tensor] = {}
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        x = self.embed(tokens)  # [B, T, H]
        cos, sin = self.rotary(x, positions)  # [B, T, d]
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, d]
        half = d // 2
        use_linear = LINEAR_ROWS[0] <= b * t <= LINEAR_ROWS[1]
        for i, (w1, e1, wqkv, wo, w2, e2, wgu, wd) in enumerate(self.layers):
            if want is not None and i in want:
                states[i] = x
            if use_linear:
                wq, wk, wv, wo_t, wg, wu, wd_t = self.linear_layers[i]
                a = self._rms(x, w1, e1)
                q, k, v = F.linear(a, wq), F.linear(a, wk), F.linear(a, wv)
            else:
                y = self._rms(x, w1, e1) @ wqkv  # [B, T, (h + 2 kv) d]
                q, k, v = y.split([h * d, kv * d, kv * d], dim=-1)
            q = q.view(b, t, h, d).transpose(1, 2)  # [B, h, T, d]
            k = k.view(b, t, kv, d).transpose(1, 2)  # [B, kv, T, d]
            v = v.view(b, t, kv, d).transpose(1, 2)
            q = q * cos + torch.cat([-q[..., half:], q[..., :half]], -1) * sin
            k = k * cos + torch.cat([-k[..., half:], k[..., :half]], -1) * sin
            k, v = cache.update(k, v, i)  # [B, kv, S, d]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                               enable_gqa=h != kv)  # [B, h, T, d]
            o = o.transpose(1, 2).reshape(b, t, h * d)
            if use_linear:
                x = x + F.linear(o, wo_t)
                mm = self._rms(x, w2, e2)
                x = x + F.linear(F.silu(F.linear(mm, wg)) * F.linear(mm, wu), wd_t)
                continue
            x = x + o @ wo
            gate, up = (self._rms(x, w2, e2) @ wgu).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ wd
        feats = None
        if want is not None:
            if n_states - 1 in want:
                states[n_states - 1] = self._rms(x, *self.norm)
            feats = torch.cat([states[j % n_states] for j in hidden_layers], dim=-1)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        x = self._rms(x, *self.norm)  # [B, T', H]
        logits = self._head(x)
        return logits if feats is None else (logits, feats)

    def _head(self, x: torch.Tensor) -> torch.Tensor:  # [B, T', H] -> [B, T', V]
        m = x.shape[0] * x.shape[1]
        if 2 <= m <= 8:  # a few rows: W @ x^T on the [V, H] head is ~2x faster (10 vs 20 ms)
            w = self.head_vh
            return (w @ x.reshape(m, -1).t()).t().reshape(x.shape[0], x.shape[1], -1)
        return x @ self.head  # [B, T', V]


# One LeanLlama per model object, rebuilt when its weights change in place.
_LEAN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def lean_forward_for(model: PreTrainedModel) -> LeanLlama | None:
    """The cached LeanLlama of `model`, or None when its architecture is not supported."""
    if not LeanLlama.supports(model):
        return None
    lean = _LEAN.get(model)
    if lean is None or lean.stale():
        lean = _LEAN[model] = LeanLlama(model)
    return lean
