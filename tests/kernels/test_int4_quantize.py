"""The int4 draft's quantization as one native call (`kernels.int4_quantize`,
csrc/ops_quant.cpp): q, d and m equal bit for bit to the torch path of `quantize_int4_kernel`
(the search written in torch operators, `int4_search_reference`, which states the order of
every sum), on groups that reach every branch (constant groups, ties at .5, outliers that the
narrower candidates clip, a short last block of lanes), at 1 and 2 threads; and the comparison
is shown to catch a wrong variant (ties rounded away from zero, a candidate left out). The
native call's candidate list is its own copy of INT4_CANDIDATES: these tests hold the two
equal."""

from __future__ import annotations

import pytest
import torch

from exactspec import kernels
from exactspec.models import quantize
from exactspec.models.quantize import quantize_int4_kernel


def weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Heavy-tailed rows of several scales, with a constant group, a group of exact halves
    (ties for the rounding: d = 1, m = 0 on the min-max candidate) and a one-outlier group."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen).pow(3) * torch.rand(rows, 1, generator=gen) * 0.05
    w[0] = 0.25  # constant: d = 0
    w[1, :32] = torch.arange(32).clamp(max=30) * 0.5  # 0, 0.5, ..., 15, 15: ties at .5
    w[2, :32] = torch.randn(32, generator=gen) * 1e-3
    w[2, 5] = 1.0  # one outlier: a narrower range wins
    if rows > 3:
        w[3, :32] = -torch.rand(32, generator=gen) * 1e-30  # tiny, negative
    return w


def torch_path(w: torch.Tensor, group_size: int, monkeypatch) -> tuple:
    with monkeypatch.context() as mp:
        mp.setattr(kernels, "enabled", lambda: False)
        return quantize_int4_kernel(w, group_size, "search")


@pytest.mark.parametrize(("rows", "cols", "group_size"),
                         [(64, 96, 32), (37, 64, 32), (48, 128, 64), (5, 32, 32), (130, 320, 32)])
def test_the_native_call_gives_the_torch_paths_bits(rows, cols, group_size, monkeypatch, threads):
    w = weights(rows, cols, seed=rows * cols)
    want = torch_path(w, group_size, monkeypatch)
    for n in (1, 2):
        torch.set_num_threads(n)
        got = quantize_int4_kernel(w, group_size, "search")
        for name, a, b in zip(("q", "d", "m"), got, want, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a, b), (name, n, (a != b).sum().item())
    q, d, m = want
    assert d[0, 0] == 0 and m[0, 0] == 0.25 and torch.all(q[0] == 0)  # the constant row
    assert q.max() <= 15


def test_groups_of_every_width_and_its_shape(monkeypatch):
    """The op takes [groups, n] for any n (a group larger than 32 is searched whole)."""
    w = weights(16, 96, seed=3).reshape(-1, 48)
    q, d, m = kernels.int4_quantize(w)
    assert q.shape == (32, 48) and d.shape == m.shape == (32,)
    assert d.dtype == m.dtype == torch.bfloat16 and q.dtype == torch.uint8
    ref_d, ref_m = quantize.int4_search_reference(w)
    assert torch.equal(d, ref_d.to(torch.bfloat16)) and torch.equal(m, ref_m.to(torch.bfloat16))


def test_a_wrong_rounding_or_a_missing_candidate_is_caught(monkeypatch):
    """The comparison above has power: the torch path with ties rounded away from zero, or with
    the first narrower candidate left out, gives other bits than the native call on these weights."""
    w = weights(64, 96, seed=11)
    got = quantize_int4_kernel(w, 32, "search")
    with monkeypatch.context() as mp:
        mp.setattr(quantize.torch, "round", lambda x: torch.floor(x + 0.5))
        away = torch_path(w, 32, monkeypatch)
    assert not all(torch.equal(a, b) for a, b in zip(got, away, strict=True))
    with monkeypatch.context() as mp:
        mp.setattr(quantize, "INT4_CANDIDATES", quantize.INT4_CANDIDATES[:1] + quantize.INT4_CANDIDATES[2:])
        fewer = torch_path(w, 32, monkeypatch)
    assert not all(torch.equal(a, b) for a, b in zip(got, fewer, strict=True))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="float32"):
        kernels.int4_quantize(torch.zeros(4, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[groups, n\]"):
        kernels.int4_quantize(torch.zeros(4, 4, 32))
