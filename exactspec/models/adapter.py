"""Target adapter: batched prefill / extend / rollback over any transformers causal LM.

Layout: one preallocated KV buffer per layer, `[B, heads, slots, head_dim]`, where
slot == position, written by position like gpt-fast. Measured on SmolLM2-135M shapes (CPU,
float32, one thread, width-5 steps, min of 18): equal to transformers' DynamicCache + 2D mask +
`crop` with 128-token prompts (B=1: 84 ms/step, B=8: 202 ms), faster at 1024 tokens (B=1:
100 vs 106 ms, B=8: 436 vs 462 ms), since nothing is concatenated per step; sdpa and eager
within noise. Rollback is free and ragged rows need no masked holes. Each row keeps its own length; `extend` writes the new tokens at
`lengths[b] ..` and `commit` / `rewind` only move the per-row length, so rolling back rejected
draft tokens costs nothing and rows may accept different numbers of tokens (ragged acceptance).
Stale slots beyond a row's length are masked out and overwritten by the next `extend`.
The attention mask is built here as a 4D additive mask, so transformers never has to infer
positions from the cache.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

_SUPPORTED_ATTENTION = ("eager", "sdpa")


class SlotCache(Cache):
    """KV cache of per-row slots written by position; `update` returns the first `view_len` slots.

    The adapter sets `write_index` ([B, T] slots to write) and `view_len` before each forward.
    """

    def __init__(self, batch_size: int, capacity: int) -> None:
        super().__init__(layers=[])
        self.rows = batch_size  # rows in the buffers
        self.capacity = capacity  # slots allocated per row (grows on demand)
        self.keys: list[torch.Tensor] = []  # per layer, [B, H, capacity, D]
        self.values: list[torch.Tensor] = []  # per layer, [B, H, capacity, D]
        self.write_index: torch.Tensor | None = None  # [B, T] slots the next forward writes
        self.write_start: int | None = None  # set when every row writes at the same slot
        self.view_len = 0  # slots returned to attention by the next forward

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states, value_states: [B, H, T, D]
        while len(self.keys) <= layer_idx:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer_idx] is None or self.keys[layer_idx].shape[2] < self.view_len:
            self._grow(layer_idx, key_states, value_states)
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        t = key_states.shape[2]
        if self.write_start is not None:
            k_buf[:, :, self.write_start : self.write_start + t] = key_states
            v_buf[:, :, self.write_start : self.write_start + t] = value_states
        else:
            b, h, _, d = key_states.shape
            idx = self.write_index[:, None, :, None].expand(b, h, t, d)  # [B, H, T, D]
            k_buf.scatter_(2, idx, key_states)
            v_buf.scatter_(2, idx, value_states)
        return k_buf[:, :, : self.view_len], v_buf[:, :, : self.view_len]

    def _grow(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.capacity = max(self.capacity, self.view_len)
        old_k, old_v = self.keys[layer_idx], self.values[layer_idx]
        b, h, _, d = key_states.shape
        new_k = key_states.new_zeros(b, h, self.capacity, d)
        new_v = value_states.new_zeros(b, h, self.capacity, value_states.shape[-1])
        if old_k is not None:
            new_k[:, :, : old_k.shape[2]] = old_k
            new_v[:, :, : old_v.shape[2]] = old_v
        self.keys[layer_idx], self.values[layer_idx] = new_k, new_v

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` ([R] long) of every buffer, in that order (repeats allowed)."""
        self.keys = [k.index_select(0, rows) if k is not None else None for k in self.keys]
        self.values = [v.index_select(0, rows) if v is not None else None for v in self.values]
        self.rows = int(rows.numel())

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.view_len


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


def unwrap_model(model) -> PreTrainedModel:
    """The transformers model inside an `exactspec.Model`, or `model` itself."""
    if isinstance(model, PreTrainedModel):
        return model
    inner = getattr(model, "model", None)
    if isinstance(inner, PreTrainedModel):
        return inner
    raise TypeError(
        f"expected an exactspec Model or a transformers PreTrainedModel, got {type(model).__name__}"
    )


class TargetAdapter:
    """Batched incremental forward passes of a causal LM with free rollback.

    Protocol: `prefill(prompts)` caches each row's tokens; `extend(tokens)` runs T new tokens
    per row on top of each row's committed length and returns their logits without committing
    them; `commit(n)` keeps the first n of them per row; `rewind(lengths)` sets lengths
    directly; `select(rows)` drops finished rows. Works on any device the model lives on.
    """

    def __init__(self, model, *, pad_token_id: int = 0, lean: bool = True) -> None:
        self.model = unwrap_model(model)
        impl = getattr(self.model.config, "_attn_implementation", "eager")
        if impl not in _SUPPORTED_ATTENTION:
            raise ValueError(
                f"attention implementation {impl!r} is not supported; load the model with "
                f"attn_implementation='sdpa' or 'eager'"
            )
        first = next(self.model.parameters())
        self.device = first.device  # where every tensor of this adapter lives
        self.dtype = first.dtype  # model dtype, for the additive mask
        text_config = self.model.config.get_text_config(decoder=True)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])  # logits width
        self.max_context = int(getattr(text_config, "max_position_embeddings", 1 << 30))
        layer_types = getattr(text_config, "layer_types", None) or []
        self._sliding_window = getattr(text_config, "sliding_window", None)
        self._mask_by_layer_type = any(t != "full_attention" for t in layer_types)
        if self._mask_by_layer_type and set(layer_types) - {"full_attention", "sliding_attention"}:
            raise ValueError(f"unsupported layer types {sorted(set(layer_types))}")
        self.pad_token_id = pad_token_id  # filler for ragged inputs; never attended to
        # the lean forward (Llama architectures) unless turned off; transformers' otherwise
        self.lean = lean_forward_for(self.model) if lean else None
        self.cache: SlotCache | None = None
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] committed slots
        self._last_width = 0  # T of the last extend, bounds commit

    @property
    def batch_size(self) -> int:
        return int(self.lengths.numel())

    def prefill(self, prompts: list[list[int]], *, capacity: int | None = None,
                hidden_layers: tuple[int, ...] | None = None) -> torch.Tensor | None:
        """Cache every token of every row (rows may differ in length; empty rows allowed).

        Identical rows are run once and copied. `capacity` preallocates slots per row. With
        `hidden_layers`, returns the features of every prompt token [B, W, H * len(layers)]
        (W = longest prompt), as `extend` does.
        """
        hidden = None
        uniq: dict[tuple[int, ...], int] = {}
        inverse = [uniq.setdefault(tuple(p), len(uniq)) for p in prompts]
        unique = [list(p) for p in uniq]
        lens = [len(p) for p in unique]
        width = max(lens, default=0)
        cap = max(capacity or 0, width, 1)
        self.cache = SlotCache(len(unique), cap)
        self.lengths = torch.zeros(len(unique), dtype=torch.long, device=self.device)
        if width > 0:
            tokens = torch.full((len(unique), width), self.pad_token_id, dtype=torch.long)
            for i, p in enumerate(unique):
                tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
            out = self.extend(tokens.to(self.device), logits_to_keep=1,
                              hidden_layers=hidden_layers)
            if hidden_layers is not None:
                hidden = out[1]  # [U, W, F]
            self.commit(torch.tensor(lens, dtype=torch.long, device=self.device))
        if len(unique) != len(prompts):
            rows = torch.tensor(inverse, dtype=torch.long, device=self.device)
            self.select(rows)
            hidden = hidden[rows] if hidden is not None else None
        return hidden

    @torch.inference_mode()
    def extend(
        self,
        tokens: torch.Tensor,  # [B, T] long
        *,
        return_hidden: bool = False,
        hidden_layers: tuple[int, ...] | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run T tokens per row after each row's committed length; nothing is committed.

        Returns logits [B, T, V] float (the last `logits_to_keep` positions if nonzero), and
        with `hidden_layers` (indices into transformers' `hidden_states` tuple) also those
        layers' states concatenated, [B, T, H * len(hidden_layers)]; `return_hidden` is
        `hidden_layers=(-1,)`, the last layer's.
        """
        if return_hidden and hidden_layers is None:
            hidden_layers = (-1,)
        assert self.cache is not None, "prefill first"
        b, t = tokens.shape
        assert b == self.batch_size, (b, self.batch_size)
        start = self.lengths  # [B]
        positions = start[:, None] + torch.arange(t, device=self.device)  # [B, T]
        view_len = int(start.max()) + t if b else t
        if view_len > self.max_context:
            raise ValueError(
                f"sequence of {view_len} tokens exceeds the model's context of {self.max_context}"
            )
        lo, hi = int(start.min()), int(start.max())
        self.cache.write_start = lo if lo == hi else None
        self.cache.write_index = positions
        self.cache.view_len = view_len
        if view_len > self.cache.capacity:
            self.cache.capacity = max(view_len, self.cache.capacity * 3 // 2 + 64)
        if self.lean is not None:
            uniform = lo == hi
            mask = None
            if t > 1 or not uniform:  # one token at a common length sees every slot
                slots = torch.arange(view_len, device=self.device)  # [S]
                mask = (slots[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, S]
            out = self.lean.forward(tokens, positions, self.cache, mask, logits_to_keep,
                                    hidden_layers)
            self._last_width = t
            return out
        out = self.model(
            input_ids=tokens,
            attention_mask=self._mask(positions, view_len),
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=hidden_layers is not None,
            logits_to_keep=logits_to_keep,
        )
        self._last_width = t
        if hidden_layers is not None:
            feats = torch.cat([out.hidden_states[i] for i in hidden_layers], dim=-1)
            return out.logits, feats
        return out.logits

    def _mask(self, positions: torch.Tensor, view_len: int):
        # positions: [B, T]; slot j is visible to the query at position i iff j <= i
        slots = torch.arange(view_len, device=self.device)  # [S]
        visible = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
        neg = torch.finfo(self.dtype).min
        full = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        full = full.masked_fill(~visible, neg)[:, None]  # [B, 1, T, S]
        if not self._mask_by_layer_type:
            return full
        window = slots[None, None, :] > positions[:, :, None] - self._sliding_window
        sliding = full.masked_fill(~window[:, None], neg)  # [B, 1, T, S]
        return {"full_attention": full, "sliding_attention": sliding}

    def commit(self, num_tokens: torch.Tensor) -> None:
        """Keep the first `num_tokens[b]` ([B] long, 0..T) tokens of the last extend per row."""
        assert bool((num_tokens >= 0).all()) and bool((num_tokens <= self._last_width).all())
        self.lengths = self.lengths + num_tokens.to(self.device)

    def rewind(self, lengths: torch.Tensor) -> None:
        """Set each row's committed length ([B] long); slots past it are forgotten."""
        assert bool((lengths <= self.lengths + self._last_width).all())
        self.lengths = lengths.to(self.device).clone()

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` ([R] long, repeats allowed), e.g. to drop finished rows."""
        assert self.cache is not None
        rows = rows.to(self.device)
        self.cache.select(rows)
        self.lengths = self.lengths.index_select(0, rows)
