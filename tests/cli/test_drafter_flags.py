"""Every command that decodes (generate, serve, batch) takes its drafter flags from one place
(cli/drafter_flags.py, over the table of drafters/registry.py): the same flags, the same
choices, the same error for the same bad value, and the same refusal of an ignored combination,
before any model is loaded; the flags become one DrafterSpec, and the drafters built from flags
decode greedily bit for bit like plain decoding."""

from __future__ import annotations

import argparse

import pytest

from exactspec.cli import build_parser, main
from exactspec.cli.drafter_flags import add_drafter_flags, drafter_from_args, drafter_spec
from exactspec.drafters import Branching, DynamicTree
from exactspec.drafters.registry import DRAFTERS, DrafterSpec
from exactspec.engine import generate
from exactspec.errors import InvalidValue
from tests.engine.tiny import GREEDY, GREEDY_PROMPTS, greedy_plain, greedy_target

COMMANDS = {"generate": ["generate", "hi"], "serve": ["serve"],
            "batch": ["batch", "in.jsonl", "out.jsonl"]}
SHARED = ("--tree", "--siblings", "--draft-backend", "--draft-layers")
target, plain = greedy_target, greedy_plain  # the module fixtures of tests/engine/tiny.py


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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_drafter_flags(p)
    return p


def _spec(*argv: str) -> DrafterSpec | None:
    return drafter_spec(_parser().parse_args(list(argv)))


def test_every_drafter_with_a_flag_is_a_flag():
    flags = {a.option_strings[0] for a in _parser()._actions if a.option_strings}
    assert {e.flag for e in DRAFTERS.values() if e.flag} | set(SHARED) <= flags


def test_flags_become_one_spec():
    assert _spec() is None
    assert _spec("--quantized-draft") == DrafterSpec("quantized-draft", 8)  # bare: 8 bits
    s = _spec("--quantized-draft", "4", "--draft-backend", "torch", "--draft-layers", "0-2,5",
              "--tree", "dynamic:8", "--siblings", "iid")
    assert (s.source, s.backend, s.layers, s.tree, s.siblings) == (
        4, "torch", (0, 1, 2, 5), DynamicTree(8), "iid")
    assert _spec("--eagle").source == "smollm2-135m" and _spec("--gguf-draft").source == ""
    lookup = _spec("--prompt-lookup", "--tree", "3,1")
    assert lookup.source is None and type(lookup.tree) is Branching
    assert lookup.label() == "prompt lookup, 3 branches"
    assert _spec("--draft", "m", "--tree", "2,2").label() == \
        "draft m, tree (2, 2), siblings without_replacement"


@pytest.mark.parametrize(("argv", "message"), [
    (["--tree", "2,2"], "--tree only applies with --draft, --eagle, --quantized-draft or "
                        "--prompt-lookup"),
    (["--cross-vocab-draft", "m", "--tree", "2"], "--tree only applies with"),
    (["--draft", "m", "--siblings", "iid"], "--siblings only applies with --tree"),
    (["--prompt-lookup", "--tree", "dynamic:8"], "--prompt-lookup drafts fixed trees only"),
    (["--prompt-lookup", "--tree", "2,1", "--siblings", "iid"], "--siblings does not apply"),
    (["--quantized-draft", "--tree", "2", "--draft-backend", "llama.cpp"], "chains only"),
    (["--draft", "m", "--draft-backend", "torch"], "--draft-backend only applies with "
                                                   "--quantized-draft"),
    (["--draft-layers", "1"], "--draft-layers only applies with --quantized-draft"),
])
def test_ignored_combinations_are_refused_by_name(argv, message):
    with pytest.raises(InvalidValue, match=message.replace("(", r"\(")):
        _spec(*argv)


@pytest.mark.parametrize("argv", [
    ["--prompt-lookup"],
    ["--prompt-lookup", "--tree", "2,1,1"],
    ["--quantized-draft", "8", "--draft-backend", "torch"],
    ["--quantized-draft", "--tree", "2,2", "--siblings", "deterministic"],
    ["--quantized-draft", "8", "--tree", "dynamic:6:2:3"],
])
def test_drafters_from_flags_decode_greedily_like_plain(target, plain, argv):
    drafter, spec = drafter_from_args(_parser().parse_args(argv), target)
    assert spec.label(drafter)
    got = generate(target, GREEDY_PROMPTS, drafter=drafter, params=GREEDY, max_new_tokens=40)
    assert [g.token_ids for g in got] == plain
    assert sum(g.stats.drafted for g in got) > 0


def test_the_quantized_flags_take_what_the_drafter_takes():
    """--quantized-draft's bits and --draft-backend's choices are QuantizedDraft's own
    (drafters/quantized_formats.py), the drafter built from each."""
    from exactspec.drafters import QuantizedDraft
    from exactspec.drafters.quantized_formats import BACKENDS, BITS

    for bits in BITS:
        spec = _spec("--quantized-draft", str(bits), "--draft-backend", "torch")
        assert spec.source == bits and QuantizedDraft(spec.source, backend=spec.backend).bits == bits
    backend = next(a for a in _parser()._actions if a.option_strings == ["--draft-backend"])
    assert tuple(backend.choices) == BACKENDS
