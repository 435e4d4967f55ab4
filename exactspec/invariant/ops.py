"""Differentiable wrappers of our batch-invariant kernels for the trainer's forward.

Forward: the kernel (`exactspec.kernels`), so every output element is reduced in one fixed
order whatever the batch. Backward: the gradient of the same formula written in ordinary torch
operators, recomputed from the saved inputs (the issue allows ordinary kernels there: the bits
that must agree are the forward's). Tensors may have any leading dimensions.
"""

from __future__ import annotations

import torch

from exactspec import kernels


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight in torch operators (the backward's formula)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):  # x [..., H], weight [H]
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        h = x.shape[-1]
        return kernels.rms_norm(x.reshape(-1, h), weight.detach().float(), eps).view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xd, wd = x.detach().requires_grad_(), weight.detach().requires_grad_()
            y = rms_norm_reference(xd, wd, ctx.eps)
            gx, gw = torch.autograd.grad(y, (xd, wd), grad)
        return gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., H]
    """RMSNorm on the kernel (the lean forward's bits), differentiable."""
    return _RmsNorm.apply(x, weight, eps)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # -> [B, T, h, d]
                        visible: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale q k^T) v over the visible keys in torch operators (the backward's)."""
    # q [B, T, h, d]; k, v [B, kv, S, d]; visible [B, T, S] bool
    rep = q.shape[2] // k.shape[1]
    kk = k.repeat_interleave(rep, dim=1)  # [B, h, S, d]
    vv = v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q.transpose(1, 2), kk.transpose(2, 3)) * scale  # [B, h, T, S]
    s = s.masked_fill(~visible[:, None], float("-inf"))
    w = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a query with no visible key: zeros
    return torch.matmul(w, vv).transpose(1, 2)  # [B, T, h, d]


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, visible, scale):
        ctx.save_for_backward(q, k, v, visible)
        ctx.scale = scale
        return kernels.attention(q, k, v, visible, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, visible = ctx.saved_tensors
        with torch.enable_grad():
            qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
            o = attention_reference(qd, kd, vd, visible, ctx.scale)
            gq, gk, gv = torch.autograd.grad(o, (qd, kd, vd), grad)
        return gq, gk, gv, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # -> [B, T, h, d]
              visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention on the kernel (each query over its visible keys in key order), differentiable.
    q [B, T, h, d] (rows of d contiguous), k, v [B, kv, S, d], visible [B, T, S] bool."""
    if k.stride() != v.stride() or k.stride(3) != 1:
        k, v = k.contiguous(), v.contiguous()
    return _Attention.apply(q, k, v, visible, scale)


def silu(x: torch.Tensor) -> torch.Tensor:
    """silu(x) = x / (1 + exp(-x)) with the kernel's exp (the lean forward's SiLU bits): each
    element's value depends on itself only. Not differentiable on its own (the aten override
    sits below autograd, whose silu_backward is torch's)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)  # [M, I]
    gate_up = torch.cat([rows, torch.ones_like(rows)], dim=1)  # [M, 2I], up = 1 (exact)
    return kernels.silu_mul(gate_up).view(x.shape)
