"""The int4-weight product with int8 activations (`kernels.linear_w4a8`, the int4 self-draft's
product on the kernels): against a float64 reference of its definition within a stated bound
(each group's integer sum is exact; the float work is three roundings per group and output,
plus one for the per-output scale), and `torch.equal` across instruction sets, rows, batches
and thread counts; the packing round-trips; a wrong variant (the groups' minimum term dropped)
falls outside the bound."""

from __future__ import annotations

import pytest
import torch

from exactspec import kernels
from exactspec.models.formats import make_matrix
from exactspec.models.quantize import quantize_int4_kernel

U = 2.0 ** -24  # float32's unit roundoff


def activations(x: torch.Tensor):
    """The op's int8 groups of 32 (zero-padded): xq [M, G, 32] float64 (integers), sx [M, G]."""
    m, k = x.shape
    g = -(-k // 32)
    xp = torch.zeros(m, g * 32)
    xp[:, :k] = x
    xg = xp.view(m, g, 32)
    amax = xg.abs().amax(-1)  # [M, G]
    inv = torch.tensor(127.0) / torch.where(amax > 0, amax, torch.ones_like(amax))  # float32
    xq = torch.round(xg * inv[..., None]).clamp(-127, 127)
    xq = torch.where(amax[..., None] > 0, xq, torch.zeros_like(xq))
    sx = torch.where(amax > 0, amax / torch.tensor(127.0), torch.zeros_like(amax))
    return xq.double(), sx.double()


def reference(x, q, d, m, s, with_min: bool = True):
    """float64: y[i, n] = s[n] * sum_g sx[i, g] (d[n, g] S + m[n, g] X[i, g]) and the bound
    (G + 4) u * s[n] * sum_g |sx| (|d S| + |m X|) on the kernel's error."""
    xq, sx = activations(x)  # [M, G, 32], [M, G]
    n, k = q.shape
    g = xq.shape[1]
    qp = torch.zeros(n, g * 32, dtype=torch.float64)
    qp[:, :k] = q.double()
    S = torch.einsum("mgk,ngk->mng", xq, qp.view(n, g, 32))  # exact integers, [M, N, G]
    X = xq.sum(-1)[:, None, :]  # [M, 1, G]
    dS = d.double()[None] * S
    mX = m.double()[None] * X if with_min else torch.zeros_like(dS)
    terms = sx[:, None, :] * (dS + mX)
    y = terms.sum(-1) * s.double()
    bound = (g + 4) * U * (sx[:, None, :] * (dS.abs() + mX.abs())).sum(-1) * s.double().abs()
    return y, bound


def _case(mr: int, k: int, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(mr, k, generator=gen) * torch.rand(mr, 1, generator=gen) * 10
    g = -(-k // 32)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, g, generator=gen) * 0.02 + 1e-3).to(torch.bfloat16)
    m = (-torch.rand(n, g, generator=gen) * 0.15).to(torch.bfloat16)
    s = torch.rand(n, generator=gen) + 0.5
    return x, q, d, m, s


def _within(y, ref_bound) -> bool:
    ref, bound = ref_bound
    return bool(((y.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("k,n", [(32, 16), (15, 5), (100, 33), (576, 64), (1536, 40),
                                 (64, 130)])
def test_every_row_count_and_edge_within_the_bound_on_every_isa_and_thread_count(
        isa, threads, k, n):
    """M in 1..18 (tiles of up to 8 rows and their balanced splits), N and K off the panel
    (16) and group (32) sizes: within the float64 bound; a row alone gives the bits it gives
    in the batch, at 1 and 2 threads."""
    x, q, d, m, s = _case(18, k, n)
    w = kernels.pack_int4(q, d, m)
    torch.set_num_threads(2)
    full = kernels.linear_w4a8(x, w, s)
    assert _within(full, reference(x, q, d, m, s))
    for nt in (1, 2):
        torch.set_num_threads(nt)
        for mr in range(1, 19):
            assert torch.equal(kernels.linear_w4a8(x[:mr], w, s), full[:mr]), (nt, mr)
        assert torch.equal(kernels.linear_w4a8(x[7:8], w, s), full[7:8])


def test_every_isa_gives_the_same_bits():
    x, q, d, m, s = _case(11, 600, 70, seed=3)
    w = kernels.pack_int4(q, d, m)
    outs = []
    for name in kernels.available_isas():
        kernels.set_isa(name)
        outs.append(kernels.linear_w4a8(x, w, s))
    kernels.set_isa("auto")
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_a_wrong_variant_falls_outside_the_bound():
    """The reference without the groups' minimum term (what a kernel that forgot m computes) is
    far outside the bound: the bound is tight enough to see a wrong product."""
    x, q, d, m, s = _case(4, 256, 48, seed=2)
    y = kernels.linear_w4a8(x, kernels.pack_int4(q, d, m), s)
    _, bound = reference(x, q, d, m, s)
    wrong, _ = reference(x, q, d, m, s, with_min=False)
    assert not bool(((y.double() - wrong).abs() <= bound).all())


def test_residual_zero_and_nan_rows():
    """A residual is added (the same bits as adding it after); a row of zeros gives zeros; a
    NaN or an infinity in a row makes that row NaN and leaves the others' bits."""
    x, q, d, m, s = _case(5, 96, 20, seed=1)
    w = kernels.pack_int4(q, d, m)
    r = torch.randn(5, 20)
    clean = kernels.linear_w4a8(x, w, s)
    assert torch.equal(kernels.linear_w4a8(x, w, s, r), r + clean)
    x[2] = 0.0
    x[3, 70] = float("nan")  # in the tail group (96 = 3 x 32)
    x[4, 5] = float("inf")
    y = kernels.linear_w4a8(x, w, s)
    assert torch.equal(y[2], torch.zeros(20))
    assert y[3].isnan().all() and y[4].isnan().all()
    assert torch.equal(y[:2], clean[:2])


def test_packing_round_trips_and_bad_layouts_are_refused():
    x, q, d, m, s = _case(1, 100, 35, seed=4)
    w = kernels.pack_int4(q, d, m)
    assert w.shape == (3, 4, 320) and w.dtype == torch.uint8
    q2, d2, m2 = kernels.unpack_int4(w, 35, 100)
    assert torch.equal(q2, q) and torch.equal(d2, d) and torch.equal(m2, m)
    with pytest.raises(RuntimeError, match="pack_int4"):
        kernels.linear_w4a8(x, w[:2], s)  # a panel short
    with pytest.raises(ValueError, match="one per group"):
        kernels.pack_int4(q, d[:, :2], m)


def test_the_int4_matrix_computes_its_dequantized_weight():
    """make_matrix(..., "int4", for_kernels=True): the kernel's product is within the bound of
    the float64 product of its own dequantized weight and int8-grouped activations, and near
    the original weight."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(80, 192, generator=gen) * 0.05
    mat = make_matrix(w, "int4", for_kernels=True)
    x = torch.randn(3, 192, generator=gen)
    y = mat.kernel(x)
    q, d, m = kernels.unpack_int4(mat.kernel_qweight, 80, 192)
    assert _within(y, reference(x, q, d, m, mat.kernel_scales))
    # 16 levels over a group's range: a relative squared error near 1% (Gaussian weights)
    rel = ((mat.dequantized() - w) ** 2).sum() / (w ** 2).sum()
    assert rel < 0.02, rel
    assert mat.nbytes == 80 * 192 // 2 * 320 // 256 + 80 * 4  # 0.625 bytes a weight
    assert torch.equal(mat(x), y)  # the module call runs the kernel too


def test_the_scale_search_beats_min_max():
    """Per group, the search keeps the candidate of least squared error, min-max among them:
    its total error is below min-max's (heavy-tailed weights, where clipping pays)."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(64, 256, generator=gen).pow(3) * 0.01
    err = {}
    for how in ("minmax", "search"):
        q, d, m = quantize_int4_kernel(w, 32, how)
        deq = d.float().repeat_interleave(32, 1) * q.float() + m.float().repeat_interleave(32, 1)
        err[how] = ((deq - w) ** 2).sum().item()
    assert err["search"] < 0.9 * err["minmax"], err
