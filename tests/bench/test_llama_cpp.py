"""The llama.cpp bench rows: the exported GGUF computes the target, f32 greedy text is exactspec
plain's, T = 1 draws follow the target's law, and the bandwidth column is bytes / time / bw."""

from __future__ import annotations

import pytest
import torch

from exactspec.audit.stats import chi_square
from exactspec.bench import MODES, EngineSpec
from exactspec.bench.engines import Engines
from exactspec.bench.llama_cpp import (
    LlamaCppPlain,
    gguf_for,
    gguf_weight_bytes,
    llama_cpp_engines,
)
from exactspec.drafters.gguf_draft import llama_cpp_available, llama_cpp_why
from exactspec.engine import generate
from exactspec.models import gguf_export
from exactspec.sampling import SamplingParams, probs_from_logits
from tests.engine.tiny import tiny_model

pytestmark = pytest.mark.skipif(not llama_cpp_available(),
                                reason=llama_cpp_why())

F32, Q8, Q4 = llama_cpp_engines(("f32", "q8_0", "q4_1"))
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9], [1, 2, 3, 1, 2, 3, 1, 2, 3]]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A private conversion cache: the GGUF exports land in the test's directory."""
    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def target():
    # hidden 64: every matrix row is a whole number of 32-value blocks, so q8_0 / q4_1 quantize
    return tiny_model(0, hidden=64, eos=0)


def _errors(target, qtype: str) -> tuple[float, float]:
    """(llama.cpp's, transformers float32's) largest |logit - float64 reference| on a sequence."""
    ids = [3, 17, 9, 30, 5, 5, 22, 41, 8, 13, 2, 27]
    got = LlamaCppPlain.for_model(target.model, qtype, []).logits(ids).double()  # [T, V]
    model = target.model
    with torch.no_grad():
        f32 = model(torch.tensor([ids])).logits[0].double()
        model.double()
        try:
            f64 = model(torch.tensor([ids])).logits[0]
        finally:
            model.float()
    return float((got - f64).abs().max()), float((f32 - f64).abs().max())


def test_f32_gguf_logits_equal_transformers_within_float32_rounding(target):
    """Bound: llama.cpp's float32 logits lie as close to a float64 forward of the same weights
    as transformers' float32 logits do, within a factor of 16 (two float32 forwards that sum in
    different orders have errors of the same order, ~1e-6 of the logits here). A real mistake
    is orders of magnitude above it: q8_0 weights, and q / k rows not permuted for llama.cpp's
    RoPE (below), both fail the same bound."""
    llama, ref = _errors(target, "f32")
    assert 0 < ref < 1e-4  # the reference error itself is float32 rounding
    assert llama <= 16 * ref, (llama, ref)
    for qtype in ("q8_0", "q4_1"):
        err, _ = _errors(target, qtype)
        assert err > 16 * ref, (qtype, err, ref)


def test_unpermuted_qk_export_is_caught(target, monkeypatch):
    monkeypatch.setattr(gguf_export, "_permute", lambda w, n_head: w)
    llama, ref = _errors(target, "f32")
    assert llama > 16 * ref, (llama, ref)


def test_f32_greedy_ids_equal_exactspec_plain(target):
    """Greedy: llama.cpp f32 emits exactspec plain's ids, token for token (stopping at EOS)."""
    runner = Engines(target)
    got = runner.run(F32, PROMPTS, MODES["greedy"], 24, seed=0).texts
    plain = generate(target, PROMPTS, params=SamplingParams(temperature=0), max_new_tokens=24)
    assert got == [g.token_ids for g in plain]


def test_weight_bytes_follow_the_block_formats(target):
    """f32: 4 bytes per weight of every matrix a step multiplies by; q8_0 / q4_1 smaller by
    their block formats' ratios (q8_0: 34 bytes per 32 values, q4_1: 20 per 32)."""
    runner = Engines(target)
    f32 = runner.weight_bytes(F32)
    assert f32 == sum(m.weight.numel() * 4 for m in target.model.modules()
                      if isinstance(m, torch.nn.Linear))  # projections + untied head
    assert runner.weight_bytes(Q8) * 32 == f32 // 4 * 34
    assert runner.weight_bytes(Q4) * 32 == f32 // 4 * 20


def test_bf16_and_q4_0_rows_read_their_formats_bytes(target):
    """bf16: 2 bytes per weight, half of f32's; q4_0: 18 bytes per 32 values (a scale, 16)."""
    bf16, q4_0 = llama_cpp_engines(("bf16", "q4_0"))
    runner = Engines(target)
    f32 = runner.weight_bytes(F32)
    assert runner.weight_bytes(bf16) * 2 == f32
    assert runner.weight_bytes(q4_0) * 32 == f32 // 4 * 18


def test_tied_head_counts_the_embedding(tmp_path):
    """A tied head (no output.weight in the GGUF) reads the whole embedding every step."""
    model = tiny_model(0, hidden=64).model
    model.config.tie_word_embeddings = True
    path = gguf_export.export_gguf(model, tmp_path / "tied.gguf", "f32")
    linear = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    # the head is lm_head (vocab x hidden) whether tied or not: the same bytes either way
    assert gguf_weight_bytes(path) == linear


@pytest.mark.parametrize("mode", ["t1", "t0.7p0.9"])
def test_t1_draws_follow_the_target_law(mode):
    """llama.cpp f32's first sampled token over many seeds against exactspec's standardized p
    (chi-square, false-alarm rate 1e-6); the same draws fail against the other mode's law. A
    softer head (x 4, not x 20) spreads p over many tokens, so the two laws differ."""
    n = 1500
    prompt = PROMPTS[0]
    target = tiny_model(0, hidden=64, eos=0, head_scale=4.0)
    run = Engines(target).run(F32, [prompt] * n, MODES[mode], 1, seed=7)
    counts = torch.bincount(torch.tensor([t[0] for t in run.texts]), minlength=target.vocab_size)
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt])).logits[0, -1]
    law = probs_from_logits(logits, MODES[mode].params(0))
    assert not chi_square(counts, law).rejected
    other = "t0.7p0.9" if mode == "t1" else "t1"
    assert chi_square(counts, probs_from_logits(logits, MODES[other].params(0))).rejected


def test_bandwidth_column_is_bytes_over_time_over_bandwidth(target):
    """Every row's bandwidth = weight bytes / (target seconds / forwards) / read bandwidth,
    recomputed here from the runs and the result's own read bandwidth."""
    from exactspec.bench import Bench, BenchConfig, Workload

    specs = [EngineSpec("exactspec plain", "exactspec", "none"),
             EngineSpec("transformers plain", "transformers", "none"),
             EngineSpec("exactspec lookup K=3", "exactspec", "lookup", 3), F32, Q8]
    wl = [Workload("copy", "copy", True, 10, ["abc abc abc abc abc"])]
    bench = Bench(target, BenchConfig(rounds=1, modes=["greedy"], sweep_ks=[], batch_rows=0),
                  engines=specs, workloads=wl, progress=False)
    seen: dict[str, list] = {}
    run = bench.runner.run

    def spy(spec, *a, **kw):
        out = run(spec, *a, **kw)
        seen.setdefault(spec.name, []).append(out)
        return out

    bench.runner.run = spy
    result = bench.run()
    read = result["bandwidth"]["read_gbs"] * 1e9
    rows = {r["engine"]: r for r in result["results"]}
    assert set(rows) == {s.name for s in specs}
    for spec in specs:
        r, last = rows[spec.name], seen[spec.name][-1]  # the measured run (after the warm-up)
        if spec.family == "transformers":
            step = last.seconds / len(last.texts[0])
        else:
            step = last.target_seconds / last.forwards
            assert last.forwards == last.steps > 0
        want_bytes = (gguf_weight_bytes(gguf_for(bench.target.model, spec.weights))
                      if spec.family == "llama.cpp" else r["weight_bytes"])
        assert r["weight_bytes"] == want_bytes
        assert r["step_ms"] == pytest.approx(1e3 * step, rel=1e-12)
        assert r["bandwidth"] == pytest.approx(want_bytes / step / read, rel=1e-12)
    assert rows["llama.cpp q8_0"]["weight_bytes"] < rows["llama.cpp f32"]["weight_bytes"]
    # exactspec and transformers read the same float32 matrices as the f32 GGUF
    assert rows["exactspec plain"]["weight_bytes"] == rows["llama.cpp f32"]["weight_bytes"]
    assert rows["transformers plain"]["weight_bytes"] == rows["llama.cpp f32"]["weight_bytes"]


def test_q4_k_row_generates_and_reads_its_k_quant_bytes():
    """The q4_k row (llama.cpp's Q4_K_M mix of a 256-wide target: rows in whole super-blocks)
    runs in the bench's child process and decodes every prompt to its budget (no EOS id), and
    its bandwidth column counts the k-quant blocks: Q4_K 144 bytes per 256 values, Q6_K 210."""
    import gguf

    target = tiny_model(0, hidden=256)  # eos None: every row runs to max_new_tokens
    (q4_k,) = llama_cpp_engines(("q4_k",))
    runner = Engines(target)
    run = runner.run(q4_k, PROMPTS, MODES["greedy"], 12, seed=0)
    assert [len(t) for t in run.texts] == [12] * len(PROMPTS)
    assert all(0 <= i < target.vocab_size for t in run.texts for i in t)
    per_256 = {gguf.GGMLQuantizationType.Q4_K: 144, gguf.GGMLQuantizationType.Q6_K: 210}
    tensors = gguf.GGUFReader(str(gguf_for(target.model, "q4_k"))).tensors
    mats = [t for t in tensors if len(t.shape) == 2 and t.name != "token_embd.weight"]
    assert {t.tensor_type for t in mats} <= set(per_256)
    assert gguf.GGMLQuantizationType.Q4_K in {t.tensor_type for t in mats}
    want = sum(int(t.n_elements) // 256 * per_256[t.tensor_type] for t in mats)
    assert runner.weight_bytes(q4_k) == want
