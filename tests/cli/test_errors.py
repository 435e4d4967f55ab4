"""User mistakes are one line and exit 2; anything else is an internal error: one line, exit 1,
and the traceback only with --debug. A ValueError from a bug must not pass for bad input."""

from __future__ import annotations

import pytest

import exactspec.audit
from exactspec.cli import main


def _err_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize(("argv", "says"), [
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["generate"], "the following arguments are required: prompt"),
    (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
    (["generate", "hi", "--threads", "zero"], "expected an int >= 1, got 'zero'"),
    (["generate", "hi", "--draft", "m", "--prompt-lookup"], "not allowed with argument"),
    (["generate", "hi", "--dtype", "float16"], "invalid choice: 'float16'"),
    (["bench", "--rounds", "0"], "--rounds: must be >= 1"),
    (["train-draft"], "the following arguments are required: --out"),
])
def test_argparse_errors_are_one_line_exit_2(argv, says, capsys) -> None:
    assert main(argv) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith("exactspec") and ": error: " in line and says in line, line


@pytest.mark.parametrize(("argv", "says"), [
    (["generate", "hi", "--model", "./no/such/dir"], "no such file or directory"),
    (["generate", "hi", "--model", "smollm3"], "unknown model 'smollm3'"),
    (["explain", "--p", "0.5,0.6", "--q", "0.5,0.5", "--png", ""], "sums to 1.1"),
    (["explain", "--png", "/no/such/dir/x.png"], "No such file or directory"),  # matplotlib's
])
def test_user_errors_are_one_line_exit_2(argv, says, capsys) -> None:
    assert main(argv) == 2
    (line,) = _err_lines(capsys)
    command = argv[0]
    assert line.startswith(f"exactspec {command}: error: ") and says in line, line


@pytest.mark.parametrize("bug", [ValueError("boom"), TypeError("boom"), KeyError("boom"),
                                 FileNotFoundError(2, "No such file", "/internal/data.json")])
def test_other_exceptions_are_internal_errors_exit_1(bug, capsys, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise bug

    monkeypatch.setattr(exactspec.audit, "explain", broken)
    assert main(["explain", "--png", ""]) == 1
    (line,) = _err_lines(capsys)
    assert line.startswith(f"exactspec explain: internal error: {type(bug).__name__}: ")
    assert line.endswith("(run with --debug for the traceback)")
    assert "Traceback" not in line


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(where, capsys, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise ValueError("boom")

    monkeypatch.setattr(exactspec.audit, "explain", broken)
    argv = ["--debug", "explain", "--png", ""] if where == "before" else \
        ["explain", "--png", "", "--debug"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and 'raise ValueError("boom")' in err
    assert err.strip().splitlines()[-1].startswith("exactspec explain: internal error: ")
