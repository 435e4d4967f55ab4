"""The lossless audit: exact enumeration and statistical tests of output distributions.

world.py     small context-dependent p / q tables to run on
exact.py     exact law of whole generations, TV distance, expected accepted tokens
samplers.py  the library's verifiers as audit schemes; batched simulation
stats.py     chi-square with pooled bins and a threshold from the false-alarm rate; power
pitfalls.py  the seeds' pitfalls as deliberately wrong samplers
lossy.py     the drift and acceptance gain of the opt-in lossy verify rules
trees.py     the tree rules as schemes (exact enumeration, simulation) and the tree pitfalls
explain.py   the seeds' one-step walk-through table and money diagram
report.py    the `exactspec audit` run and its table
(docs/audit.md)
"""

from exactspec.audit.exact import expected_accepted, output_law, tv_distance
from exactspec.audit.explain import (
    CAT_DOG_FISH,
    Explanation,
    explain,
    format_explanation,
    money_diagram,
)
from exactspec.audit.lossy import LossyConfig, LossyRow, format_lossy, plot_lossy, run_lossy
from exactspec.audit.pitfalls import Pitfall, pitfalls
from exactspec.audit.report import AuditConfig, AuditRow, format_table, run_audit
from exactspec.audit.samplers import Speculative, simulate
from exactspec.audit.stats import ALPHA, ChiSquare, chi_square, power
from exactspec.audit.trees import TreePitfall, TreeScheme, tree_pitfalls, tree_schemes
from exactspec.audit.world import World, folded_world, positional_world, random_world, target_law

__all__ = [
    "ALPHA", "CAT_DOG_FISH", "AuditConfig", "AuditRow", "ChiSquare", "Explanation", "Pitfall",
    "Speculative", "World", "chi_square", "expected_accepted", "explain", "folded_world",
    "format_explanation", "format_table", "money_diagram", "output_law", "pitfalls",
    "positional_world", "power", "random_world", "run_audit", "simulate", "target_law",
    "tv_distance",
]
__all__ += ["TreePitfall", "TreeScheme", "tree_pitfalls", "tree_schemes"]
__all__ += ["LossyConfig", "LossyRow", "format_lossy", "plot_lossy", "run_lossy"]
