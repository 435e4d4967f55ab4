"""How a float weight becomes the integers of a weight format, and back (`models/formats.py`
stores and multiplies them): int8 per output channel, torch's packed min-max int4 groups, and
our kernels' int4 groups with their scale search (`kernels.linear_w4a8`).
"""

from __future__ import annotations

import os

import torch

from exactspec import kernels
from exactspec.errors import InvalidValue


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: w ~ q * s; q [out, in] int8, s [out] float32."""
    s = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [out]
    q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
    return q, s


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min-max int4 groups of `group_size` along `in`: w ~ q * scale + min, q in 0..15.

    Returns the CPU int4 pack ([out, in / 2] uint8) and scales-and-zeros [in / group, out, 2] in
    bf16, laid out for `torch._weight_int4pack_mm_for_cpu` (which computes (q - 8) * s + z).
    """
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // group_size, group_size)  # [out, G, gs]
    lo, hi = g.amin(-1), g.amax(-1)  # [out, G]
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    # round scale and zero to bf16 first so the reference below is what the kernel computes
    scale_b, lo_b = scale.to(torch.bfloat16), lo.to(torch.bfloat16)
    zero = (lo_b.float() + 8 * scale_b.float()).to(torch.bfloat16)
    sz = torch.stack([scale_b, zero], dim=-1).transpose(0, 1).contiguous()  # [G, out, 2]
    packed = torch._convert_weight_to_int4pack_for_cpu(q.reshape(out_f, in_f), 1)
    return packed, sz


INT4_SCALES = ("search", "minmax")  # how quantize_int4_kernel picks a group's d and m


def quantize_int4_kernel(w: torch.Tensor, group_size: int = 32, scales: str | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 groups of `group_size` along `in` for our own kernel
    (`kernels.linear_w4a8`): w ~ d * q + m, q in 0..15, d and m bfloat16 per group of 32 (a
    larger group repeats its d and m over its blocks of 32). Returns q [out, in] uint8 and d, m
    [out, in / 32] bfloat16.

    `scales`: "search" (the default; $EXACTSPEC_INT4_SCALES overrides it) tries ranges narrower
    than the group's min-max (clipping its extremes) and keeps, per group, the d and m of least
    squared error (each candidate's d, m fitted by least squares to its q, as llama.cpp's
    k-quants do); "minmax" takes d = (max - min) / 15, m = min. Either way q is then rounded
    against the stored bf16 d and m, and the draft's q stays exactly what it computes: the
    choice moves acceptance only (docs/performance.md, "The int4 kernel"). Where the kernels
    run, the search and the rounding are one native call (`kernels.int4_quantize`) that gives
    the torch path's bits below."""
    scales = scales or os.environ.get("EXACTSPEC_INT4_SCALES") or "search"
    if scales not in INT4_SCALES:
        raise InvalidValue(f"int4 scales {scales!r} must be one of {list(INT4_SCALES)} "
                           "(EXACTSPEC_INT4_SCALES)")
    out_f, in_f = w.shape
    if in_f % group_size or group_size % 32:
        raise InvalidValue(f"int4 groups of {group_size} need `in` ({in_f}) divisible by it and "
                           "a multiple of 32")
    groups = w.float().reshape(-1, group_size).contiguous()  # [out * G, gs]
    shape = (out_f, in_f // group_size)
    if scales == "search" and kernels.enabled():  # the torch path's bits, ~10x faster
        q, d, m = kernels.int4_quantize(groups)
        return (q.reshape(out_f, in_f), *_per_32(d.reshape(shape), m.reshape(shape), group_size))
    if scales == "minmax":
        d, m = _int4_minmax(groups)
    else:  # in chunks: the search holds a few copies of its groups
        parts = [int4_search_reference(groups[r0:r0 + 65536])
                 for r0 in range(0, groups.shape[0], 65536)]
        d, m = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    d, m = d.to(torch.bfloat16).reshape(shape), m.to(torch.bfloat16).reshape(shape)
    df, mf = d.float().repeat_interleave(group_size, 1), m.float().repeat_interleave(group_size, 1)
    wf = groups.view(out_f, in_f)
    q = torch.where(df > 0, torch.round((wf - mf) / torch.where(df > 0, df, 1.0)), 0.0)
    return (q.clamp(0, 15).to(torch.uint8), *_per_32(d, m, group_size))


def _per_32(d: torch.Tensor, m: torch.Tensor, group_size: int,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """d and m [out, in / group_size] repeated over each group's blocks of 32."""
    rep = group_size // 32
    return d.repeat_interleave(rep, 1), m.repeat_interleave(rep, 1)


def _int4_minmax(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [R, n] -> [R]
    lo, hi = g.amin(-1), g.amax(-1)
    return (hi - lo) / 15.0, lo


# candidate ranges of the search: (fraction of the min-max span, where it sits inside it)
INT4_CANDIDATES = ((1.0, 0.0), (0.95, 0.5), (0.9, 0.5), (0.85, 0.5), (0.8, 0.5), (0.7, 0.5),
                   (0.95, 0.0), (0.95, 1.0), (0.9, 0.0), (0.9, 1.0), (0.85, 0.0), (0.85, 1.0))


def int4_search_reference(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group (a row of g, [R, n] float32), the (d, m) of least squared error among candidate
    ranges (INT4_CANDIDATES: the min-max range and narrower ones), each candidate's q refitted
    by least squares. Every sum runs over a group's weights in index order and no operation is
    fused, so `kernels.int4_quantize` (csrc/ops_quant.cpp, what quantize_int4_kernel runs) gives
    these bits; this form states the arithmetic and checks it."""
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)  # [R, 1]
    best_d, best_m = ((hi - lo) / 15.0).squeeze(-1), lo.squeeze(-1)
    best_err = _int4_error(g, best_d, best_m)
    n = g.shape[-1]
    sw = _ordered_sum(g)
    for shrink, a in INT4_CANDIDATES:
        span = (hi - lo) * shrink
        base = lo + (hi - lo - span) * a
        scale = torch.where(span > 0, span / 15.0, 1.0)
        q = torch.round((g - base) / scale).clamp(0, 15)
        sq, sqq, sqw = _ordered_sum(q), _ordered_sum(q * q), _ordered_sum(q * g)
        det = n * sqq - sq * sq
        d = torch.where(det > 0, (n * sqw - sq * sw) / torch.where(det > 0, det, 1.0), 0.0)
        d = torch.where(d > 0, d, 0.0)
        m = (sw - d * sq) / n
        r = g - (d[:, None] * q + m[:, None])
        err = _ordered_sum(r * r)
        better = err < best_err
        best_d = torch.where(better, d, best_d)
        best_m = torch.where(better, m, best_m)
        best_err = torch.where(better, err, best_err)
    return best_d, best_m


def _ordered_sum(x: torch.Tensor) -> torch.Tensor:  # [R, n] -> [R]: x[:, 0] + x[:, 1] + ...
    s = x[:, 0].clone()
    for e in range(1, x.shape[1]):
        s = s + x[:, e]
    return s


def _int4_error(g: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:  # [R]
    dd, mm = d[:, None], m[:, None]
    q = torch.where(dd > 0, torch.round((g - mm) / torch.where(dd > 0, dd, 1.0)), 0.0)
    r = g - (dd * q.clamp(0, 15) + mm)
    return _ordered_sum(r * r)


def int4_unpack(packed: torch.Tensor, in_f: int) -> torch.Tensor:  # -> [out, in] int32 0..15
    """Inverse of the CPU int4 pack, whose layout interleaves rows and columns in blocks.

    The layout is found by packing probes whose nibbles are the base-16 digits of each source
    index (`_pack_layout`), so this stays right whatever layout the kernel uses.
    """
    out_f = packed.shape[0]
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(-1).to(torch.int32)
    out = torch.empty(out_f * in_f, dtype=torch.int32)
    out[_pack_layout(out_f, in_f)] = nibbles
    return out.reshape(out_f, in_f)


_LAYOUTS: dict[tuple[int, int], torch.Tensor] = {}


def _pack_layout(out_f: int, in_f: int) -> torch.Tensor:
    """Source index (row * in + column) of every packed nibble, in `int4_unpack`'s order."""
    key = (out_f, in_f)
    if key not in _LAYOUTS:
        n = out_f * in_f
        index = torch.arange(n, dtype=torch.long)
        source = torch.zeros(n, dtype=torch.long)
        bits = max(1, (n - 1).bit_length())
        for d in range((bits + 3) // 4):  # one probe per base-16 digit
            probe = ((index >> (4 * d)) & 0xF).to(torch.int32).reshape(out_f, in_f)
            p = torch._convert_weight_to_int4pack_for_cpu(probe, 1)
            nib = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(-1).long()
            source |= nib << (4 * d)
        assert torch.equal(source.sort().values, index), "int4 pack is not a permutation"
        _LAYOUTS[key] = source
    return _LAYOUTS[key]


def int4_dequantize(packed: torch.Tensor, sz: torch.Tensor, group_size: int,
                     in_f: int) -> torch.Tensor:  # -> [out, in] float32
    q = int4_unpack(packed, in_f).float()  # [out, in]
    scale = sz[..., 0].float().t().repeat_interleave(group_size, dim=1)  # [out, in]
    zero = sz[..., 1].float().t().repeat_interleave(group_size, dim=1)
    return (q - 8) * scale + zero
