"""Lossy verify rules through `generate`: the measured drift equals the exact one.

Statistical (false-alarm rate 1e-6 per check, fixed seeds). On a tiny random Llama pair (V = 8),
the first N = 2 tokens of generations with a lossy rule are tested against the rule's exact
law from the audit's enumeration (chi-square), their TV from the target against the exact TV
(within the McDiarmid bound of `drift_bound`), and against the target's law, which must be
rejected (the drift is real and visible). The same test fails when the generations come from
another parameter than the one enumerated.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from exactspec.audit import chi_square
from exactspec.audit.exact import output_law, tv_distance
from exactspec.audit.lossy import (
    LossyConfig,
    drift_bound,
    format_lossy,
    measure,
    model_tables,
    plot_lossy,
    run_lossy,
)
from exactspec.audit.samplers import Speculative
from exactspec.audit.world import target_law
from exactspec.drafters import DraftModel
from exactspec.engine import generate
from exactspec.sampling import SamplingParams

CFG = LossyConfig(rows=6000, model_new_tokens=4)  # N + K tokens: the first N see K drafts


@pytest.fixture(scope="module")
def tables():
    return model_tables(CFG)


def _exact(world, rule):
    return output_law(world, Speculative(rule, CFG.model_draft), CFG.model_tokens)


@pytest.mark.parametrize("rule", ["lenient:0.3", "typical:0.2"])
def test_measured_drift_equals_the_exact_drift(tables, rule):
    target, draft, world = tables
    counts, _ = measure(target, draft, rule, CFG, seed=11)
    law, ref = _exact(world, rule), target_law(world, CFG.model_tokens)
    exact_tv = tv_distance(law, ref)
    bound = drift_bound(law, CFG.rows, CFG.alpha)
    assert exact_tv > 2 * bound  # a drift this test can see
    assert not chi_square(counts, law).rejected  # the engine runs the enumerated rule
    assert chi_square(counts, ref).rejected  # and it is not the target's law
    measured = tv_distance(counts / counts.sum(), ref)
    assert abs(measured - exact_tv) <= bound


def test_the_drift_test_fails_on_another_parameter(tables):
    target, draft, world = tables
    counts, _ = measure(target, draft, "lenient:0.3", CFG, seed=12)
    assert chi_square(counts, _exact(world, "lenient:0.7")).rejected


def test_lossy_rules_are_exact_when_greedy(tables, caplog):
    target, draft, _ = tables
    greedy = SamplingParams(temperature=0)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [0]]
    plain = [g.token_ids for g in generate(target, prompts, params=greedy, max_new_tokens=12)]
    for rule in ("lenient:0.2", "typical:0.4"):
        with caplog.at_level(logging.WARNING):
            out = generate(target, prompts, drafter=DraftModel(draft), params=greedy,
                           max_new_tokens=12, verify=rule)
        assert [g.token_ids for g in out] == plain
        assert any("LOSSY" in r.getMessage() and rule in r.getMessage() for r in caplog.records)


def test_the_lossy_audit_table_and_plot(tmp_path):
    cfg = replace(CFG, rules=("lenient:0.5", "typical:0.2"), rows=1500)
    rows = run_lossy(cfg, progress=False)
    assert [r.rule for r in rows] == ["token", "lenient:0.5", "typical:0.2"]
    token, lenient, typical = rows
    assert token.step_tv < 1e-9 and token.sequence_tv < 1e-9 and token.model_tv < 1e-9
    assert token.gain == 1.0
    for r in (lenient, typical):
        assert r.step_tv > 1e-3 and r.model_tv > 1e-3
        assert abs(r.measured_tv - r.model_tv) <= r.bound
    assert lenient.step_tokens > token.step_tokens
    assert lenient.model_step_tokens > token.model_step_tokens
    table = format_lossy(rows, cfg)
    assert "lenient:0.5" in table and "NO" not in table.split("\n", 3)[3]
    png = plot_lossy(rows, tmp_path / "lossy.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
