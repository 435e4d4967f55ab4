"""Each operator against a float64 reference within a float32 rounding bound derived below, and
bit-invariance (`torch.equal`): a row alone vs inside 500 rows, 1 vs 2 threads, masked or
absent keys holding anything (NaN), every instruction set computing the same bits (but the amx
unit's bf16-weight products, which round x to bf16: against a float64 reference of that).

Rounding bounds (u = 2^-24, float32's unit roundoff; gamma_n = n u / (1 - n u)): a dot product
of length K on 16 lanes is ceil(K / 16) fused multiply-adds per lane then a 4-level tree, so
|computed - exact| <= gamma_n * sum_k |x_k w_k| with n = ceil(K / 16) + 4 (Higham, Thm 3.1, one
rounding per fused multiply-add); int8's scale adds one rounding.
"""

from __future__ import annotations

import math

import pytest
import torch

from exactspec import kernels

U = 2.0 ** -24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def gamma_2u(n: int) -> float:
    """gamma_n with unit roundoff 2u (rounding toward zero)."""
    return n * 2 * U / (1 - n * 2 * U)


def dot_bound(k: int) -> float:
    return gamma(math.ceil(k / 16) + 4)


def _weights(n: int, k: int, kind: str, g: torch.Generator):
    """(weights for the kernel, scales or None, the float64 matrix they stand for)."""
    w = torch.randn(n, k, generator=g)
    if kind == "float32":
        return w, None, w.double()
    if kind == "bfloat16":
        wb = w.to(torch.bfloat16)
        return wb, None, wb.double()
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g) * 0.01 + 1e-3
    return q, s, q.double() * s.double()[:, None]


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 15, 5), (7, 17, 33), (2, 100, 130),
                                   (5, 576, 70)])
def test_linear_matches_float64(isa, kind, m, k, n):
    g = torch.Generator().manual_seed(k * 1000 + n)
    x = torch.randn(m, k, generator=g)
    w, s, ref_w = _weights(n, k, kind, g)
    y = kernels.linear(x, [w], s)  # [M, N]
    if kind == "bfloat16" and kernels.rounds_bf16_inputs(isa):
        # AMX: x rounded to bf16 (the reference too); bf16 x bf16 products are exact in float32,
        # and each of the K additions rounds once, to nearest or (allowed here) toward zero
        xr = x.to(torch.bfloat16).double()
        ref, mag = xr @ ref_w.T, xr.abs() @ ref_w.abs().T
        bound = gamma_2u(k) * mag
    else:
        ref = x.double() @ ref_w.T
        mag = x.double().abs() @ ref_w.abs().T  # sum_k |x_k w_k|
        bound = (dot_bound(k) + (2 * U if s is not None else 0)) * mag
    assert bool(((y.double() - ref).abs() <= bound).all()), float((y.double() - ref).abs().max())


def test_linear_parts_equal_the_fused_matrix(isa):
    """q / k / v as three parts in one call: the same bits as one concatenated matrix."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 96, generator=g)
    parts = [torch.randn(n, 96, generator=g) for n in (64, 32, 32)]
    assert torch.equal(kernels.linear(x, parts), kernels.linear(x, [torch.cat(parts)]))


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_linear_row_is_invariant_to_batch_and_threads(isa, kind, threads):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(500, 200, generator=g)
    w, s, _ = _weights(300, 200, kind, g)
    torch.set_num_threads(2)
    full = kernels.linear(x, [w], s)  # [500, 300]
    torch.set_num_threads(1)
    assert torch.equal(kernels.linear(x, [w], s), full)
    for i in (0, 1, 7, 250, 499):
        assert torch.equal(kernels.linear(x[i:i + 1], [w], s), full[i:i + 1])
    torch.set_num_threads(2)
    for lo, hi in ((0, 8), (3, 5), (100, 116), (490, 500)):
        assert torch.equal(kernels.linear(x[lo:hi], [w], s), full[lo:hi])


def test_every_isa_computes_the_same_bits():
    """AVX-512, AVX2 and portable run the same arithmetic (16 lanes, FMA, one tree)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 83, generator=g)
    w = torch.randn(37, 83, generator=g)
    gu = torch.randn(4, 2 * 45, generator=g) * 4
    q, k, v = torch.randn(1, 3, 4, 24), torch.randn(1, 2, 19, 24), torch.randn(1, 2, 19, 24)
    mask = torch.rand(1, 3, 19, generator=g) < 0.7
    mask[..., 0] = True
    # no mask: the scores of 4 and 2 queries against whole blocks of 16 keys at once, then a
    # part block (45 = 16 + 16 + 13 keys), d with and without a tail of the 16 lanes (AVX2
    # computes them a register half at a time: impl_attn.h's dots_half)
    unmasked = [(torch.randn(1, 5, 12, d, generator=g), torch.randn(1, 3, 45, d, generator=g),
                 torch.randn(1, 3, 45, d, generator=g)) for d in (64, 80)]
    unmasked.append((torch.randn(1, 3, 6, 64, generator=g),
                     torch.randn(1, 3, 40, 64, generator=g), torch.randn(1, 3, 40, 64, generator=g)))
    outs, bf16 = {}, {}
    for name in kernels.available_isas():
        kernels.set_isa(name)
        outs[name] = (kernels.linear(x, [w]), kernels.rms_norm(x, w[0], 1e-5),
                      kernels.silu_mul(gu), kernels.attention(q, k, v, mask, 0.2),
                      kernels.gelu_tanh_mul(gu),
                      *(kernels.attention(a, b, c, None, 0.125) for a, b, c in unmasked))
        bf16[name] = kernels.linear(x, [w.to(torch.bfloat16)])
    kernels.set_isa("auto")
    first = next(iter(outs.values()))
    for name, out in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(out, first, strict=True)), name
    # bf16 weights: the same bits on every FMA unit; the amx unit (x rounded to bf16) others
    fma = [n for n in bf16 if not kernels.rounds_bf16_inputs(n)]
    assert all(torch.equal(bf16[n], bf16[fma[0]]) for n in fma), fma
    for n in set(bf16) - set(fma):
        assert not torch.equal(bf16[n], bf16[fma[0]]), f"{n} gave the FMA units' bits"


def test_rms_norm_matches_float64(isa):
    g = torch.Generator().manual_seed(4)
    for h in (1, 16, 33, 576):
        x = torch.randn(5, h, generator=g) * 3
        w = torch.randn(h, generator=g)
        y = kernels.rms_norm(x, w, 1e-5)
        xd = x.double()
        ref = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-5) * w.double()
        # mean of squares: gamma_n relative (all terms >= 0) + the division and eps additions;
        # sqrt halves its input's error; then the reciprocal and two products
        bound = (dot_bound(h) + 2 * U) / 2 + 4 * U
        assert bool(((y.double() - ref).abs() <= bound * 1.01 * ref.abs()).all())
        assert torch.equal(kernels.rms_norm(x[2:3], w, 1e-5), y[2:3])


def test_silu_mul_matches_float64(isa):
    g = torch.Generator().manual_seed(5)
    gu = torch.cat([torch.randn(7, 50, generator=g) * 6, torch.randn(7, 50, generator=g)], 1)
    gu[0, :6] = torch.tensor([-100.0, -87.5, 0.0, 1e-8, 50.0, 100.0])
    y = kernels.silu_mul(gu)  # [7, 50]
    gd, ud = gu[:, :50].double(), gu[:, 50:].double()
    ref = gd / (1 + torch.exp(-gd)) * ud
    # exp: Cody-Waite reduction + degree-7 polynomial, <= 4u relative (its series remainder and
    # six roundings on |r| <= ln2 / 2); then 1 + e, the division and the product: 3u more.
    # Below -87 the argument is clamped: silu there is < 1e-36 in magnitude.
    bound = 7 * U * ref.abs() + 1e-36
    assert bool(((y.double() - ref).abs() <= bound).all()), float((y.double() - ref).abs().max())
    assert torch.equal(kernels.silu_mul(gu[3:4]), y[3:4])


def test_gelu_tanh_mul_matches_float64(isa):
    """Gemma's GeGLU: gelu(gate, approximate="tanh") * up = gate / (1 + exp(-2u)) * up with
    u = sqrt(2/pi) (gate + 0.044715 gate^3), the same function as torch's 0.5 x (1 + tanh u)."""
    g = torch.Generator().manual_seed(11)
    gu = torch.cat([torch.randn(7, 50, generator=g) * 4, torch.randn(7, 50, generator=g)], 1)
    gu[0, :7] = torch.tensor([-100.0, -12.0, -3.0, 0.0, 1e-8, 12.0, 100.0])
    y = kernels.gelu_tanh_mul(gu)  # [7, 50]
    gd, ud = gu[:, :50].double(), gu[:, 50:].double()
    a = -2 * (2 / torch.pi) ** 0.5 * (gd + 0.044715 * gd**3)  # the exp's argument
    ref = gd / (1 + torch.exp(a)) * ud
    torch.testing.assert_close(ref, torch.nn.functional.gelu(gd, approximate="tanh") * ud)
    # the argument carries <= 5u relative error (x*x, * c3, the fma, * 2k, the constants
    # 0.044715 and 2 sqrt(2/pi) rounded), so exp(a) <= 5u |a| + 4u (exp, see silu) relative;
    # then 1 + e, the division and the product: 3u. Past |a| = 87 the argument is clamped:
    # the true value there is below |gate up| e^-87 < 1e-35.
    bound = (5 * a.abs() + 7) * U * ref.abs() + 1e-35
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert torch.equal(kernels.gelu_tanh_mul(gu[3:4]), y[3:4])
    assert torch.equal(kernels.gelu_tanh_mul(gu[3:4, list(range(5)) + list(range(50, 55))]),
                       y[3:4, :5])  # a tail of 5 gives the bits of a full chunk


def test_rope_matches_float64(isa):
    g = torch.Generator().manual_seed(6)
    m, heads, d = 4, 3, 16
    x = torch.randn(m, (heads + 2) * d, generator=g)
    ang = torch.rand(m, d // 2, generator=g) * 6
    cos = torch.cat([ang.cos(), ang.cos()], 1)
    sin = torch.cat([ang.sin(), ang.sin()], 1)
    y = x.clone()
    kernels.rope_(y, cos, sin, heads)
    xd = x[:, : heads * d].double().view(m, heads, d)
    rot = torch.cat([-xd[..., d // 2:], xd[..., : d // 2]], -1)
    ref = xd * cos.double()[:, None] + rot * sin.double()[:, None]
    mag = (xd * cos.double()[:, None]).abs() + (rot * sin.double()[:, None]).abs()
    assert bool(((y[:, : heads * d].double().view(m, heads, d) - ref).abs() <= 2 * U * mag).all())
    assert torch.equal(y[:, heads * d:], x[:, heads * d:])  # the v heads are left alone


def _attention_ref(q, k, v, mask, scale):  # float64: [B, T, h, d]
    _b, _t, h, _d = q.shape
    rep = h // k.shape[1]
    kk = k.double().repeat_interleave(rep, 1)  # [B, h, S, d]
    vv = v.double().repeat_interleave(rep, 1)
    s = torch.einsum("bthd,bhsd->bhts", q.double(), kk) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    p = torch.softmax(s, -1)
    o = torch.einsum("bhts,bhsd->bthd", p, vv)
    mag_v = torch.einsum("bhts,bhsd->bthd", p, vv.abs())  # sum_j p_j |v_j|
    mag_s = torch.einsum("bthd,bhsd->bhts", q.double().abs(), kk.abs()) * scale
    return o, mag_v, mag_s.masked_fill(~mask[:, None], 0).amax(-1)  # [B, h, T]


def attention_error_and_bound(seed: int, shape: tuple, seen: float, runs: int = 1):
    """(|kernels.attention - float64|, its bound) on random inputs of `shape` (B, T, h, kv, S, d),
    each key seen with probability `seen` (key 0 always). A score's error: delta = gamma_n
    sum|q k| scale + u |s|; each p_j = exp(s_j - max) then carries <= 2 delta + 5u relative (two
    perturbed scores, the subtraction, exp's 4u); the normalizer and the weighted sum add
    gamma_S each, the division u. Over several runs of keys (impl_attn.h's attend_finish) each
    weight carries a second exp and a product (5u more) and the runs' numerator and denominator
    gamma_runs each."""
    g = torch.Generator().manual_seed(seed)
    b, t, h, kv, s_len, d = shape
    q = torch.randn(b, t, h, d, generator=g)
    k = torch.randn(b, kv, s_len, d, generator=g)
    v = torch.randn(b, kv, s_len, d, generator=g)
    mask = torch.rand(b, t, s_len, generator=g) < seen
    mask[..., 0] = True
    scale = d ** -0.5
    o = kernels.attention(q, k, v, mask, scale)
    ref, mag_v, mag_s = _attention_ref(q, k, v, mask, scale)
    delta = (dot_bound(d) + U) * mag_s.permute(0, 2, 1)[..., None]  # [B, T, h, 1]
    weight = 2 * delta + 5 * U + (5 * U if runs > 1 else 0.0)
    sums = 2 * gamma(s_len) + (2 * gamma(runs) if runs > 1 else 0.0)
    return (o.double() - ref).abs(), (2 * weight + sums + U) * mag_v


def test_attention_matches_float64(isa):
    err, bound = attention_error_and_bound(7, (2, 3, 6, 2, 21, 20), seen=0.6)
    assert bool((err <= bound).all()), float(err.max())


def test_attention_of_a_query_ignores_other_queries_and_masked_or_absent_keys(isa, threads):
    """A query at width 1 over exactly its keys equals the same query inside a wider call,
    with more rows, a longer view whose extra slots (and masked ones) hold NaN, 1 or 2 threads."""
    g = torch.Generator().manual_seed(8)
    h, kv, d, cap = 4, 2, 16, 40
    k = torch.randn(3, kv, cap, d, generator=g)
    v = torch.randn(3, kv, cap, d, generator=g)
    q = torch.randn(3, 5, h, d, generator=g)
    lengths = [11, 30, 17]  # row r's query t sees slots 0..lengths[r] + t
    s_len = 36
    mask = torch.zeros(3, 5, s_len, dtype=torch.bool)
    for r, n in enumerate(lengths):
        for t in range(5):
            mask[r, t, : n + t + 1] = True
    kn, vn = k.clone(), v.clone()
    kn[:, :, :s_len][~mask[:, None, 0].expand(3, kv, s_len)] = float("nan")  # unseen by query 0
    torch.set_num_threads(2)
    wide = kernels.attention(q, kn[:, :, :s_len], vn[:, :, :s_len], mask, 0.25)  # [3, 5, h, d]
    torch.set_num_threads(1)
    for r, n in enumerate(lengths):
        alone = kernels.attention(q[r:r + 1, :1], k[r:r + 1, :, : n + 1], v[r:r + 1, :, : n + 1],
                                  None, 0.25)
        assert torch.equal(alone, wide[r:r + 1, :1]), r
        for t in range(1, 5):
            one = kernels.attention(q[r:r + 1, t:t + 1], k[r:r + 1, :, : n + t + 1],
                                    v[r:r + 1, :, : n + t + 1], None, 0.25)
            assert torch.equal(one, kernels.attention(q, k[:, :, :s_len], v[:, :, :s_len],
                                                      mask, 0.25)[r:r + 1, t:t + 1])


def test_linear_residual_is_the_same_bits_as_adding_afterwards(isa):
    g = torch.Generator().manual_seed(9)
    x, r = torch.randn(5, 70, generator=g), torch.randn(5, 40, generator=g)
    w = torch.randn(40, 70, generator=g)
    assert torch.equal(kernels.linear(x, [w], None, r), r + kernels.linear(x, [w]))


def test_operators_pass_torch_library_opcheck():
    """Schemas, fake (meta) implementations and AOT dispatch agree with the CPU kernels, so the
    operators compose with the rest of torch (torch.compile's fake tensors included)."""
    ops = torch.ops.exactspec
    g = torch.Generator().manual_seed(10)
    x = torch.randn(3, 40, generator=g)
    q8 = torch.randint(-5, 5, (6, 40), dtype=torch.int8, generator=g)
    cases = [
        (ops.linear.default, (x, [torch.randn(8, 40), torch.randn(4, 40)], None, None)),
        (ops.linear.default, (x, [q8], torch.rand(6), torch.randn(3, 6))),
        (ops.rms_norm.default, (x, torch.randn(40), 1e-5)),
        (ops.silu_mul.default, (x,)),
        (ops.gelu_tanh_mul.default, (x,)),
        (ops.rope_.default, (torch.randn(3, 48), torch.randn(3, 16), torch.randn(3, 16), 2)),
        (ops.attention.default, (torch.randn(1, 2, 4, 16), torch.randn(1, 2, 5, 16),
                                 torch.randn(1, 2, 5, 16), torch.ones(1, 1, 2, 5, dtype=torch.bool),
                                 0.25)),
    ]
    for op, args in cases:
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, (op, result)
