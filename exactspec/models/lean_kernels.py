"""The lean forward's decode step on our own batch-invariant kernels (`exactspec/kernels`).

Every operator reduces each output element in a fixed order of its own inputs, and the rest is
indexing, copies and elementwise additions (exact), so a position's logits do not depend on
the width of the call, the other rows, the cache's view length or the thread count. RoPE's
cos / sin come from a table per layer kind (`models/rope_table.py`), so a position's angles
are the same numbers whichever call first needed them.

A layer runs either operator by operator (the loop of `forward_kernels`) or as one call of the
fused operator (`exactspec::decoder_stack`, csrc/ops_layer.cpp), the same operators in the same
order; both read the layer's declaration (`models/lean_layer.py`).
"""

from __future__ import annotations

import logging

import torch

from exactspec import kernels
from exactspec.models.cache import SlotCache
from exactspec.models.lean_layer import FusedArgs, fused_args
from exactspec.models.rope_table import STATIC_ROPE, rope_table

log = logging.getLogger(__name__)

FUSED = True  # one operator per decoder layer where every product has a kernel (tests: False)


def rope_rows(lean, positions: torch.Tensor,
              kind: str = "full_attention") -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ([B * T, d] float32) of positions [B, T] for layers of `kind`, from the table
    of `lean` (one per kind: Gemma 3's local and global layers have their own bases)."""
    flat = positions.reshape(-1)  # [M]
    rope_type = getattr(lean.rotary, "rope_type", "default")
    if isinstance(rope_type, dict):  # per layer kind
        rope_type = rope_type.get(kind, "default")
    if rope_type not in STATIC_ROPE:  # inv_freq depends on the sequence length: no table
        dummy = torch.zeros((), dtype=torch.float32, device=positions.device)
        cos, sin = lean.rope_of(dummy, flat[None], kind)  # [1, M, d]
        return cos[0].float(), sin[0].float()
    need = int(flat.max()) + 1 if flat.numel() else 0
    table = rope_table(lambda x, pos: lean.rope_of(x, pos, kind), need, positions.device,
                       lean._rope.get(kind))
    lean._rope[kind] = table  # [P, d] each
    return table[0][flat], table[1][flat]


def forward_kernels(lean, tokens: torch.Tensor, positions: torch.Tensor, cache: SlotCache,
                    mask, logits_to_keep: int, hidden_layers: tuple[int, ...] | None = None,
                    tail=None):
    """`LeanLlama.forward` on the kernels: logits [B, T', V] float32 (and features). `mask`:
    [B, 1, T, S] bool or None, or a dict of them by layer kind. `tail`: a function of the
    last layer's output [B * T, H] whose result is returned instead of the final norm and
    head (the native draft step, drafters/draft_model.py)."""
    # tokens, positions: [B, T]
    b, t = tokens.shape
    m = b * t
    shape = lean.shape  # what every layer shares (lean_layer.LayerShape)
    h, kv, d = shape.heads, shape.kv_heads, shape.head_dim
    n_states = len(lean.layers) + 1
    want = None if hidden_layers is None else {j % n_states for j in hidden_layers}
    states: dict[int, torch.Tensor] = {}
    x = lean.embed(tokens).reshape(m, -1).float()  # [M, H]
    ropes = {kind: rope_rows(lean, positions, kind)  # [M, d] each
             for kind in {layer.kind for layer in lean.layers}}
    act = kernels.silu_mul if shape.act == "silu" else kernels.gelu_tanh_mul
    norm = kernels.rms_norm
    stack = layer_stack(lean) if FUSED else None
    if stack is not None:  # the loop below in one C++ call: the same bits
        like = x.new_empty(b, kv, t, d)  # the cache's dtype and shape per layer
        bufs = [cache.buffers(i, like) for i in range(len(lean.layers))]  # [B, kv, C, d] each
        keep = sorted(j for j in want if j < len(lean.layers)) if want is not None else []
        local = "sliding_attention"
        x, kept = kernels.decoder_stack(
            stack, x, ropes.get("full_attention", ropes.get(local)), ropes.get(local),
            [k for k, _ in bufs], [v for _, v in bufs],
            -1 if cache.write_start is None else cache.write_start,
            None if cache.write_start is not None else cache.write_index, cache.view_len,
            lean.mask_of(mask, "full_attention") if "full_attention" in ropes else None,
            lean.mask_of(mask, local) if local in ropes else None, b, keep)
        states.update(zip(keep, kept, strict=True))
    for i, layer in enumerate(lean.layers if stack is None else ()):
        if want is not None and i in want:
            states[i] = x
        eps = layer.eps
        y = layer.qkv.kernel(norm(x, layer.norm_in, eps))  # [M, (h + 2 kv) d]
        if layer.qkv_bias is not None:
            y = y + layer.qkv_bias  # elementwise, exact
        cos, sin = ropes[layer.kind]
        if layer.q_norm is not None:  # per-head norms: rows of d in [M * heads, d] views
            q = norm(y[:, : h * d].reshape(m * h, d), layer.q_norm, eps).view(m, h * d)
            k = norm(y[:, h * d: (h + kv) * d].reshape(m * kv, d), layer.k_norm, eps)
            k = k.view(m, kv * d)
            kernels.rope_(q, cos, sin, h)
            kernels.rope_(k, cos, sin, kv)
            q = q.view(b, t, h, d)  # [B, T, h, d]
            k = k.view(b, t, kv, d).transpose(1, 2)  # [B, kv, T, d]
        else:
            kernels.rope_(y, cos, sin, h + kv)  # q and k heads, in place
            yv = y.view(b, t, -1)
            q = yv[..., : h * d].view(b, t, h, d)  # [B, T, h, d]
            k = yv[..., h * d: (h + kv) * d].view(b, t, kv, d).transpose(1, 2)  # [B, kv, T, d]
        v = y.view(b, t, -1)[..., (h + kv) * d:].view(b, t, kv, d).transpose(1, 2)
        k, v = cache.update(k, v, i)  # [B, kv, S, d]
        o = kernels.attention(q, k, v, lean.mask_of(mask, layer.kind), shape.scale)
        o = o.view(m, h * d)  # [M, h d]
        if layer.norm_attn_out is None:
            x = layer.o.kernel(o, residual=x)  # x + o W_o^T
        else:
            x = x + norm(layer.o.kernel(o), layer.norm_attn_out, eps)
        g = act(layer.gate_up.kernel(norm(x, layer.norm_mlp_in, eps)))  # [M, I]
        if layer.norm_mlp_out is None:
            x = layer.down.kernel(g, residual=x)
        else:
            x = x + norm(layer.down.kernel(g), layer.norm_mlp_out, eps)
    if tail is not None:
        assert want is None, "a tail replaces the head: no features"
        return tail(x)
    norm_w, norm_eps = lean.norm
    feats = None
    if want is not None:
        if n_states - 1 in want:
            states[n_states - 1] = norm(x, norm_w, norm_eps)
        feats = torch.cat([states[j % n_states].view(b, t, -1) for j in hidden_layers], dim=-1)
        feats = feats.to(lean.dtype)  # [B, T, F]
    if logits_to_keep:
        x = x.view(b, t, -1)[:, -logits_to_keep:].reshape(-1, x.shape[-1])
    # [B * T', V] (a reduced head's N columns placed in the vocabulary: LeanLlama.full_logits)
    logits = lean.full_logits(lean.head.kernel(norm(x, norm_w, norm_eps)))
    logits = logits.view(b, -1, logits.shape[-1])  # [B, T', V]
    return logits if feats is None else (logits, feats)


def layer_args(lean) -> list[FusedArgs] | None:
    """Per kept layer, the arguments of `kernels.layer_stack` (its declared fields by name:
    `lean_layer.fused_args`), or None when a product has no kernel of ours (`kernel_args()`
    None: torch's packed int4, which a lean forward on the kernels no longer builds; the
    per-operator loop then runs)."""
    shape = lean.shape
    args = [fused_args(shape, layer) for layer in lean.layers]
    return None if any(a is None for a in args) else args


def layer_stack(lean):
    """The LayerStack of `lean`'s layers (built once per LeanLlama), or None (`layer_args`)."""
    if not hasattr(lean, "_stack"):
        args = layer_args(lean)
        lean._stack = None if args is None else kernels.layer_stack(args)
    return lean._stack
