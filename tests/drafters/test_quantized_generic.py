"""QuantizedDraft on targets the lean forward does not run: the quantized transformers copy.

Tiny random Gemma 2 models (sliding and full attention layers, LM head tied to the embeddings)
built from a config here. Exact: greedy speculative == plain greedy; the copy's logits equal a
float model carrying the dequantized weights (reference kernel forced). Statistical: the
engine's sequence-level chi-square at 1e-6 (helpers of tests/audit/test_engine_lossless.py),
and a wrong variant (q claimed at another temperature) rejected by it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel

from exactspec import SamplingParams
from exactspec.audit import target_law
from exactspec.audit.stats import chi_square
from exactspec.audit.world import logits_table
from exactspec.drafters.quantized import QuantizedDraft
from exactspec.engine import generate
from exactspec.models import formats, quantize
from exactspec.models.adapter import TargetAdapter
from exactspec.models.quantize_modules import QuantLinear, quantized_copy, quantized_copy_for
from tests.audit.test_engine_lossless import (
    FILTERED,
    PROMPT,
    ROWS,
    K,
    N,
    V,
    _counts,
    _hot_drafter_is_caught,
    _world,
)

GREEDY = SamplingParams(temperature=0)
BF16_EPS = 2.0**-8  # relative rounding of one bf16 value


def tiny_gemma(seed: int = 0, *, vocab: int = 64, scale: float = 5.0) -> Gemma2ForCausalLM:
    """Gemma 2 (the lean forward runs Gemma 3 now; Gemma 2's soft-capping keeps it generic):
    2 layers (sliding window 4, then full attention), tied head; embeddings scaled by `scale`
    so the logits are neither flat nor one-hot."""
    torch.manual_seed(seed)
    cfg = Gemma2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, max_position_embeddings=128, sliding_window=4,
                       layer_types=["sliding_attention", "full_attention"],
                       bos_token_id=None, pad_token_id=None, eos_token_id=None)
    cfg._attn_implementation = "eager"  # soft-capped attention scores
    model = Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(scale)
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("bits", [8, 4, 16])
def test_greedy_equals_plain(bits):
    target = tiny_gemma(0)
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8]]
    plain = generate(target, prompts, params=GREEDY, max_new_tokens=16)
    drafter = QuantizedDraft(bits, backend="torch")  # the copy (llama.cpp: test_quantized_archs)
    out = generate(target, prompts, drafter=drafter, params=GREEDY, max_new_tokens=16,
                   num_draft_tokens=4)
    assert drafter.backend == "torch" and drafter.copy is not None and drafter.forward is None
    assert [g.token_ids for g in out] == [g.token_ids for g in plain]
    assert sum(g.stats.accepted for g in out) > 0


def test_tree_greedy_equals_plain():
    target = tiny_gemma(0)
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8]]
    plain = generate(target, prompts, params=GREEDY, max_new_tokens=12)
    out = generate(target, prompts, drafter=QuantizedDraft(8, tree=(2, 2)), params=GREEDY,
                   max_new_tokens=12, num_draft_tokens=2)
    assert [g.token_ids for g in out] == [g.token_ids for g in plain]
    assert sum(g.stats.accepted for g in out) > 0


def test_the_copy_quantizes_every_linear_and_unties_the_head_in_the_copy_only():
    target = tiny_gemma(0)
    assert target.lm_head.weight is target.model.embed_tokens.weight
    names = [n for n, m in target.named_modules() if isinstance(m, torch.nn.Linear)]
    clone = quantized_copy(target, "int8")
    for name in names:
        q = clone.get_submodule(name)
        assert isinstance(q, QuantLinear) and q.matrix.fmt == "int8", name
        want, s = quantize.quantize_int8(target.get_submodule(name).weight.float())
        assert torch.equal(q.matrix.dequantized(),
                           (want.float() * s.to(torch.bfloat16).float()[:, None])
                           .to(q.matrix.dequantized().device)), name
    assert target.lm_head.weight is target.model.embed_tokens.weight  # the target is untouched
    assert isinstance(target.lm_head, torch.nn.Linear)
    assert clone.model.embed_tokens.weight is target.model.embed_tokens.weight  # shared


@pytest.mark.parametrize("packed", [True, False])
def test_the_swapped_module_against_its_dequantized_reference(monkeypatch, packed):
    """Both kernel paths (forced: the per-process timing may pick either on a busy machine)."""
    monkeypatch.setitem(formats._KERNEL_OK, "int8", packed)
    lin = torch.nn.Linear(96, 64, bias=True)
    q = QuantLinear(lin.weight, lin.bias, "int8")
    assert q.matrix.packed is packed
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0))
    y = q(x)  # [5, 64] float32
    assert y.dtype == torch.float32 and y.shape == (5, 64)
    if not packed:  # the fallback is the reference itself
        assert torch.equal(y, q.reference(x))
        return
    # the kernel's bf16 input, then bf16 rounding of the product (before the float32 bias)
    xb = x.bfloat16().float()
    prod = q.matrix.reference(xb)  # [5, 64] without the bias
    assert torch.equal(q.reference(xb), prod + lin.bias.detach())
    bound = 2 * BF16_EPS * prod.abs() + 1e-4  # as tests/models/test_formats.py
    err = (y - lin.bias.detach() - prod).abs()
    assert bool((err <= bound).all()), float(err.max())


def test_the_copy_computes_the_model_with_dequantized_weights(monkeypatch):
    """With the reference kernel, the copy's logits are, bit for bit, those of a float model
    whose linear weights are the dequantized ones (the rest of the forward is the model's)."""
    monkeypatch.setitem(formats._KERNEL_OK, "int8", False)
    target = tiny_gemma(0)
    clone = quantized_copy(target, "int8")
    float_model = copy.deepcopy(target)
    float_model.lm_head.weight = torch.nn.Parameter(target.lm_head.weight.detach().clone())
    with torch.no_grad():
        for name, m in float_model.named_modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(clone.get_submodule(name).matrix.dequantized())
    ids = torch.tensor([[1, 5, 9, 13, 7, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(clone(ids).logits, float_model(ids).logits)
        assert not torch.equal(clone(ids).logits, target(ids).logits)  # it is quantized


def test_the_copy_is_cached_and_rebuilt_after_a_weight_update():
    target = tiny_gemma(0)
    drafter = QuantizedDraft(8, backend="torch")
    generate(target, [[1, 2, 3]], drafter=drafter, params=GREEDY, max_new_tokens=4)
    first = drafter.copy
    generate(target, [[4, 5]], drafter=drafter, params=GREEDY, max_new_tokens=4)
    assert drafter.copy is first and quantized_copy_for(target, "int8") is first
    with torch.no_grad():  # an in-place policy update, as an RL step makes
        for p in target.parameters():
            p.mul_(-1.0)
    out = generate(target, [[1, 2, 3]], drafter=drafter, params=GREEDY, max_new_tokens=12)
    assert drafter.copy is not first
    assert torch.equal(drafter.copy.lm_head.matrix.dequantized(),
                       -first.lm_head.matrix.dequantized())  # int8 symmetric: q -> -q
    plain = generate(target, [[1, 2, 3]], params=GREEDY, max_new_tokens=12)
    assert out[0].token_ids == plain[0].token_ids
    assert out[0].stats.accepted > out[0].stats.drafted // 2  # it drafts the new weights


def test_llama_cpp_and_layers_are_refused_for_a_non_llama_target(monkeypatch):
    from exactspec.drafters import quantized

    monkeypatch.setattr(quantized, "llama_cpp_available", lambda: True)
    cfg = GPT2Config(vocab_size=16, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                     bos_token_id=None, eos_token_id=None)
    with pytest.raises(ValueError, match=r"backend='llama\.cpp' cannot run GPT2LMHeadModel: "
                                         r"the GGUF export covers"):
        generate(GPT2LMHeadModel(cfg).eval(), [[1, 2, 3]],
                 drafter=QuantizedDraft(8, backend="llama.cpp"), params=GREEDY, max_new_tokens=4)
    target = tiny_gemma(0)
    with pytest.raises(ValueError, match=r"layers=\[0\] needs the lean forward"):
        generate(target, [[1, 2, 3]], drafter=QuantizedDraft(8, layers=[0]), params=GREEDY,
                 max_new_tokens=4)


@pytest.mark.parametrize("packed", [True, False])
def test_a_gpt2_target_conv1d_layers_greedy_equals_plain(monkeypatch, packed):
    """GPT-2's Conv1D layers ([in, out] weights), through both kernel paths (forced)."""
    monkeypatch.setitem(formats._KERNEL_OK, "int8", packed)
    cfg = GPT2Config(vocab_size=16, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                     bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    target = GPT2LMHeadModel(cfg).eval()
    plain = generate(target, [[1, 2, 3]], params=GREEDY, max_new_tokens=8)
    drafter = QuantizedDraft(8)
    out = generate(target, [[1, 2, 3]], drafter=drafter, params=GREEDY, max_new_tokens=8)
    assert out[0].token_ids == plain[0].token_ids
    assert drafter.copy.lm_head.matrix.packed is packed


@pytest.fixture(scope="module")
def models():
    """(target, -, its logits table, the same): the tuple the engine chi-square helpers take."""
    target = tiny_gemma(0, vocab=V, scale=3.0)
    table = logits_table(lambda ids: target(ids).logits, PROMPT, V, N + K)
    return target, None, table, table


def copy_logits(model, fmt: str):
    """forward(ids [N, T]) -> logits [N, T, V] of `model`'s cached quantized copy."""
    clone = quantized_copy_for(model, fmt)

    def forward(ids: torch.Tensor) -> torch.Tensor:
        ad = TargetAdapter(clone, lean=False)
        ad.prefill([[] for _ in range(ids.shape[0])])
        return ad.extend(ids)

    return forward


def test_generate_matches_the_target(models):
    counts, accepted = _counts(models, QuantizedDraft(8, backend="torch"), FILTERED, "token",
                               seed=5)
    assert accepted > ROWS // 10  # drafts were really used, not only bonus tokens
    result = chi_square(counts, target_law(_world(models, FILTERED), N))
    assert result.dof > 30 and not result.rejected, result


def test_a_wrong_quantized_drafter_is_caught(models):
    """The copy drawing at temperature 1.0 but reporting q at the target's 0.5: its exact wrong
    law (from the copy's own logits) is rejected end to end, and followed by the draws."""
    q_logits = logits_table(copy_logits(models[0], "int8"), PROMPT, V, N + K)
    _hot_drafter_is_caught(models, q_logits, QuantizedDraft(8, backend="torch"), seed=8)
