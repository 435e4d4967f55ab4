"""The fused decoder layers (`kernels.decoder_stack`, csrc/ops_layer.cpp) compute the
same bits as the per-operator loop it replaces (`lean_kernels.forward_kernels` with FUSED off),
for every architecture of lean_arch.ARCHS (q/k/v bias, q/k norms, sandwich norms, GeGLU,
sliding windows), every weight format with a kernel (float32, bfloat16, int8's w8a16), ragged
rows (the cache written by index) and aligned ones (written from one slot), and the features
EAGLE reads; and a layer it is given wrong (a norm dropped) changes the logits, so the
comparison can fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from exactspec import kernels
from exactspec.models import lean_kernels
from exactspec.models.adapter import TargetAdapter
from exactspec.models.lean import lean_forward_for
from exactspec.models.lean_layer import fused_args
from tests.models.test_lean_architectures import CASES, model_of

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="the kernels are not built here")


def _run(model, fused: bool, fmt: str | None = None) -> list[torch.Tensor]:
    """Features of a ragged prefill (EAGLE's layers), logits of a 3-token extension of it (the
    cache written by index) and of two one-token steps of aligned rows (written from one slot)."""
    lean_kernels.FUSED = fused
    try:
        forward = None if fmt is None else lean_forward_for(model, fmt)
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(0, 40, (n,), generator=g).tolist() for n in (9, 2, 6)]
        ragged = TargetAdapter(model, forward=forward)
        out = [ragged.prefill(prompts, capacity=32, hidden_layers=(0, 1, -1))]
        out.append(ragged.extend(torch.randint(0, 40, (3, 3), generator=g)))
        aligned = TargetAdapter(model, forward=forward)
        aligned.prefill([prompts[0], prompts[0][::-1]], capacity=32)
        for _ in range(2):
            assert aligned.lengths.tolist() == [aligned.lengths[0]] * 2
            out.append(aligned.extend(torch.randint(0, 40, (2, 1), generator=g)))
            aligned.commit(torch.tensor([1, 1]))
        return out
    finally:
        lean_kernels.FUSED = True


@pytest.mark.parametrize("fmt", [None, "int8"], ids=["own-dtype", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_fused_layer_gives_the_per_operator_bits(name, dtype, fmt):
    model = model_of(name, seed=4, vocab=40).to(dtype)
    lean = lean_forward_for(model, fmt)
    assert lean.kernels and lean_kernels.layer_stack(lean) is not None
    ref = _run(model, fused=False, fmt=fmt)
    got = _run(model, fused=True, fmt=fmt)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b), name


def test_a_wrong_fused_layer_is_caught():
    """The comparison above can fail: the second layer's MLP norm replaced by ones."""
    model = model_of("llama", seed=4, vocab=40)
    ref = _run(model, fused=False)
    lean = lean_forward_for(model)
    args = lean_kernels.layer_args(lean)
    layer = lean.layers[1]
    args[1] = fused_args(lean.shape, dataclasses.replace(
        layer, norm_mlp_in=torch.ones_like(layer.norm_mlp_in)))
    lean._stack = kernels.layer_stack(args)
    got = _run(model, fused=True)
    assert torch.equal(ref[0][..., :64], got[0][..., :64])  # the embeddings: before the layers
    assert not torch.equal(ref[1], got[1])


def test_a_product_without_a_kernel_keeps_the_per_operator_loop(monkeypatch):
    """A product with no kernel of ours (torch's packed int4, where the kernels' int4 format
    does not apply) means no fused arguments:
    the per-operator loop runs, and its logits are those of FUSED off."""
    model = model_of("llama", seed=4, vocab=40)
    lean = lean_forward_for(model)
    monkeypatch.setattr(type(lean.layers[1].o), "kernel_args", lambda self: None)
    lean.__dict__.pop("_stack", None)
    assert lean_kernels.layer_stack(lean) is None
    assert all(torch.equal(a, b) for a, b in zip(_run(model, fused=True),
                                                  _run(model, fused=False), strict=True))


def _row_steps(model, fmt: str | None, rows_stack: bool, monkeypatch) -> list[torch.Tensor]:
    """Logits of one sequence's 700-token prefill (past one run of 512 keys), then of its steps
    of 1, 4, 7 and 40 tokens (a decode step, verifies, a short prompt's prefill), and of two
    sequences' 9-token prefill (its features: layers kept) and aligned steps of 1 and 3 tokens:
    the calls the rows stack takes (csrc/ops_layer.cpp, up to 64 rows)."""
    monkeypatch.setenv("EXACTSPEC_ROWS_STACK", "1" if rows_stack else "0")
    forward = None if fmt is None else lean_forward_for(model, fmt)
    g = torch.Generator().manual_seed(5)
    one = TargetAdapter(model, forward=forward)
    out = [one.prefill([torch.randint(0, 40, (700,), generator=g).tolist()], capacity=800)]
    for width, keep in ((1, 1), (4, 2), (7, 7), (40, 40), (1, 1)):
        out.append(one.extend(torch.randint(0, 40, (1, width), generator=g)))
        one.commit(torch.tensor([keep]))
    two = TargetAdapter(model, forward=forward)
    prompt = torch.randint(0, 40, (9,), generator=g).tolist()
    out.append(two.prefill([prompt, prompt[::-1]], capacity=32, hidden_layers=(0, 1, -1)))
    for width in (1, 3, 1):
        assert two.lengths.tolist() == [two.lengths[0]] * 2
        out.append(two.extend(torch.randint(0, 40, (2, width), generator=g)))
        two.commit(torch.tensor([width, width]))
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", [None, "int8", "int4"], ids=["own-dtype", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_rows_stack_gives_the_operator_bits(name, dtype, fmt, threads, monkeypatch):
    """A few rows in one parallel region (products split over the threads, attention over the
    (sequence, head) pairs, barriers between) give the bits of the operator path, every
    architecture and weight format, one sequence and two, on one thread and two."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = model_of(name, seed=4, vocab=40, max_position_embeddings=1024).to(dtype)
        ref = _row_steps(model, fmt, False, monkeypatch)
        got = _row_steps(model, fmt, True, monkeypatch)
    finally:
        torch.set_num_threads(before)
    assert all(t is not None for t in ref[1:])
    for a, b in zip(ref[1:], got[1:], strict=True):
        assert torch.equal(a, b), name


def test_a_wrong_rows_stack_is_caught(monkeypatch):
    """The comparison above can fail: the rows stack of a model whose second layer's
    attention output norm is changed against the operator path of the original."""
    model = model_of("llama", seed=4, vocab=40, max_position_embeddings=1024)
    ref = _row_steps(model, None, False, monkeypatch)
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight.mul_(1.01)
    got = _row_steps(model, None, True, monkeypatch)
    assert not torch.equal(ref[-1], got[-1])
