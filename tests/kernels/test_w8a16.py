"""The int8-weight product with int16 activations (`kernels.linear_w8a16`, the int8 self-draft's
product on the kernels): every output is one rounding of an exact integer sum, so it is checked
with `torch.equal` against a torch reference that computes the same integers in int64 and the
same float32 roundings; the same bits on every instruction set, for a row alone or in any batch,
1 or 2 threads; sums long enough to overflow an int32 lane without the widening."""

from __future__ import annotations

import pytest
import torch

from exactspec import kernels


def reference(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The op's definition in torch: per row x_q = round(x * (32767 / amax)) clamped to
    +-32767, sx = amax / 32767; y = (float(sum_k x_q w) * sx) * scales (sum in int64)."""
    amax = x.abs().amax(dim=1, keepdim=True)  # [M, 1]
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    inv = torch.tensor(32767.0) / safe  # float32 division, as the op
    xq = torch.round(x * inv).clamp(-32767, 32767).long()  # [M, K]
    xq = torch.where(amax > 0, xq, torch.zeros_like(xq))
    total = xq @ w.long().T  # [M, N] exact
    sx = torch.where(amax > 0, amax / torch.tensor(32767.0), torch.zeros_like(amax))
    return (total.float() * sx) * scales


def _case(m: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 10
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g) * 0.01 + 1e-3
    return x, w, s


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 15, 5), (7, 33, 9), (2, 100, 130),
                                   (5, 576, 64), (1, 1536, 576), (9, 640, 70)])
def test_equals_the_integer_reference(isa, m, k, n):
    x, w, s = _case(m, k, n)
    assert torch.equal(kernels.linear_w8a16(x, kernels.pack_int8(w), s), reference(x, w, s))


def test_residual_and_zero_rows(isa):
    x, w, s = _case(4, 96, 20, seed=1)
    x[2] = 0.0  # amax 0: a zero row gives zeros
    r = torch.randn(4, 20)
    y = kernels.linear_w8a16(x, kernels.pack_int8(w), s, r)
    assert torch.equal(y, r + reference(x, w, s))
    assert torch.equal(y[2], r[2])


def test_nan_and_inf_rows_give_nan_and_leave_the_others(isa):
    """A NaN or an infinity in a row (in a full 16-lane chunk or in the tail) makes that row's
    outputs NaN; the other rows keep their bits; a row of zeros (and -0.0) gives zeros."""
    x, w, s = _case(6, 40, 33, seed=5)
    x[1, 3] = float("nan")
    x[2, 37] = float("inf")  # in the tail (40 = 16 + 16 + 8)
    x[3, 20] = -float("inf")
    x[4] = 0.0
    x[4, 7] = -0.0
    y = kernels.linear_w8a16(x, kernels.pack_int8(w), s)
    assert torch.isnan(y[1:4]).all()
    assert torch.equal(y[4], torch.zeros(33))
    ok = [0, 5]
    assert torch.equal(y[ok], reference(x[ok], w, s))


def test_packing_is_a_permutation_with_zero_padding():
    """Panels of 32 rows, pairs of inputs: p[g, k // 2, j, k % 2] = w[32 g + j, k]."""
    w = torch.arange(37 * 40, dtype=torch.int64).remainder(251).sub(125).to(torch.int8)
    w = w.view(37, 40)
    p = kernels.pack_int8(w)  # [2, 32, 32, 2]: N 37 -> 64, K 40 -> 64
    assert p.shape == (2, 32, 32, 2)
    for n, k in [(0, 0), (0, 1), (5, 7), (31, 39), (32, 0), (36, 38), (36, 39), (17, 22)]:
        assert int(p[n // 32, k // 2, n % 32, k % 2]) == int(w[n, k]), (n, k)
    assert torch.equal(p[1, :20, :5, :].permute(1, 0, 2).reshape(5, 40), w[32:])
    assert int(p.abs().long().sum()) == int(w.abs().long().sum())  # the rest is zeros


# (N, K): N = 70 ends in a part panel of 6 rows (lanes 0-5 of the first half), N = 49 in one
# of 17 (the second half's first lane), N = 32 in none, N = 1 is all tail; K = 100 and 17 are
# zero-padded to 128 and 32, K = 600 crosses the int64 widening at 512 inputs, K = 1030 twice
PANEL_SHAPES = [(70, 100), (49, 600), (32, 32), (1, 17), (33, 1030)]
ROWS = [*range(1, 21), 31, 45, 64, 130]  # every row tile (1..8) and its remainders


@pytest.mark.parametrize("n,k", PANEL_SHAPES)
def test_every_row_count_and_edge_on_every_isa_and_thread_count(isa, threads, n, k):
    """Each M in 1..20 and a few prefill widths, against the int64 reference, 1 and 2 threads;
    the weights at the int8 extremes too (-128 and 127 in the first rows)."""
    x, w, s = _case(max(ROWS), k, n, seed=n * 1000 + k)
    w[: min(n, 3)] = torch.tensor([-128, 127], dtype=torch.int8).repeat(k)[:k]
    packed = kernels.pack_int8(w)
    ref = reference(x, w, s)
    for nt in (1, 2):
        torch.set_num_threads(nt)
        for m in ROWS:
            assert torch.equal(kernels.linear_w8a16(x[:m], packed, s), ref[:m]), (m, nt)


def test_huge_sums_round_like_a_scalar_conversion(isa):
    """K = 2^20 + 3 at the largest products: sums near 2^42, far past float32's 2^24 integers,
    so float(total) rounds; the kernel's conversion (through a double on AVX-512) gives the
    bits of torch's int64 -> float32 conversion, also for the random rows."""
    k = (1 << 20) + 3
    g = torch.Generator().manual_seed(7)
    x = torch.cat([torch.ones(1, k), torch.randn(2, k, generator=g)])
    w = torch.cat([torch.full((2, k), -128, dtype=torch.int8),
                   torch.randint(-128, 128, (15, k), generator=g, dtype=torch.int8)])
    s = torch.rand(17, generator=g) + 0.5
    y = kernels.linear_w8a16(x, kernels.pack_int8(w), s)
    assert torch.equal(y, reference(x, w, s))
    total = torch.tensor(float(32767 * -128 * k))  # row 0 on the first two outputs: exact
    # in a double, one rounding to float32; sx = amax / 32767 with amax 1
    assert float(total) != 32767 * -128 * k  # (it does round)
    assert torch.equal(y[0, :2], (total * (torch.tensor(1.0) / torch.tensor(32767.0))) * s[:2])


def test_bad_layout_is_refused():
    x, w, s = _case(1, 64, 8)
    with pytest.raises(RuntimeError, match="pack_int8"):
        kernels.linear_w8a16(x, w, s)  # not packed


@pytest.mark.parametrize("m", [1, 3, 8])
def test_long_sums_do_not_overflow(isa, m):
    """Every product at its largest (|x_q| = 32767, w = -128) over K = 20000: an int32 lane
    over 1024 of them would overflow; the kernel widens to int64 every 512 inputs. 8 rows: a
    row tile with one accumulator per output (1 row splits K over 4, 3 rows over 2)."""
    k = 20000
    x = torch.ones(m, k)
    w = torch.full((3, k), -128, dtype=torch.int8)
    s = torch.ones(3)
    y = kernels.linear_w8a16(x, kernels.pack_int8(w), s)
    total = torch.tensor(float(32767 * -128 * k))  # exact in int64, one float32 rounding
    sx = torch.tensor(1.0) / torch.tensor(32767.0)  # amax 1
    assert torch.equal(y, (total * sx).expand(m, 3))
    assert torch.equal(y, reference(x, w, s))


def test_a_row_is_the_same_alone_in_a_batch_and_on_any_thread_count(isa, threads):
    x, w, s = _case(40, 576, 300, seed=2)
    torch.set_num_threads(2)
    full = kernels.linear_w8a16(x, kernels.pack_int8(w), s)
    torch.set_num_threads(1)
    for i in (0, 17, 39):
        assert torch.equal(kernels.linear_w8a16(x[i:i + 1], kernels.pack_int8(w), s), full[i:i + 1])
    assert torch.equal(kernels.linear_w8a16(x[3:8], kernels.pack_int8(w), s), full[3:8])


def test_every_isa_gives_the_same_bits():
    x, w, s = _case(6, 1000, 77, seed=3)
    outs = []
    for name in kernels.available_isas():
        kernels.set_isa(name)
        outs.append(kernels.linear_w8a16(x, kernels.pack_int8(w), s))
    kernels.set_isa("auto")
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_close_to_the_float_product():
    """int16 activations: each x_q is within amax / 65534 of x * 32767 / amax, so the product
    is within sum_k |w_k s| amax / 65534 (+ float32 roundings) of the float64 one."""
    x, w, s = _case(3, 576, 50, seed=4)
    exact = x.double() @ (w.double() * s.double()[:, None]).T
    amax = x.abs().amax(dim=1, keepdim=True).double()
    bound = (w.double().abs() * s.double()[:, None]).sum(1) * amax / 65534 * 1.001 + 1e-6
    assert ((kernels.linear_w8a16(x, kernels.pack_int8(w), s).double() - exact).abs() <= bound).all()


def test_activations_round_half_to_even():
    """x_q = round(x * 32767 / amax) rounds ties to even (as torch.round and nearbyint): with
    amax = 32767 the scale is 1, so an identity weight returns x_q itself."""
    x = torch.tensor([[2.5, 3.5, -2.5, -3.5, 0.5, 1.5, 32767.0, 7.49999, -0.5]])
    k = x.shape[1]
    y = kernels.linear_w8a16(x, kernels.pack_int8(torch.eye(k, dtype=torch.int8)), torch.ones(k))
    assert torch.equal(y, torch.round(x))
    assert y[0, :4].tolist() == [2.0, 4.0, -2.0, -4.0]
