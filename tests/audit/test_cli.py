"""`exactspec explain` and `exactspec audit`: output and exit codes."""

import re

import pytest

from exactspec import cli
from exactspec.audit.report import AuditCase, AuditConfig, run_case
from exactspec.audit.samplers import Speculative
from exactspec.audit.world import random_world


def test_explain_defaults_to_cat_dog_fish(tmp_path, capsys):
    png = tmp_path / "explain.png"
    assert cli.main(["explain", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    for text in ("cat", "dog", "fish", "P(accept) = sum_x min(p, q) = 0.8",
                 "Z = P(reject) = 1 - P(accept) = sum_x (p - q)+ = 0.2", "every row matches"):
        assert text in out
    assert png.exists()


def test_explain_custom(tmp_path, capsys):
    args = ["explain", "--p", "0.5,0.25,0.25", "--q", "0.25,0.25,0.5", "--labels", "a,b,c",
            "--png", ""]
    assert cli.main(args) == 0
    assert "P(accept) = sum_x min(p, q) = 0.75" in capsys.readouterr().out
    assert not (tmp_path / "explain.png").exists()


@pytest.mark.parametrize("args", [
    ["--p=-0.5,1.5", "--q", "0.5,0.5"],  # negative
    ["--p", "0.5,0.6", "--q", "0.5,0.5"],  # does not sum to 1
    ["--p", "0.5,0.5", "--q", "0.2,0.3,0.5"],  # different lengths
    ["--p", "0.5,0.5"],  # q missing
    ["--p", "0.5,0.5", "--q", "0.5,0.5", "--labels", "a,b,c"],  # labels
])
def test_explain_bad_input_exits_2(args, capsys):
    assert cli.main(["explain", "--png", "", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("exactspec explain: error:") and "\n" not in err


def test_audit_passes(capsys):
    assert cli.main(["audit", "--samples", "20000", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    done, total = re.search(r"(\d+)/(\d+) cases as expected", out).groups()
    assert done == total and int(total) >= 35
    for name in ("resample from p", "|p - q| residual", "temperature mismatch", "unfiltered q",
                 "shared uniforms"):
        line = next(x for x in out.splitlines() if x.startswith(name))
        assert line.rstrip().endswith("caught")
    assert "FAIL" not in out and "MISSED" not in out


def test_audit_exits_1_when_a_pitfall_passes(monkeypatch, capsys):
    """A 'pitfall' that is really the correct sampler is not caught: the audit must fail."""
    cfg = AuditConfig(samples=2000)
    world = random_world(cfg.vocab, cfg.depth, 1)
    fake = AuditCase("not a bug", world, Speculative("token", cfg.num_draft), lossless=False)
    import torch
    row = run_case(fake, cfg, torch.Generator().manual_seed(0))
    assert not row.ok and row.verdict == "MISSED"
    monkeypatch.setattr(cli, "run_audit", lambda cfg: [row])
    assert cli.main(["audit"]) == 1
    assert "MISSED" in capsys.readouterr().out


def test_audit_bad_samples_exits_2():
    assert cli.main(["audit", "--samples", "5"]) == 2
