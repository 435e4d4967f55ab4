"""The scaling study reuses a train-draft run's data and trains every fraction equally long."""

from __future__ import annotations

import math

import pytest

from exactspec.training.data import load_parts
from exactspec.training.scaling import by_prompt, chain_alpha, log_fit, scaling, summary, table
from exactspec.training.train import train_draft
from tests.training.test_train_draft import config, tiny_model


def test_scaling_trains_each_fraction_for_the_same_steps(tmp_path):
    model = tiny_model()
    cfg = config(1)
    train_draft(cfg, tmp_path, model=model)
    groups = by_prompt(load_parts(tmp_path / "data" / "train"))
    assert len(groups) == len(cfg.prompts) and all(len(g) == cfg.replies for g in groups)
    rows = scaling(model, tmp_path / "data", [0.4, 1.0], 3, cfg=cfg)
    assert [r["prompts"] for r in rows] == [2, 5]
    assert [r["sequences"] for r in rows] == [2 * cfg.replies, 5 * cfg.replies]
    assert rows[0]["tokens"] < rows[1]["tokens"] and [r["steps"] for r in rows] == [3, 3]
    for r in rows:
        assert len(r["t1"]["alpha_by_depth"]) == cfg.eval_depth
    assert table(rows).count("\n") == 3
    assert set(summary(rows, k=cfg.eval_depth)) == {"t1", "greedy"}
    grid = scaling(model, tmp_path / "data", [1.0], [1, 2], cfg=cfg)
    assert [r["steps"] for r in grid] == [1, 2]
    assert "steps_needed" in summary(grid, k=cfg.eval_depth, along="steps")["t1"]


def test_chain_alpha_and_log_fit():
    a = chain_alpha(2.5, 4)
    assert sum(a**i for i in range(5)) == pytest.approx(2.5, abs=1e-9)
    assert chain_alpha(5.0, 4) == pytest.approx(1.0, abs=1e-9)
    c, slope = log_fit([1000, 4000, 16000], [0.30, 0.36, 0.42])
    assert slope == pytest.approx(0.03)  # per doubling: x4 data = +0.06
    assert c + slope * math.log2(1000) == pytest.approx(0.30)
