"""drafters/registry.py: one table from a drafter's name and options to its constructor (the
command line's flags built from it: tests/cli/test_drafter_flags.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from exactspec.drafters import Branching, PromptLookup, QuantizedDraft, SuffixDrafter
from exactspec.drafters.registry import DRAFTERS, DrafterSpec, build, drafter_flags
from exactspec.errors import InvalidValue
from tests.engine.tiny import greedy_target

target = greedy_target  # the module fixture of tests/engine/tiny.py


def test_the_registry_is_a_table_only():
    """No argparse (the flags are cli/drafter_flags.py's), no bench words (bench/engine_names.py),
    no torch: its imports are the errors and the standard library's."""
    source = (Path(__file__).parents[2] / "exactspec" / "drafters" / "registry.py").read_text()
    top = {n.module if isinstance(n, ast.ImportFrom) else a.name
           for n in ast.parse(source).body if isinstance(n, ast.Import | ast.ImportFrom)
           for a in n.names}
    assert top == {"__future__", "collections.abc", "dataclasses", "exactspec.errors"}


def test_drafter_flags_name_the_drafters_of_each_tree_kind():
    assert drafter_flags() == ("--draft, --cross-vocab-draft, --prompt-lookup, --eagle, "
                               "--quantized-draft or --gguf-draft")
    assert drafter_flags("any+fixed") == "--draft, --eagle, --quantized-draft or --prompt-lookup"
    assert drafter_flags("fixed") == "--prompt-lookup"
    assert [name for name, e in DRAFTERS.items() if e.flag is None] == ["suffix"]


def test_labels_name_the_drafter_and_its_tree():
    assert DrafterSpec("prompt-lookup", tree=Branching((3, 1))).label() == \
        "prompt lookup, 3 branches"
    assert DrafterSpec("draft", "m", tree=Branching((2, 2))).label() == \
        "draft m, tree (2, 2), siblings without_replacement"
    assert DrafterSpec("quantized-draft", 8).label() == "quantized draft 8-bit (auto)"


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
