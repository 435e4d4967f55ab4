"""The adapter's lean Llama forward equals transformers' forward (to float rounding)."""

from __future__ import annotations

import pytest
import torch

from exactspec.models.adapter import LeanLlama, TargetAdapter, lean_forward_for
from exactspec.models.formats import MATVEC_ROWS
from tests.engine.tiny import tiny_llama


def _pair(model):
    ref, lean = TargetAdapter(model, lean=False), TargetAdapter(model)
    assert ref.lean is None and lean.lean is not None
    return ref, lean


def test_lean_matches_transformers_ragged_and_wide():
    torch.set_num_threads(1)
    model = tiny_llama(0, layers=3)
    ref, lean = _pair(model)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13]]
    for ad in (ref, lean):
        ad.prefill(prompts, capacity=40)
    g = torch.Generator().manual_seed(0)
    for width, keep in ((5, [2, 5, 0]), (1, [1, 1, 1]), (3, [3, 1, 2]), (1, [1, 1, 1])):
        x = torch.randint(1, 40, (3, width), generator=g)
        a, b = ref.extend(x), lean.extend(x)  # [B, T, V]
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        for ad in (ref, lean):
            ad.commit(torch.tensor(keep))


def test_lean_copy_follows_in_place_weight_changes():
    model = tiny_llama(1)
    first = lean_forward_for(model)
    assert lean_forward_for(model) is first  # cached per model
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    second = lean_forward_for(model)
    assert second is not first
    ref, lean = _pair(model)
    for ad in (ref, lean):
        ad.prefill([[1, 2, 3]])
    x = torch.tensor([[4]])
    torch.testing.assert_close(lean.extend(x), ref.extend(x), rtol=1e-4, atol=1e-4)


def test_unsupported_architectures_use_transformers():
    model = tiny_llama(2)
    model.config.attention_bias = True
    assert not LeanLlama.supports(model)
    assert TargetAdapter(model).lean is None


def test_lean_features_match_transformers_hidden_states():
    """DraftContext.hidden comes from these: embeddings, layer outputs, the normed last one."""
    model = tiny_llama(3, layers=3)
    ref, lean = _pair(model)
    layers = (0, 2, -1)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    h_ref = ref.prefill(prompts, hidden_layers=layers)
    h_lean = lean.prefill(prompts, hidden_layers=layers)
    torch.testing.assert_close(h_lean, h_ref, rtol=1e-4, atol=1e-4)
    x = torch.tensor([[8, 9, 10], [11, 12, 13]])
    (la, fa), (lb, fb) = ref.extend(x, hidden_layers=layers), lean.extend(x, hidden_layers=layers)
    assert fb.shape == fa.shape == (2, 3, 32 * len(layers))
    torch.testing.assert_close(fb, fa, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows,width", [(1, 1), (1, 2), (1, 5), (2, 4), (6, 8)])
def test_both_weight_layouts_match_transformers(rows, width):
    """One row uses the fused [in, out] copy, MATVEC_ROWS W @ x^T on the model's own weights,
    more rows `linear` on them: each path equals transformers' forward."""
    m = rows * width
    assert (MATVEC_ROWS[0] <= m <= MATVEC_ROWS[1]) == ((rows, width) in {(1, 2), (1, 5), (2, 4)})
    model = tiny_llama(4, layers=2)
    ref, lean = _pair(model)
    prompts = [[1 + (i + j) % 30 for j in range(3 + i)] for i in range(rows)]
    for ad in (ref, lean):
        ad.prefill(prompts, capacity=30)
    x = torch.randint(1, 40, (rows, width), generator=torch.Generator().manual_seed(rows))
    (la, fa), (lb, fb) = (ad.extend(x, hidden_layers=(1, -1)) for ad in (ref, lean))
    torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fb, fa, rtol=1e-4, atol=1e-4)


def test_bfloat16_model_runs_the_lean_forward_in_bfloat16():
    """A bf16 target (es.load(dtype="bfloat16")) keeps its own weights (no float32 copy) and
    its logits match transformers' bf16 forward to bf16 rounding; they come back as float32."""
    model = tiny_llama(4, layers=2).to(torch.bfloat16)
    ref, lean = _pair(model)
    assert lean.lean.fmt == "bfloat16"
    for ad in (ref, lean):
        ad.prefill([[1, 2, 3, 4], [5, 6]], capacity=20)
    x = torch.tensor([[7, 8, 9], [10, 11, 12]])
    a, b = ref.extend(x), lean.extend(x)  # [2, 3, V]
    assert b.dtype == torch.float32
    scale = float(a.float().abs().max())
    assert float((a.float() - b).abs().max()) <= 0.05 * scale  # a few bf16 roundings deep
    assert torch.equal(a.float().argmax(-1), b.argmax(-1))


def test_one_row_step_without_the_copy_matches_and_builds_nothing(monkeypatch):
    """A speculative target (one_row_copy=False) runs a rare one-row step on the model's own
    matrices: the same logits as the [in, out] copy path, and no copy is made. (The torch
    path's layouts: our kernels need no copy at all.)"""
    monkeypatch.setenv("EXACTSPEC_KERNELS", "0")
    model = tiny_llama(5, layers=2)
    spec = TargetAdapter(model, one_row_copy=False)
    lean = spec.lean
    prompts = [[1, 2, 3]]
    spec.prefill(prompts, capacity=20)
    x = torch.tensor([[4]])
    a = spec.extend(x)  # [1, 1, V]
    mats = [m for layer in lean.layers for m in layer.matrices]
    assert all(m.weight_t is None for m in [*mats, lean.head])
    plain = TargetAdapter(model)  # plain decoding: builds and uses the copy
    plain.prefill(prompts, capacity=20)
    b = plain.extend(x)
    assert all(m.weight_t is not None for m in [*mats, lean.head])
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
