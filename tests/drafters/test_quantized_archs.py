"""QuantizedDraft's llama.cpp backend beyond Llama: Mistral, Qwen 2, Qwen 3, Gemma 3 targets.

Tiny random models of each architecture the GGUF export covers (tests/models/test_gguf_export:
Gemma 3 with local layers of 4 positions, prompts past them). Exact: greedy speculative ==
plain greedy bit for bit, through `backend="llama.cpp"` and through "auto" (forced by
EXACTSPEC_QUANTIZED_BACKEND, and measured with a stand-in timer for both outcomes).
Statistical: the engine's sequence-level chi-square at 1e-6 (helpers and sample size of
tests/audit/test_engine_lossless.py, whose wrong-verify test shows the power of this test at
that size) for the Q8_0 draft of a Qwen 2 and a Gemma 3 target, and a wrong variant of the
Gemma 3 one (drawing at T = 1, claiming q at T = 0.5) rejected by it (Mistral's export is llama.cpp's
"llama", whose chi-square is tests/audit/test_engine_lossless.py's; Qwen 3 differs from Qwen 2 by
its q / k norms, checked by the export's logits test). A model the export refuses
(a window llama.cpp's architecture lacks) is refused by "llama.cpp" and drafted by torch under
"auto".
"""

from __future__ import annotations

import logging

import pytest

from exactspec import SamplingParams
from exactspec.audit import target_law
from exactspec.audit.stats import chi_square
from exactspec.audit.world import _contexts, logits_table
from exactspec.drafters import quantized, quantized_auto
from exactspec.drafters.gguf_draft import GgufDraft, llama_cpp_available, llama_cpp_why
from exactspec.drafters.quantized import QuantizedDraft
from exactspec.engine import generate
from exactspec.models.gguf_export import export_gguf
from tests.audit.test_engine_lossless import FILTERED, PROMPT, ROWS, K, N, V, _counts, _world
from tests.drafters.test_quantized import _context, _info
from tests.drafters.test_quantized_generic import _hot_drafter_is_caught
from tests.models.architectures import tiny
from tests.models.test_gguf_export import EXPORTED

pytestmark = pytest.mark.skipif(not llama_cpp_available(),
                                reason=llama_cpp_why())
GREEDY = SamplingParams(temperature=0)
ARCHS = [t for t in EXPORTED if t != "llama"]  # Llama's: tests/drafters/test_quantized.py
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8]]


def target(model_type: str, vocab: int = 64):
    """The tiny `model_type` target the export covers (32 wide: Q8_0 / Q4_0 whole blocks)."""
    return tiny(model_type, vocab=vocab, **EXPORTED[model_type])


def _greedy_equals_plain(model, drafter, new: int = 16) -> None:
    plain = generate(model, PROMPTS, params=GREEDY, max_new_tokens=new)
    out = generate(model, PROMPTS, drafter=drafter, params=GREEDY, max_new_tokens=new,
                   num_draft_tokens=4)
    assert [g.token_ids for g in out] == [g.token_ids for g in plain]
    assert sum(g.stats.accepted for g in out) > 0


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("model_type", ARCHS)
def test_llama_cpp_greedy_equals_plain(model_type, bits):
    drafter = QuantizedDraft(bits, backend="llama.cpp")
    _greedy_equals_plain(target(model_type), drafter)
    assert drafter.backend == "llama.cpp" and drafter.gguf is not None


@pytest.mark.parametrize("model_type", ARCHS)
def test_auto_forced_to_llama_cpp_drafts_with_it(model_type, monkeypatch):
    monkeypatch.setenv(quantized_auto.ENV, "llama.cpp")
    drafter = QuantizedDraft(8)
    _greedy_equals_plain(target(model_type), drafter)
    assert drafter.backend == "llama.cpp" and drafter.gguf is not None


@pytest.mark.parametrize("faster", ["llama.cpp", "torch"])
@pytest.mark.parametrize("model_type", ["qwen2", "gemma3_text"])
def test_auto_measures_both_and_uses_the_faster(model_type, faster, monkeypatch, caplog):
    """Both outcomes of auto's measurement (a stand-in timer): both backends were timed, the
    faster drafts (the slower llama.cpp copy is freed), greedy == plain. (The torch draft with
    a cache of its own: on the target's, auto takes it unmeasured.)"""
    monkeypatch.delenv(quantized_auto.ENV, raising=False)
    monkeypatch.setattr(quantized, "SHARE_TARGET_CACHE", False)
    timed = []

    def cost(drafter, info):
        name = "torch" if isinstance(drafter, QuantizedDraft) else "llama.cpp"
        timed.append(name)
        return 1e-3 if name == faster else 2e-3

    monkeypatch.setattr(quantized_auto, "_cost", cost)
    drafter = QuantizedDraft(8)
    with caplog.at_level(logging.INFO, logger=quantized_auto.__name__):
        _greedy_equals_plain(target(model_type), drafter)
    assert sorted(timed) == ["llama.cpp", "torch"]
    lines = [r.getMessage() for r in caplog.records if r.name == quantized_auto.__name__]
    assert len(lines) == 1 and lines[0].endswith(f"picks {faster}")
    assert drafter.backend == faster and (drafter.gguf is not None) == (faster == "llama.cpp")


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3"])
def test_a_window_llama_cpp_lacks_is_refused_and_auto_drafts_with_torch(model_type,
                                                                         monkeypatch, caplog):
    model = tiny(model_type, vocab=64)  # its tiny config's window of 4
    with pytest.raises(ValueError, match=r"backend='llama\.cpp' cannot run .* window of 4"):
        generate(model, PROMPTS, drafter=QuantizedDraft(8, backend="llama.cpp"),
                 params=GREEDY, max_new_tokens=4)
    monkeypatch.setenv(quantized_auto.ENV, "llama.cpp")  # decides only where both can run
    drafter = QuantizedDraft(8)
    _greedy_equals_plain(model, drafter)
    assert drafter.backend == "torch" and drafter.gguf is None


@pytest.mark.parametrize("model_type", ["qwen2", "gemma3_text"])  # Mistral is llama.cpp's llama
def test_generate_matches_the_target(model_type):
    """Sequence chi-square at alpha = 1e-6 over the first N tokens of ROWS generations."""
    model = target(model_type, vocab=V)
    table = logits_table(lambda ids: model(ids).logits, PROMPT, V, N + K)
    models = (model, None, table, table)
    counts, accepted = _counts(models, QuantizedDraft(8, backend="llama.cpp"), FILTERED,
                               "token", seed=5)
    assert accepted > ROWS // 10  # drafts were really used, not only bonus tokens
    result = chi_square(counts, target_law(_world(models, FILTERED), N))
    assert result.dof > 30 and not result.rejected, result


def llama_cpp_table(path, prompt, vocab: int, depth: int):
    """`logits_table` of llama.cpp running `path`: its logits after prompt + every context
    shorter than `depth` (each context one llama.cpp sequence)."""
    rows = [list(prompt) + c.tolist() for n in range(depth) for c in _contexts(vocab, n)]
    draft = GgufDraft(path)
    try:
        draft.begin(_context(rows, vocab), _info(vocab))
        return draft._decode([(0, r) for r in rows]).double()  # [S, V]
    finally:
        draft.free()


def test_a_wrong_llama_cpp_drafter_is_caught(tmp_path):
    """The Gemma 3 target's Q8_0 llama.cpp draft drawing at T = 1 but claiming q at the
    target's T = 0.5: its exact wrong law (from llama.cpp's own logits of the same export) has
    power > 1 - 1e-6 at ROWS, the engine's draws are rejected against the target's law and
    follow the wrong one (tests/drafters/test_quantized_generic's helper)."""
    model = target("gemma3_text", vocab=V)
    table = logits_table(lambda ids: model(ids).logits, PROMPT, V, N + K)
    q_logits = llama_cpp_table(export_gguf(model, tmp_path / "q.gguf", "q8_0"), PROMPT, V,
                               N + K)
    _hot_drafter_is_caught((model, None, table, table), q_logits,
                           QuantizedDraft(8, backend="llama.cpp"), seed=8)
