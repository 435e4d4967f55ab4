"""The units that round x to bf16 against bf16 weights, at every width: amx (AMX tiles,
csrc/impl_amx.h) and avx512bf16 (VDPBF16PS, csrc/impl_bf16dot.h).

Their bits differ from the FMA units' for bf16 weights and from each other's (said in
test_ops.py, where they are held to a float64 reference of the rounded x), so the invariance they
keep is tested here: a row's bits alone, inside any batch (neighbours holding infinities and NaN
included), at any output position in a tile (AMX's part tiles computed as the 16 rows ending at
n1, or through a padded copy below 16 rows; VDPBF16PS's tiles of 1 to 8 rows x 1 to 4 weight
rows), with K tails, on 1 and 2 threads; avx512bf16's bits against an emulation of Intel's
definition of the instruction (so a CPU that computes it otherwise is caught, and a wrong order
of the pair is shown to be seen); the decoder layers and the engine on each unit (greedy == plain
bit for bit with the int8 and int4 self-drafts, and the law of the first tokens by chi-square
at 1e-6 against the bf16 lean forward's own law, with a wrong variant rejected). Mixing units by
width, as libraries that use AMX above a few rows do, is caught. Each unit is skipped where the
CPU (or the kernel, or the compiler) does not give it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exactspec import SamplingParams, kernels
from exactspec.drafters import QuantizedDraft
from exactspec.engine import generate
from exactspec.models.adapter import TargetAdapter
from exactspec.models.lean import lean_forward_for

UNITS = [u for u in kernels.BF16_INPUT_UNITS if u in kernels.available_isas()]
pytestmark = pytest.mark.skipif(not UNITS, reason="no unit here rounds x to bf16 (no AMX tiles, "
                                                   "no AVX512-BF16: CPU, kernel or compiler)")


@pytest.fixture(params=UNITS or ["none"])
def unit(request):
    kernels.set_isa(request.param)
    n = torch.get_num_threads()
    yield request.param
    torch.set_num_threads(n)
    kernels.set_isa("auto")


def _w(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("n,k", [(5, 40), (15, 32), (16, 33), (37, 100), (70, 17), (130, 576),
                                 (37, 3300), (13, 2048)])
def test_a_row_alone_equals_it_beside_anything(unit, n, k):
    """Rows alone against every width to 40 (three groups of 16 rows of x), the other rows
    holding large values, infinities and NaN; 1 and 2 threads. K = 3300: avx512bf16's groups of
    4 rows from 5 rows (x's rows from 32 KB), blocks of 12 weight rows and a part block; K =
    2048: the groups from 8 rows, 7 and fewer on the tiles of up to 8 rows."""
    w = _w(n, k, n + k)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(40, k, generator=g)
    torch.set_num_threads(1)
    alone = torch.cat([kernels.linear(x[i:i + 1], [w]) for i in range(40)])
    assert torch.isfinite(alone).all()
    hostile = x.clone()
    hostile[1::3] = float("inf")
    hostile[2::5] = float("nan")
    hostile[4::7] = 3e38
    keep = torch.ones(40, dtype=torch.bool)
    keep[1::3] = keep[2::5] = keep[4::7] = False
    for nt in (1, 2):
        torch.set_num_threads(nt)
        for m in (*range(1, 18), 31, 32, 33, 40):
            assert torch.equal(kernels.linear(x[:m], [w]), alone[:m]), (m, nt)
            out = kernels.linear(hostile[:m], [w])
            assert torch.equal(out[keep[:m]], alone[:m][keep[:m]]), (m, nt)


@pytest.mark.parametrize("m,k", [(3, 72), (7, 3300)])
def test_an_output_is_the_same_at_every_tile_position(unit, m, k):
    """Output j of the first n weight rows for n = 1..100: j sits in a full tile, a part tile
    shifted back to end at n (its first rows computed again), or a padded copy (n < 16). K = 72:
    two full blocks of 32 and a tail of 8; K = 3300 at 7 rows: avx512bf16's groups of 4 and 3
    rows against tiles of 1-6 weight rows in blocks of 12."""
    w = _w(100, k, 1)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    full = kernels.linear(x, [w])
    for n in range(1, 101):
        assert torch.equal(kernels.linear(x, [w[:n]]), full[:, :n]), n
    # parts of one call (q / k / v) and a product split at any column: the same bits
    assert torch.equal(kernels.linear(x, [w[:40], w[40:45], w[45:]]), full)


def test_mixing_units_by_width_is_caught(unit):
    """What a library that uses AMX only above a few rows computes: one row on the FMA path,
    eight on the unit. The test's comparison sees it."""
    w = _w(64, 576, 3)
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(4))
    wide = kernels.linear(x, [w])
    kernels.set_isa("avx512vnni")
    one_fma = kernels.linear(x[:1], [w])
    kernels.set_isa(unit)
    assert torch.equal(kernels.linear(x[:1], [w]), wide[:1])
    assert not torch.equal(one_fma, wide[:1])


def _vdpbf16ps(x: torch.Tensor, w: torch.Tensor, odd_first: bool = True) -> torch.Tensor:
    """y = x w^T as the avx512bf16 unit defines it, in numpy float32: x rounded to bf16; lane j
    of 16 adds, per block b of 32 inputs in order, the product of inputs 32 b + 2 j + 1, then
    that of 32 b + 2 j (Intel's VDPBF16PS; each product exact in float32, each add rounded to
    nearest even; no value here is below the normal range); then vhsum's tree."""
    xb, wf = x.to(torch.bfloat16).float().numpy(), w.float().numpy()
    (m, k), n = xb.shape, wf.shape[0]
    kp = (k + 31) // 32 * 32
    xp, wp = np.zeros((m, kp), np.float32), np.zeros((n, kp), np.float32)
    xp[:, :k], wp[:, :k] = xb, wf
    acc = np.zeros((m, n, 16), np.float32)
    for b in range(kp // 32):
        for e in ((1, 0) if odd_first else (0, 1)):
            i = 32 * b + 2 * np.arange(16) + e
            acc = acc + xp[:, None, i] * wp[None, :, i]  # float32 + exact float32 product
    s8 = acc[..., :8] + acc[..., 8:]  # halves, quarters, pairs
    s4 = s8[..., :4] + s8[..., 4:]
    s2 = s4[..., :2] + s4[..., 2:]
    return torch.from_numpy(s2[..., 0] + s2[..., 1])


@pytest.mark.skipif("avx512bf16" not in UNITS, reason="no AVX512-BF16 unit here")
@pytest.mark.parametrize("m,n,k", [(1, 37, 576), (3, 20, 100), (8, 50, 72), (13, 30, 33),
                                   (70, 25, 1536), (9, 7, 31), (8, 40, 2085), (6, 19, 3300),
                                   (8, 13, 2048), (7, 13, 2048)])
def test_avx512bf16_computes_intels_definition(m, n, k):
    """Every tile shape (1 row x 1-4 weight rows, 1-8 rows x 1-3, and past 32 KB of x 1-4 rows
    x 1-6) and K tails against the emulation, bit for bit; the pair added in the other order is
    told apart (a wrong definition would be seen)."""
    g = torch.Generator().manual_seed(m * 100 + k)
    x, w = torch.randn(m, k, generator=g), _w(n, k, n + k)
    kernels.set_isa("avx512bf16")
    try:
        y = kernels.linear(x, [w])
    finally:
        kernels.set_isa("auto")
    assert torch.equal(y, _vdpbf16ps(x, w))
    if m * n * k >= 20000:  # enough sums that the other order rounds one differently
        assert not torch.equal(y, _vdpbf16ps(x, w, odd_first=False))


def _tiny_bf16(name: str = "llama", vocab: int = 16, **kw):
    from tests.models.test_lean_architectures import model_of

    return model_of(name, vocab=vocab, **kw).to(torch.bfloat16)


# an MLP this wide gives down_proj K = 4200: avx512bf16's groups of 4 rows from 5 rows of x (x's
# rows from 32 KB), so verifies of 5 drafts and every prompt run on them
WIDE_MLP = {"intermediate_size": 4200}


@pytest.mark.parametrize("bits,wide", [(8, False), (4, False), (8, True)])
def test_greedy_equals_plain_on_the_unit(unit, bits, wide):
    from tests.models.test_lean_architectures import GREEDY_PROMPTS

    model = _tiny_bf16(head_scale=3.0, **(WIDE_MLP if wide else {}))
    assert lean_forward_for(model) is not None
    greedy = SamplingParams(temperature=0)
    plain = generate(model, GREEDY_PROMPTS, params=greedy, max_new_tokens=20)
    drafter = QuantizedDraft(bits, backend="torch")
    spec = generate(model, GREEDY_PROMPTS, drafter=drafter, params=greedy, max_new_tokens=20,
                    num_draft_tokens=5 if wide else 3)
    for a, b in zip(spec, plain, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert sum(g.stats.accepted for g in spec) > 0
    # the forward really runs on AMX: its logits are not the FMA units' bits
    logits = {}
    for u in (unit, "avx512vnni"):
        kernels.set_isa(u)
        ad = TargetAdapter(model)
        ad.prefill([GREEDY_PROMPTS[0]], capacity=32)
        logits[u] = ad.extend(torch.tensor([[1, 2, 3]]))
    assert not torch.equal(logits[unit], logits["avx512vnni"])


def test_the_law_of_the_first_tokens_on_the_unit(unit):
    """The bf16 lean forward's own law (its logits on the unit, exact enumeration), against the
    engine's counts plain and with the int8 self-draft (chi-square, false alarm 1e-6 each);
    the wrong variant (qwen3 without its q/k norms, the same bf16 weights) is rejected. The
    tiny qwen3's o_proj has K = 512 (4 heads of 128), so the batch's chunks of 64 rows run on
    avx512bf16's groups of 4 (a row of x read from another row there is rejected: tried)."""
    from tests.models.test_lean_architectures import assert_qwen3_law_kept

    torch.set_num_threads(1)
    assert_qwen3_law_kept(_tiny_bf16, seed=31)
