"""The matrix product's tilings (csrc/impl.h `linear_t`, csrc/impl_w8a16.h) never change a bit.

`kernels.linear` runs one row of x through tiles of 16 weight rows (ES_NR1) and several rows
through register tiles of up to 8 rows (balanced groups), blocks of weight rows, chunks of 64
rows of x, and tails in K, N and M; `linear_w8a16` through its own row tiles. Every shape of
that tiling is compared with `torch.equal` against the same rows computed one at a time (the
one-row path, itself checked against float64 in test_ops.py), on every instruction set, with
1 and 2 threads: M = 1..20 (verify widths), 31, 45 (a prefill), 64, 65 and 130 (past a chunk),
256 and 300 (prefill's lanes along the outputs, `linear_bc`: a part block of rows), N and K with
every remainder of the tiles.
"""

from __future__ import annotations

import pytest
import torch

from exactspec import kernels

MS = [*range(1, 21), 31, 45, 64, 65, 130, 256, 300]
# (N, K): N = 37 ends in a part block and a part tile (16 + 16 + 4 + 1), N = 70 crosses a
# 64-row task; K = 17 and 100 end in a tail of 1 and 4, K = 1 is all tail; K = 2200 (a tail of
# 8): a pass of AVX2's half tiles over 4 rows of x does not fit a 32 or 48 KB L1 (float32
# weights; bf16 and int8 past 4 rows), so they meet K in chunks (impl.h's half_chunked)
SHAPES = [(37, 100), (70, 17), (5, 1), (37, 2200)]


def _weights(n: int, k: int, kind: str, g: torch.Generator):
    w = torch.randn(n, k, generator=g)
    if kind == "float32":
        return w, None
    if kind == "bfloat16":
        return w.to(torch.bfloat16), None
    return (torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
            torch.rand(n, generator=g) * 0.01 + 1e-3)


def _one_at_a_time(x: torch.Tensor, fn) -> torch.Tensor:
    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_every_width_equals_rows_alone(isa, threads, kind, n, k):
    g = torch.Generator().manual_seed(n * 100 + k)
    w, s = _weights(n, k, kind, g)
    x = torch.randn(max(MS), k, generator=g)
    torch.set_num_threads(1)
    rows = _one_at_a_time(x, lambda r: kernels.linear(r, [w], s))  # [300, N]
    for nt in (1, 2):
        torch.set_num_threads(nt)
        for m in MS:
            assert torch.equal(kernels.linear(x[:m], [w], s), rows[:m]), (m, nt)


def test_linear_large_rows_equal_rows_alone(threads):
    """smollm2's widths: K = 576 (36 full steps), N = 200 (four 64-row tasks, two threads)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(200, 576, generator=g)
    x = torch.randn(45, 576, generator=g)
    torch.set_num_threads(2)
    rows = _one_at_a_time(x, lambda r: kernels.linear(r, [w]))
    for m in (3, 5, 8, 9, 17, 45):
        assert torch.equal(kernels.linear(x[:m], [w]), rows[:m]), m
    # the comparison sees a change of summation order: torch's float32 product differs
    assert not torch.equal(x @ w.T, rows)


def test_linear_tiles_agree_across_isas():
    """Every unit's bits at every width; bf16 weights: every FMA unit's (the amx unit rounds x
    to bf16 there, test_bf16_units.py)."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(300, 83, generator=g)
    ws = {kind: _weights(45, 83, kind, g) for kind in ("float32", "bfloat16", "int8")}
    outs = {}
    for name in kernels.available_isas():
        kernels.set_isa(name)
        for kind, (w, s) in ws.items():
            if kind == "bfloat16" and kernels.rounds_bf16_inputs(name):
                continue
            outs[kind, name] = [kernels.linear(x[:m], [w], s) for m in (3, 8, 17, 45, 130, 300)]
    kernels.set_isa("auto")
    for (kind, name), out in outs.items():
        first = next(o for (k, _), o in outs.items() if k == kind)
        assert all(torch.equal(a, b) for a, b in zip(out, first, strict=True)), (kind, name)


def test_long_k_agrees_across_isas():
    """K past what L1 holds for a pass of AVX2's half tiles (its chunks, half_chunked), one row
    included (the weight rows left over by the one-row tiles): every FMA unit's bits, against the
    portable unit's plain loops."""
    g = torch.Generator().manual_seed(9)
    units = [u for u in kernels.available_isas() if not kernels.rounds_bf16_inputs(u)]
    for k in (2200, 3000, 6000):
        x = torch.randn(9, k, generator=g)
        for kind in ("float32", "bfloat16"):
            w, s = _weights(37, k, kind, g)
            outs = {}
            for name in units:
                kernels.set_isa(name)
                outs[name] = [kernels.linear(x[:m], [w], s) for m in range(1, 10)]
            kernels.set_isa("auto")
            ref = outs["portable"]
            for name, out in outs.items():
                assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True)), (k, kind, name)


@pytest.mark.parametrize("n,k", [(37, 100), (70, 33), (9, 4200)])
def test_w8a16_every_width_equals_rows_alone(isa, threads, n, k):
    """K = 4200 crosses the int64 widening every 512 inputs 8 times inside a row tile."""
    g = torch.Generator().manual_seed(n + k)
    w = kernels.pack_int8(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8))
    s = torch.rand(n, generator=g) * 0.01 + 1e-3
    x = torch.randn(max(MS), k, generator=g)
    torch.set_num_threads(1)
    rows = _one_at_a_time(x, lambda r: kernels.linear_w8a16(r, w, s))
    for nt in (1, 2):
        torch.set_num_threads(nt)
        for m in MS:
            assert torch.equal(kernels.linear_w8a16(x[:m], w, s), rows[:m]), (m, nt)
