"""examples/grpo_exact.py runs, and prints 0 for the mode's largest log p difference at every
step while the ordinary forward's is not 0."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_exact.py"


def test_grpo_example_is_exact(capsys):
    spec = importlib.util.spec_from_file_location("grpo_exact", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--steps", "2", "--group", "2", "--tokens", "8"])
    lines = capsys.readouterr().out.strip().splitlines()[1:]
    assert len(lines) == 2
    for line in lines:
        _, mode, plain, ratio, _, accepted = line.split()
        assert float(mode) == 0.0 and float(ratio) == 0.0
        assert float(plain) > 0.0 and int(accepted) > 0
