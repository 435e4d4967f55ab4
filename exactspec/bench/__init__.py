"""Benchmarks: `exactspec bench` compares exactspec's engines with transformers' on real models."""

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
