"""Each weight format's product against its dequantized float32 reference, and its fallbacks."""

from __future__ import annotations

import pytest
import torch

from exactspec.models import formats
from exactspec.models.formats import make_matrix
from exactspec.models.quantize import int4_unpack, quantize_int4, quantize_int8

BF16_EPS = 2.0**-8  # relative rounding of one bf16 value


def _weight(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 8, 20])  # every float32 path: 1, 2..8, more
def test_product_matches_the_dequantized_reference(monkeypatch, fmt, rows):
    """The packed kernels (forced: the per-process timing may pick either path on a busy
    machine; the fallback has its own test below) against the dequantized reference."""
    for f in ("int8", "int4"):
        monkeypatch.setitem(formats._KERNEL_OK, f, True)
    w = _weight(64, 96)
    m = make_matrix(w, fmt)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    y = m(x)  # [rows, 64] float32 (x's dtype)
    assert y.dtype == torch.float32 and y.shape == (rows, 64)
    if fmt == "float32":
        torch.testing.assert_close(y, x @ w.t(), rtol=1e-5, atol=1e-6)
        return
    # the kernels take bf16 inputs and give bf16 outputs: compare with the reference on the
    # same bf16 input, within two bf16 roundings of the output (accumulation is float32)
    ref = m.reference(x.bfloat16().float())
    bound = 2 * BF16_EPS * ref.abs() + 1e-4
    assert bool(((y - ref).abs() <= bound).all()), float((y - ref).abs().max())


def test_int8_is_symmetric_per_output_channel():
    w = _weight(32, 48)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    err = (q.float() * s[:, None] - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-7).all())  # round to nearest step


def test_int4_pack_round_trips_and_dequantizes():
    w = _weight(48, 96, seed=3)
    _, sz = quantize_int4(w, 32)
    m = make_matrix(w, "int4", group_size=32)
    deq = m.dequantized()  # [48, 96]
    scale = sz[..., 0].float().t().repeat_interleave(32, dim=1)  # [48, 96]
    # within half a step of the bf16-rounded grid, plus the bf16 rounding of the zero point
    assert bool(((deq - w).abs() <= scale / 2 + BF16_EPS * (w.abs() + 16 * scale)).all())
    q = torch.randint(0, 16, (48, 96), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(int4_unpack(torch._convert_weight_to_int4pack_for_cpu(q, 1), 96), q)


def test_int4_refused_shapes_are_stored_as_int8():
    m = make_matrix(_weight(8, 96), "int4")  # out = 8 is not a multiple of 16
    assert m.fmt == "int8"
    m = make_matrix(_weight(32, 80), "int4", group_size=32)  # in = 80 is not a multiple of 32
    assert m.fmt == "int8"


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_slow_packed_kernel_falls_back_to_the_reference(monkeypatch, fmt):
    monkeypatch.setitem(formats._KERNEL_OK, fmt, False)  # as if measured slower here
    w = _weight(32, 64)
    m = make_matrix(w, fmt)
    assert not m.packed and m.qweight is None
    x = torch.randn(2, 64)
    torch.testing.assert_close(m(x), x @ m.dequantized().t(), rtol=1e-6, atol=1e-6)


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="int3"):
        make_matrix(_weight(16, 32), "int3")
