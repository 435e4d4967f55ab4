"""A third-party engine's native crash loses its own rows, never the bench (bench/isolated.py):
the crash is caught in the parent with the signal's name, the other rows and the JSON are
written, and the report marks the engine crashed."""

from __future__ import annotations

import json

import pytest

from exactspec.bench import Bench, BenchConfig, EngineSpec, Workload, format_report
from exactspec.bench.engines import Engines
from exactspec.bench.isolated import EngineCrashed, Isolated
from exactspec.bench.llama_cpp import FORMATS
from tests.bench.crashing_engine import CrashingEngine
from tests.engine.tiny import tiny_model


def test_a_call_answers_an_error_is_raised_and_a_segfault_is_named():
    engine = Isolated("stand-in", CrashingEngine, False)
    try:
        assert engine.call("echo", [1, 2]) == [1, 2]
        with pytest.raises(RuntimeError, match="stand-in: KeyError"):
            engine.call("fail")
        assert engine.call("echo", "still there") == "still there"
        with pytest.raises(EngineCrashed, match="stand-in: crashed with SIGSEGV"):
            engine.call("segfault")
        with pytest.raises(EngineCrashed):  # and stays so
            engine.call("echo", 1)
    finally:
        engine.close()


def test_a_crashing_llama_cpp_row_is_lost_and_every_other_row_is_kept(monkeypatch, tmp_path):
    spec = EngineSpec("llama.cpp q8_0", "llama.cpp", "none", weights="q8_0")
    engines = {}

    def llama(self, s):  # the stand-in in its own process, where the real engine would be
        if s.weights not in engines:
            engines[s.weights] = Isolated(s.name, CrashingEngine, True)
        return engines[s.weights]

    monkeypatch.setattr(Engines, "llama", llama)
    monkeypatch.setattr(Engines, "why_not", lambda self, s: None)
    monkeypatch.setattr(Engines, "available", lambda self, s: True)
    model = tiny_model(0, layers=2, eos=0)
    workloads = [Workload("chat", "questions", False, 8, ["why is the sky blue?"])]
    plain = EngineSpec("exactspec plain", "exactspec", "none")
    lookup = EngineSpec("exactspec lookup K=2", "exactspec", "lookup", 2)
    bench = Bench(model, BenchConfig(rounds=2, modes=["greedy", "t1"], sweep_ks=[],
                                     batch_rows=0),
                  engines=[plain, spec, lookup], workloads=workloads, progress=False)
    result = bench.run()
    for e in engines.values():
        e.close()
    assert result["crashed"] == {"llama.cpp q8_0": "llama.cpp q8_0: crashed with SIGSEGV"}
    rows = {(r["engine"], r["mode"]) for r in result["results"]}
    assert rows == {(e, m) for e in ("exactspec plain", "exactspec lookup K=2")
                    for m in ("greedy", "t1")}
    json.dumps(result)  # the JSON is whole
    report = format_report(result)
    assert "llama.cpp q8_0: CRASHED (crashed with SIGSEGV); its rows are left out" in report


def test_an_unusable_llama_cpp_leaves_its_rows_out_with_the_reason(monkeypatch):
    from exactspec.drafters import llama_cpp_check

    why = "llama.cpp crashed with SIGSEGV in its smoke test at a 64-token Q8_0 batch"
    monkeypatch.setattr(llama_cpp_check, "status", lambda: llama_cpp_check.Status(False, why))
    model = tiny_model(0, layers=2, eos=0)
    workloads = [Workload("chat", "questions", False, 4, ["hi"])]
    bench = Bench(model, BenchConfig(rounds=1, modes=["greedy"], sweep_ks=[], batch_rows=0,
                                     engines=["exactspec plain", "llama.cpp"]),
                  workloads=workloads, progress=False)
    assert [s.name for s in bench.specs] == ["exactspec plain"]
    result = bench.run()
    assert set(result["left_out"]) == {f"llama.cpp {f}" for f in FORMATS}
    assert f"llama.cpp q8_0: not run here: {why}" in format_report(result)
