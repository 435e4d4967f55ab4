"""Smoke tests of the bench harness on a tiny random Llama: schema and consistency, never timings."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from exactspec import kernels
from exactspec.bench import (
    Bench,
    BenchConfig,
    Workload,
    analytic_bound,
    fit_alpha,
    format_report,
    load_workloads,
    truncated_draft,
    write_plots,
)
from exactspec.cli import build_parser
from exactspec.drafters.gguf_draft import llama_cpp_available
from tests.engine.tiny import tiny_model

ROW_KEYS = {
    "engine", "family", "drafter", "k", "verify", "mode", "workload", "tokens", "seconds",
    "tokens_per_second", "tokens_per_second_rounds", "tokens_per_second_min",
    "tokens_per_second_max", "ratio_to_plain", "mean_acceptance_length", "acceptance_rate",
    "alpha", "mean_k", "c", "bound", "share_of_bound", "time_split", "verify_share_of_step",
    "target_width_cost", "bound_with_width_cost",
    "acceptance_by_position", "weight_bytes", "step_ms", "bandwidth_gbs", "bandwidth",
}

WORKLOADS = [
    Workload("chat", "questions", False, 12, ["why is the sky blue?", "name three fruits."]),
    Workload("copy", "copy a list", True, 16,
             ["copy: abc abc abc abd abc abc abc abd abc abc", "repeat 1 2 3 1 2 3 1 2 3 1 2"]),
]


@pytest.fixture(scope="module")
def result():
    model = tiny_model(0, layers=3, eos=0)
    cfg = BenchConfig(rounds=2, modes=["greedy", "t1"], sweep_ks=[1, 3],
                      sweep_workload="copy", batch_rows=3, batch_max_new_tokens=8,
                      draft_layers=1)
    bench = Bench(model, cfg, draft=truncated_draft(model.model, 1), draft_note="first layer",
                  workloads=WORKLOADS, progress=False)
    return bench.run()


def test_schema(result):
    assert result["schema"] == 1
    for key in ("date_utc", "machine", "model", "config", "engines", "results", "sweep",
                "batch", "duration_seconds", "draft_note"):
        assert key in result, key
    json.loads(json.dumps(result))  # JSON-ready
    assert result["machine"]["cpu_capability"] in {"DEFAULT", "AVX2", "AVX512", "ZVECTOR",
                                                   "VSX"}
    assert result["machine"]["kernel_unit"] in {*kernels.available_isas(), None}
    if kernels.enabled():  # the unit that ran is the one named
        assert result["machine"]["kernel_unit"] == kernels.current_isa()
    bw = result["bandwidth"]
    linear = sum(m.weight.numel() * 4 for m in tiny_model(0, layers=3).model.modules()
                 if isinstance(m, torch.nn.Linear))  # float32 projections + the head
    assert bw["target_weight_bytes"] == linear
    plain = bw["exactspec plain"]
    assert plain["share_of_limit"] == pytest.approx(
        linear / 1e9 / (plain["step_ms"] / 1e3) / bw["read_gbs"], rel=1e-12)
    engines = {r["engine"] for r in result["results"]}
    assert {"exactspec plain", "transformers plain", "exactspec lookup K=4",
            "transformers lookup K=4", "exactspec draft K=4", "transformers assisted K=4",
            "exactspec lookup auto", "exactspec draft auto", "exactspec qdraft int8 K=6",
            "exactspec qdraft int8 auto", "transformers assisted int8 K=6",
            "exactspec qdraft int4 K=6"} <= engines
    if llama_cpp_available():
        assert {"llama.cpp f32", "llama.cpp q8_0", "llama.cpp q4_1"} <= engines
    for r in result["results"]:  # every engine with a known target step has a bandwidth
        known = r["family"] != "transformers" or r["drafter"] == "none"
        assert (r["bandwidth"] is not None) == known, r["engine"]
    for r in result["results"] + result["sweep"] + result["batch"]:
        assert set(r) >= ROW_KEYS, ROW_KEYS - set(r)
    # block verification runs in sampling modes only (equal to token when p is one-hot)
    assert not [r for r in result["results"] if r["verify"] == "block" and r["mode"] == "greedy"]
    assert [r for r in result["results"] if r["verify"] == "block" and r["mode"] == "t1"]
    # sweep: plain + (lookup, draft, int8) x K in {1, 3}; batch: plain, lookup x2, int8 x2
    assert len(result["batch"]) == 5 and len(result["sweep"]) == 7


def test_ratios_are_consistent(result):
    rows = result["results"]
    by = {(r["engine"], r["mode"], r["workload"]): r for r in rows}
    for r in rows:
        assert len(r["tokens_per_second_rounds"]) == 2
        assert r["tokens_per_second_min"] <= r["tokens_per_second"] <= r["tokens_per_second_max"]
        plain = by[("exactspec plain", r["mode"], r["workload"])]
        assert r["ratio_to_plain"] == pytest.approx(r["tokens_per_second"]
                                                    / plain["tokens_per_second"])
        if r["counterpart"] is not None:
            other = by[(r["counterpart"], r["mode"], r["workload"])]
            assert r["ratio_to_counterpart"] == pytest.approx(
                r["tokens_per_second"] / other["tokens_per_second"])
        assert r["tokens"] > 0 and r["seconds"] > 0


def test_speculative_figures_are_consistent(result):
    for r in result["results"] + result["sweep"]:
        if r["family"] != "exactspec":
            assert r["mean_acceptance_length"] is None
            continue
        assert r["mean_acceptance_length"] == pytest.approx(r["tokens"] / r["steps"])
        split = r["time_split"]
        assert set(split) == {"prefill", "draft", "target_forward", "standardize_verify",
                              "bookkeeping"}
        assert all(v >= 0 for v in split.values()) and sum(split.values()) <= 1 + 1e-9
        assert 0 <= r["verify_share_of_step"] <= 1
        if r["drafter"] == "none":
            assert r["mean_acceptance_length"] == 1.0 and r["alpha"] is None
            continue
        assert 1.0 <= r["mean_acceptance_length"] <= r["mean_k"] + 1 + 1e-9
        assert 0 <= r["alpha"] <= 1
        assert r["accepted"] <= r["drafted"]
        assert all(0 <= a <= 1 for a in r["acceptance_by_position"])
        app, dpp = r["accepted_per_position"], r["drafted_per_position"]
        assert all(a >= b for a, b in itertools.pairwise(app))  # a prefix is kept
        assert all(a >= b for a, b in itertools.pairwise(dpp))
        assert len(app) <= len(dpp) and all(a <= d for a, d in zip(app, dpp, strict=False))
        assert dpp[0] <= r["steps"] and sum(dpp) == r["drafted"] and sum(app) == r["accepted"]
        if r["c"] is not None:
            assert r["bound"] == pytest.approx(analytic_bound(r["alpha"], r["mean_k"], r["c"]))
            assert r["share_of_bound"] == pytest.approx(r["ratio_to_plain"] / r["bound"])


def test_greedy_engines_agree_on_text():
    """Greedy: every exactspec engine, transformers and llama.cpp f32 emit the same tokens
    (same weights; llama.cpp's q8_0 / q4_1 rows run quantized weights, other models)."""
    model = tiny_model(0, layers=3, eos=0)
    bench = Bench(model, BenchConfig(rounds=1), draft=truncated_draft(model.model, 1),
                  workloads=WORKLOADS, progress=False)
    prompt = [bench._encode(WORKLOADS[1].prompts[0])]
    from exactspec.bench import MODES

    texts = {s.name: bench.runner.run(s, prompt, MODES["greedy"], 16, seed=0).texts
             for s in bench.specs if not s.sampling_only and s.weights in (None, "f32")}
    assert len({json.dumps(t) for t in texts.values()}) == 1, texts
    assert ("llama.cpp f32" in texts) == llama_cpp_available()


def test_report_and_plots(result, tmp_path):
    text = format_report(result)
    assert "exactspec plain" in text and "speedup against K" in text and "batch of 3" in text
    md = format_report(result, markdown=True)
    assert "| engine |" in md
    # the CPU line names the CPU (model, family and model numbers where /proc/cpuinfo has them)
    # and the unit our kernels ran on
    cpu_line = next(ln for ln in text.splitlines() if ln.startswith("CPU: "))
    assert result["machine"]["cpu_model"] in cpu_line
    unit = result["machine"]["kernel_unit"]
    assert (f"our kernels' unit {unit}" if unit else "our kernels off") in cpu_line
    paths = write_plots(result, tmp_path)
    assert [p.name for p in paths] == ["tokens_per_second.png", "speedup_vs_k.png",
                                       "acceptance_by_position.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_fit_alpha_inverts_the_expected_length():
    for k in (1, 2, 4, 7.5):
        for a in (0.0, 0.3, 0.8, 0.95):
            mean_len = (1 - a ** (k + 1)) / (1 - a)
            assert fit_alpha(mean_len, k) == pytest.approx(a, abs=1e-6)
    assert fit_alpha(1.0, 4) == 0.0 and fit_alpha(5.0, 4) == 1.0
    assert analytic_bound(0.0, 4, 0.0) == 1.0
    assert analytic_bound(1.0, 4, 0.0) == 5.0
    assert math.isclose(analytic_bound(0.5, 2, 0.1), 1.75 / 1.2)


def test_truncated_draft_shares_weights():
    model = tiny_model(0, layers=3).model
    draft = truncated_draft(model, 2)
    assert len(draft.model.layers) == 2 and len(model.model.layers) == 3
    assert model.config.num_hidden_layers == 3 and draft.config.num_hidden_layers == 2
    assert draft.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    assert draft.model.layers[1] is model.model.layers[1]
    full = truncated_draft(model, 3)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(full(ids).logits, model(ids).logits)
        assert not torch.equal(draft(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="num_layers"):
        truncated_draft(model, 4)


def test_shipped_workloads():
    wl = load_workloads()
    names = {w.name for w in wl}
    assert {"chat", "code_edit", "list_transform", "summarise", "long"} <= names
    assert any(w.input_grounded for w in wl) and all(w.prompts for w in wl)
    assert BenchConfig.quick_config().workloads == ["chat", "code_edit", "summarise"]
    assert set(BenchConfig.quick_config().workloads) <= names


def test_cli_parses_bench():
    args = build_parser().parse_args(["bench", "--quick", "--threads", "1", "--out", "x"])
    assert args.quick and args.threads == 1 and args.out == "x"
    from exactspec.cli import bench as bench_cli

    assert args.run is bench_cli.run
