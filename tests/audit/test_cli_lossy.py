"""`exactspec audit --lossy`: the table, the PNG and the exit code (a reduced grid)."""

import functools

from exactspec import cli
from exactspec.audit import lossy


def test_audit_lossy_prints_the_table_and_writes_the_plot(tmp_path, capsys, monkeypatch):
    small = functools.partial(lossy.LossyConfig, rules=("lenient:0.4",), model_new_tokens=4)
    monkeypatch.setattr(lossy, "LossyConfig", small)
    png = tmp_path / "drift.png"
    assert cli.main(["audit", "--lossy", "--samples", "1000", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    rules = [words[0] for words in lines if words and words[0] in ("token", "lenient:0.4")]
    assert rules == ["token", "lenient:0.4"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_audit_lossy_refuses_tiny_samples(capsys):
    assert cli.main(["audit", "--lossy", "--samples", "10"]) == 2
    assert "--samples 10 is too small" in capsys.readouterr().err
