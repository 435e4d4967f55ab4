"""drafters/registry.py: one table from a drafter's name and options to its constructor, one set
of drafter flags (tests/cli/test_drafter_flags.py: the same in every command), and drafters
built from flags that decode greedily bit for bit like plain decoding."""

from __future__ import annotations

import argparse

import pytest

from exactspec.drafters import Branching, DynamicTree, PromptLookup, QuantizedDraft, SuffixDrafter
from exactspec.drafters.registry import (
    DRAFTERS,
    DrafterSpec,
    add_drafter_flags,
    build,
    drafter_flags,
    drafter_from_args,
    drafter_spec,
)
from exactspec.engine import generate
from exactspec.errors import InvalidValue
from tests.engine.tiny import GREEDY, GREEDY_PROMPTS, greedy_plain, greedy_target

target, plain = greedy_target, greedy_plain  # the module fixtures of tests/engine/tiny.py
SHARED = ("--tree", "--siblings", "--draft-backend", "--draft-layers")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_drafter_flags(p)
    return p


def _spec(*argv: str) -> DrafterSpec | None:
    return drafter_spec(_parser().parse_args(list(argv)))


def test_every_drafter_with_a_flag_is_a_flag():
    flags = {a.option_strings[0] for a in _parser()._actions if a.option_strings}
    assert {e.flag for e in DRAFTERS.values() if e.flag} | set(SHARED) <= flags
    assert drafter_flags() == ("--draft, --cross-vocab-draft, --prompt-lookup, --eagle, "
                               "--quantized-draft or --gguf-draft")


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


def test_build_by_name(target):
    assert isinstance(build(DrafterSpec("prompt-lookup"), target), PromptLookup)
    tree = build(DrafterSpec("suffix", tree=Branching((2, 1, 1))), target)
    assert isinstance(tree, SuffixDrafter) and (tree.branches, tree.depth, tree.tree_nodes) == (
        2, 3, 6)
    q = build(DrafterSpec("quantized-draft", 4, backend="torch", tree=Branching((2,))), target)
    assert isinstance(q, QuantizedDraft) and (q.bits, q.tree, q.siblings) == (
        4, (2,), "without_replacement")
    with pytest.raises(InvalidValue, match="unknown drafter 'lookup'; choose one of draft, "):
        build(DrafterSpec("lookup"), target)


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
