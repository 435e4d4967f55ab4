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


def test_packing_is_a_permutation_with_zero_padding():
    w = torch.arange(5 * 40, dtype=torch.int64).remainder(251).sub(125).to(torch.int8).view(5, 40)
    p = kernels.pack_int8(w)  # [2, 2, 4, 32]
    assert p.shape == (2, 2, 4, 32)
    assert torch.equal(p[1, 0, 0, :32], w[4, :32]) and torch.equal(p[0, 1, 3, :8], w[3, 32:])
    assert int(p.abs().sum()) == int(w.abs().long().sum())  # the rest is zeros


def test_bad_layout_is_refused():
    x, w, s = _case(1, 64, 8)
    with pytest.raises(RuntimeError, match="pack_int8"):
        kernels.linear_w8a16(x, w, s)  # not packed


def test_long_sums_do_not_overflow(isa):
    """Every product at its largest (|x_q| = 32767, w = -128) over K = 20000: an int32 lane
    over all of K would overflow; the kernel widens to int64 every 4096 inputs."""
    k = 20000
    x = torch.ones(1, k)
    w = torch.full((3, k), -128, dtype=torch.int8)
    s = torch.ones(3)
    y = kernels.linear_w8a16(x, kernels.pack_int8(w), s)
    total = torch.tensor(float(32767 * -128 * k))  # exact in int64, one float32 rounding
    sx = torch.tensor(1.0) / torch.tensor(32767.0)  # amax 1
    assert torch.equal(y, (total * sx).expand(1, 3))
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
