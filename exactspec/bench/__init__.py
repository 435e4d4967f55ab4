"""Benchmarks: `exactspec bench` compares exactspec's engines with transformers' on real models.

harness.py    the run: every engine on workloads.json, interleaved round by round
engines.py, specs.py, llama_cpp.py, hf_quantized.py   the engines compared (drafters named
              and built through drafters/registry.py: each entry's BenchUse words)
rows.py, figures.py   one row's figures; alpha, the analytic bound, the machine
report.py, table.py, trees.py, tree_report.py         tables and plots (and trees vs chains)
ceiling.py, width_cost.py, verify_speed.py            study tools (`python -m ...`), not tests
(docs/performance.md has the dated runs)
"""

from exactspec.bench.engines import (
    MODES,
    Engines,
    EngineSpec,
    Mode,
    Run,
    default_engines,
    truncated_draft,
)
from exactspec.bench.figures import analytic_bound, fit_alpha, machine_info
from exactspec.bench.harness import Bench, BenchConfig, Workload, load_workloads
from exactspec.bench.report import format_report, format_table, write_plots

__all__ = [
    "MODES", "Bench", "BenchConfig", "EngineSpec", "Engines", "Mode", "Run", "Workload",
    "analytic_bound", "default_engines", "fit_alpha", "format_report", "format_table",
    "load_workloads", "machine_info", "truncated_draft", "write_plots",
]
