"""Rollouts under es.batch_invariant() stay exactly the target's law: the sequence-level
chi-square of tests/audit/test_engine_lossless.py (alpha = 1e-6, its threshold from the sample
size) through es.generate inside the mode, and a wrong verification shown to fail there."""

from __future__ import annotations

import pytest

import exactspec as es
from exactspec.audit import output_law, power, target_law
from exactspec.audit.pitfalls import ResidualFromTarget, WrongResidual, wrong_verify
from exactspec.audit.stats import chi_square
from exactspec.drafters import DraftModel, QuantizedDraft
from tests.audit.test_engine_lossless import (  # noqa: F401 (models: a fixture)
    FILTERED,
    ROWS,
    K,
    N,
    _counts,
    _world,
    models,
)


@pytest.mark.parametrize(("drafter", "params", "method"), [
    pytest.param("int8", FILTERED, "token", id="int8-filtered-token"),
    pytest.param("tree", FILTERED, "traversal", id="tree-filtered-traversal"),
])
def test_rollouts_in_the_mode_follow_the_target(models, drafter, params, method):  # noqa: F811
    make = {"int8": lambda: QuantizedDraft(8, backend="torch"),
            "tree": lambda: DraftModel(models[1], tree=(2, 1))}[drafter]
    with es.batch_invariant():
        counts, accepted = _counts(models, make(), params, method, seed=15)
    assert accepted > ROWS // 10
    result = chi_square(counts, target_law(_world(models, params), N))
    assert result.dof > 30 and not result.rejected, result


def test_a_wrong_verify_in_the_mode_is_caught(models):  # noqa: F811
    world = _world(models, FILTERED)
    target = target_law(world, N)
    wrong = output_law(world, WrongResidual("token", K, ResidualFromTarget, "from p"), N)
    assert power(target, wrong, ROWS) > 1 - 1e-6
    with es.batch_invariant():
        counts, _ = _counts(models, DraftModel(models[1]), FILTERED,
                            wrong_verify(ResidualFromTarget), seed=16)
    assert chi_square(counts, target).rejected
    assert not chi_square(counts, wrong).rejected
