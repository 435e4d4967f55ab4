"""width_cost reports the median time of the timed forwards per width (the warm-up left out),
without disturbing the adapter's committed cache; the profile's matmul share is mm / total."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from exactspec.bench import width_cost
from exactspec.bench.width_cost import LAYER_OPS, matmul_share, profile_step, time_widths
from exactspec.models.adapter import TargetAdapter
from tests.engine.tiny import tiny_llama


def test_time_widths_is_the_median_of_the_timed_forwards(monkeypatch):
    """A fake clock that each forward of width w advances by w ms + 0.1 ms per call so far:
    width w's forwards (warm-up, then 3 timed) take w + 0.1 (j+1), w + 0.1 (j+2), w + 0.1 (j+3)
    ms after its warm-up call j, so the median is w + 0.1 (j + 2) ms."""
    adapter = TargetAdapter(tiny_llama(1))
    clock = {"now": 0.0, "calls": 0, "armed": False}  # armed once the prefill is done
    extend, prefill = adapter.extend, adapter.prefill

    def slow_extend(tokens, **kw):
        if clock["armed"]:
            clock["calls"] += 1
            clock["now"] += 1e-3 * (tokens.shape[1] + 0.1 * clock["calls"])
        return extend(tokens, **kw)

    def armed_prefill(*a, **kw):
        out = prefill(*a, **kw)
        clock["armed"] = True
        return out

    monkeypatch.setattr(adapter, "extend", slow_extend)
    monkeypatch.setattr(adapter, "prefill", armed_prefill)
    monkeypatch.setattr(width_cost.time, "perf_counter", lambda: clock["now"])
    ms = time_widths(adapter, [1, 3], batch=2, context=6, repeats=3)
    # width 1: warm-up call 1, timed calls 2, 3, 4 (1.2, 1.3, 1.4 ms)
    assert ms[1] == pytest.approx(1 + 0.1 * 3, abs=1e-9)
    assert ms[3] == pytest.approx(3 + 0.1 * 7, abs=1e-9)  # warm-up call 5, timed 6, 7, 8
    assert adapter.lengths.tolist() == [6, 6]  # extends were never committed


def test_matmul_share_counts_only_matrix_products():
    events = [SimpleNamespace(key="aten::mm", self_cpu_time_total=200.0),
              SimpleNamespace(key="exactspec::linear", self_cpu_time_total=100.0),
              SimpleNamespace(key="aten::addmm", self_cpu_time_total=100.0),
              SimpleNamespace(key="aten::softmax", self_cpu_time_total=500.0),
              SimpleNamespace(key="aten::bmm", self_cpu_time_total=100.0)]
    total, share = matmul_share(events)
    assert total == 1.0 and share == 0.5
    events.append(SimpleNamespace(key="exactspec::decoder_stack", self_cpu_time_total=1000.0))
    assert matmul_share(events, LAYER_OPS) == (2.0, 0.5)  # the layers' op counted alone


def test_profile_step_finds_the_matrix_products():
    """A real forward: the profiler names some of its time as matrix products, not all of it."""
    total, share = profile_step(TargetAdapter(tiny_llama(1)), 3, context=5)
    assert total > 0 and 0.0 < share < 1.0
