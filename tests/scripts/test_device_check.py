"""scripts/device_check.py on CPU with tiny configs (--small), so the GPU script cannot rot: its
figures are recomputed here, its chi-square tests pass on the exact rules and fail on the wrong
variant, and it imports nothing of exactspec beyond exactspec.sampling."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The script as the GPU machine runs it: a fresh interpreter, started outside the repo."""
    out = tmp_path_factory.mktemp("device_check")
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--threads", "1",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((out / "device_check.json").read_text()), \
        (out / "device_check.md").read_text()


def _linear_bytes(cfg: dict, dtype_bytes: int) -> int:
    """q, k, v, o, gate, up, down per layer and the LM head, from the config alone."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * i
    return (cfg["num_hidden_layers"] * per_layer + v * h) * dtype_bytes


def test_figures_are_bytes_over_time(run):
    result, _ = run
    configs = _script().CONFIGS
    assert set(result["models"]) == {"tiny-a", "tiny-b"}
    for name, m in result["models"].items():
        cfg = configs[name]
        assert m["weight_bytes"] == _linear_bytes(cfg, 2)  # bfloat16
        norms = (2 * cfg["num_hidden_layers"] + 1) * cfg["hidden_size"]
        embed = 0 if cfg["tie_word_embeddings"] else cfg["vocab_size"] * cfg["hidden_size"]
        assert m["params"] == m["weight_bytes"] // 2 + norms + embed
        step = m["step_ms"] / 1e3
        assert m["achieved_gbs"] == pytest.approx(m["weight_bytes"] / step / 1e9, rel=1e-12)
        assert m["share_of_copy_bandwidth"] == pytest.approx(
            m["achieved_gbs"] / result["copy_bandwidth_gbs"], rel=1e-12)
        assert m["matmul_floor_share"] == pytest.approx(
            m["weight_bytes"] / (m["matmul_floor_ms"] / 1e3) / 1e9 / result["copy_bandwidth_gbs"],
            rel=1e-12)
        assert sorted(map(int, m["w"])) == list(range(1, 18)) and m["w"]["1"] == 1.0
        for n, w in m["w"].items():
            assert w == pytest.approx(m["width_ms"][n] / m["width_ms"]["1"], rel=1e-12)
        inv = m["invariance"]
        assert inv["values"] == 5 * cfg["vocab_size"] and 0 <= inv["bit_equal"] <= inv["values"]


def test_exactness_passes_and_the_wrong_variant_fails(run):
    result, md = run
    e = result["exactness"]
    assert e["ok"]
    tests = e["tests"]
    assert [t["must_pass"] for t in tests.values()] == [True, True, False]
    for t in tests.values():
        assert t["passed"] == t["must_pass"]
        assert t["passed"] == (t["statistic"] <= t["threshold"])  # p-value and quantile agree
        assert t["samples"] == 8_000 and t["df"] == t["cells"] - 1
    assert "(must fail)" in md and "tiny-a" in md and "tiny-b" in md


def test_only_the_pure_sampling_package_is_imported(run):
    """The GPU machine has no install of exactspec's dependencies: exactspec/__init__ is lazy
    and exactspec.sampling is pure torch, so nothing else of exactspec may load."""
    mods = run[0]["exactspec_modules"]
    assert "exactspec.sampling" in mods
    assert all(m in ("exactspec", "exactspec.errors") or m.startswith("exactspec.sampling")
               for m in mods), mods


def test_chi_square_threshold_and_p_value_match_scipy():
    from scipy import stats

    script = _script()
    for df in (1, 7, 63, 511):
        assert script.chi_square_threshold(df, 1e-6) == pytest.approx(stats.chi2.isf(1e-6, df),
                                                                      rel=1e-9)
    law = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)  # V = 2, L = 2
    samples = torch.tensor([[0, 0]] * 40 + [[0, 1]] * 30 + [[1, 0]] * 20 + [[1, 1]] * 10)
    res = script.chi_square(samples, law, 2)
    exp = law * 100
    obs = torch.tensor([40.0, 30, 20, 10], dtype=torch.float64)
    stat = float(((obs - exp) ** 2 / exp).sum())
    assert res["statistic"] == pytest.approx(stat, rel=1e-12)
    assert res["p_value"] == pytest.approx(stats.chi2.sf(stat, 3), rel=1e-9)
