"""width_cost measures real forwards without disturbing the adapter's committed cache."""

from __future__ import annotations

from exactspec.bench.width_cost import profile_step, time_widths
from exactspec.models.adapter import TargetAdapter
from tests.engine.tiny import tiny_llama


def test_time_widths_leaves_the_context_and_reports_every_width():
    adapter = TargetAdapter(tiny_llama(1))
    ms = time_widths(adapter, [1, 3], batch=2, context=6, repeats=2)
    assert set(ms) == {1, 3} and all(v > 0 for v in ms.values())
    assert adapter.lengths.tolist() == [6, 6]  # extends were never committed


def test_profile_step_splits_operator_time():
    total, share = profile_step(TargetAdapter(tiny_llama(1)), 3, context=5)
    assert total > 0 and 0.0 < share < 1.0
