"""Every command that decodes (generate, serve, batch) takes its drafter flags from one table
(exactspec.drafters.registry): the same flags, the same choices, the same error for the same
bad value, and the same refusal of an ignored combination, before any model is loaded."""

from __future__ import annotations

import argparse

import pytest

from exactspec.cli import build_parser, main
from exactspec.drafters.registry import DRAFTERS

COMMANDS = {"generate": ["generate", "hi"], "serve": ["serve"],
            "batch": ["batch", "in.jsonl", "out.jsonl"]}
SHARED = ("--tree", "--siblings", "--draft-backend", "--draft-layers")


@pytest.mark.parametrize(("argv", "message"), [
    (["--quantized-draft", "5"], "--quantized-draft takes 8 (int8), 4 (int4) or 16"),
    (["--quantized-draft", "eight"], "--quantized-draft takes 8"),
    (["--tree", "3,x"], "branching factors"),
    (["--tree", "3,0"], "branching"),
    (["--tree", "dynamic:x"], "dynamic:BUDGET"),
    (["--siblings", "some"], "invalid choice"),
    (["--draft-layers", "a-b"], "layer indices"),
    (["--draft", "m", "--prompt-lookup"], "not allowed with argument"),
])
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_gives_the_same_error_for_the_same_bad_value(command, argv, message,
                                                                  capsys):
    assert main([*COMMANDS[command], *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_refuses_an_ignored_tree_before_loading_anything(command, capsys):
    argv = [*COMMANDS[command], "--model", "./not/loaded/because/refused/first", "--tree", "2"]
    assert main(argv) == 2
    assert "--tree only applies with" in capsys.readouterr().err


def _actions(command: str) -> dict[str, tuple]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[command]
    keep = {e.flag for e in DRAFTERS.values() if e.flag} | set(SHARED)
    return {a.option_strings[0]: (a.dest, a.nargs, a.const, a.default, a.choices, a.type,
                                  a.metavar, a.help)
            for a in parser._actions if a.option_strings and a.option_strings[0] in keep}


def test_every_command_parser_gets_the_same_drafter_flags():
    reference = _actions("generate")
    assert set(reference) == {e.flag for e in DRAFTERS.values() if e.flag} | set(SHARED)
    for command in ("serve", "batch"):
        assert _actions(command) == reference, command


