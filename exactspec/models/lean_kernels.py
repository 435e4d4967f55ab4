"""The lean forward's decode step on our own batch-invariant kernels (`exactspec/kernels`).

Every operator reduces each output element in a fixed order of its own inputs, and the rest is
indexing, copies and elementwise additions (exact), so a position's logits do not depend on
the width of the call, the other rows, the cache's view length or the thread count. RoPE's
cos / sin come from a table that the model's own rotary module fills in fixed chunks of
ROPE_CHUNK positions (one shape per call, below torch's threading grain), so a position's
angles are the same numbers whichever call first needed them.
"""

from __future__ import annotations

import logging

import torch

from exactspec import kernels
from exactspec.models.cache import SlotCache

log = logging.getLogger(__name__)

ROPE_CHUNK = 64  # positions per table fill; 64 * head_dim (<= 256) < torch's grain of 32768
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "ntk")  # inv_freq fixed per model


def rope_rows(lean, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ([B * T, d] float32) of positions [B, T], from the table of `lean`."""
    flat = positions.reshape(-1)  # [M]
    rope_type = getattr(lean.rotary, "rope_type", "default")
    if rope_type not in STATIC_ROPE:  # inv_freq depends on the sequence length: no table
        dummy = torch.zeros((), dtype=torch.float32, device=positions.device)
        cos, sin = lean.rotary(dummy, flat[None])  # [1, M, d]
        return cos[0].float(), sin[0].float()
    need = int(flat.max()) + 1 if flat.numel() else 0
    have = 0 if lean._rope_cos is None else lean._rope_cos.shape[0]
    if need > have:
        dummy = torch.zeros((), dtype=torch.float32, device=positions.device)
        cos_parts, sin_parts = [], []
        for start in range(have, need, ROPE_CHUNK):
            pos = torch.arange(start, start + ROPE_CHUNK, device=positions.device)[None]
            cos, sin = lean.rotary(dummy, pos)  # [1, ROPE_CHUNK, d]
            cos_parts.append(cos[0].float())
            sin_parts.append(sin[0].float())
        old_c = [] if lean._rope_cos is None else [lean._rope_cos]
        old_s = [] if lean._rope_sin is None else [lean._rope_sin]
        lean._rope_cos = torch.cat([*old_c, *cos_parts])  # [P, d]
        lean._rope_sin = torch.cat([*old_s, *sin_parts])
    return lean._rope_cos[flat], lean._rope_sin[flat]


def forward_kernels(lean, tokens: torch.Tensor, positions: torch.Tensor, cache: SlotCache,
                    mask: torch.Tensor | None, logits_to_keep: int,
                    hidden_layers: tuple[int, ...] | None = None):
    """`LeanLlama.forward` on the kernels: logits [B, T', V] float32 (and features)."""
    # tokens, positions: [B, T]; mask: [B, 1, T, S] bool (True = visible) or None
    b, t = tokens.shape
    m = b * t
    h, kv, d = lean.heads, lean.kv_heads, lean.head_dim
    n_states = len(lean.layers) + 1
    want = None if hidden_layers is None else {j % n_states for j in hidden_layers}
    states: dict[int, torch.Tensor] = {}
    x = lean.embed(tokens).reshape(m, -1).float()  # [M, H]
    cos, sin = rope_rows(lean, positions)  # [M, d]
    for i, (w1, e1, qkv, wo, w2, e2, gu, wd) in enumerate(lean.layers):
        if want is not None and i in want:
            states[i] = x
        y = qkv.kernel(kernels.rms_norm(x, w1, e1))  # [M, (h + 2 kv) d]
        kernels.rope_(y, cos, sin, h + kv)  # q and k heads, in place
        y = y.view(b, t, -1)
        q = y[..., : h * d].view(b, t, h, d)  # [B, T, h, d]
        k = y[..., h * d: (h + kv) * d].view(b, t, kv, d).transpose(1, 2)  # [B, kv, T, d]
        v = y[..., (h + kv) * d:].view(b, t, kv, d).transpose(1, 2)  # [B, kv, T, d]
        k, v = cache.update(k, v, i)  # [B, kv, S, d]
        o = kernels.attention(q, k, v, mask, lean.scaling)  # [B, T, h, d]
        x = wo.kernel(o.view(m, h * d), residual=x)  # x + o W_o^T
        x = wd.kernel(kernels.silu_mul(gu.kernel(kernels.rms_norm(x, w2, e2))), residual=x)
    norm_w, norm_eps = lean.norm
    feats = None
    if want is not None:
        if n_states - 1 in want:
            states[n_states - 1] = kernels.rms_norm(x, norm_w, norm_eps)
        feats = torch.cat([states[j % n_states].view(b, t, -1) for j in hidden_layers], dim=-1)
        feats = feats.to(lean.dtype)  # [B, T, F]
    if logits_to_keep:
        x = x.view(b, t, -1)[:, -logits_to_keep:].reshape(-1, x.shape[-1])
    logits = lean.head.kernel(kernels.rms_norm(x, norm_w, norm_eps))  # [B * T', V]
    logits = logits.view(b, -1, logits.shape[-1])  # [B, T', V]
    return logits if feats is None else (logits, feats)
