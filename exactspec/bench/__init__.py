"""Benchmarks: `exactspec bench` compares exactspec's engines with transformers' on real models.

harness.py    the run: every engine on workloads.json, interleaved round by round
engines.py, specs.py, llama_cpp.py, hf_quantized.py   the engines compared (drafters built
              through drafters/registry.py, named by engine_names.py's BenchUse words)
rows.py, figures.py   one row's figures; alpha, the analytic bound, the machine
report.py, table.py, trees.py, tree_report.py         tables and plots (and trees vs chains)
ceiling.py, width_cost.py, verify_speed.py            study tools (`python -m ...`), not tests
(docs/performance.md has the dated runs)
"""

from __future__ import annotations

from exactspec.lazy import lazy_names

# public name -> module defining it; imported when the name is first used (PEP 562), so the
# command line reads `engine_names` (the bench's drafter words) without importing torch
_LAZY: dict[str, str] = {
    **dict.fromkeys(["MODES", "EngineSpec", "Engines", "Mode", "Run", "default_engines",
                     "truncated_draft"], "exactspec.bench.engines"),
    **dict.fromkeys(["analytic_bound", "fit_alpha", "machine_info"], "exactspec.bench.figures"),
    **dict.fromkeys(["Bench", "BenchConfig", "Workload", "load_workloads"],
                    "exactspec.bench.harness"),
    **dict.fromkeys(["format_report", "format_table", "write_plots"], "exactspec.bench.report"),
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_names("exactspec.bench", _LAZY, globals())
