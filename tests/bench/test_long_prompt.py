"""The long_prompt workloads: one per prompt length, run when named, with time-to-first-token
and decode columns (bench/harness.py, bench/rows.py, bench/report.py). Never timings."""

from __future__ import annotations

import pytest

from exactspec.bench import Bench, BenchConfig, Workload, format_report, load_workloads
from exactspec.bench.harness import select_workloads, workload_names
from exactspec.errors import InvalidValue
from tests.engine.tiny import tiny_model


def test_shipped_long_prompt_family_runs_only_when_named():
    wl = load_workloads()
    family = [w for w in wl if w.name.startswith("long_prompt_")]
    assert [w.context_tokens for w in family] == [1024, 2048, 4096]
    assert not any(w.default for w in family)
    assert "long_prompt" in workload_names(wl)
    assert not any(w.context_tokens for w in select_workloads(wl, None))
    assert [w.name for w in select_workloads(wl, ["long_prompt", "chat"])] == [
        "chat", "long_prompt_1024", "long_prompt_2048", "long_prompt_4096"]
    assert [w.name for w in select_workloads(wl, ["long_prompt_2048"])] == ["long_prompt_2048"]
    with pytest.raises(InvalidValue, match=r"long_promp'.*have"):
        select_workloads(wl, ["long_promp"])


def test_long_prompt_rows_have_first_token_and_decode_figures():
    model = tiny_model(0, layers=2, eos=0)
    wl = [Workload("doc", "a document", True, 6, ["summarise:"], context_tokens=120,
                   default=False)]
    cfg = BenchConfig(rounds=1, modes=["greedy"], sweep_ks=[], batch_rows=0, block=False,
                      engines=["exactspec plain", "exactspec lookup K=4"], workloads=["doc"])
    result = Bench(model, cfg, workloads=wl, progress=False).run()
    n = result["prompt_tokens"]["doc"]
    assert abs(n - 120) <= 8, n  # the document cut to the room the prompt leaves
    rows = result["results"]
    assert {r["engine"] for r in rows} == {"exactspec plain", "exactspec lookup K=4"}
    for r in rows:
        assert r["ttft_ms"] > 0 and r["decode_tokens_per_second"] > 0
    text = format_report(result)
    assert "long prompts: time to the first token" in text and "prefill tok/s" in text
