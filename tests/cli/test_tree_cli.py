"""`exactspec generate --tree B1,B2,..`: token trees from the command line."""

from __future__ import annotations

import json

import pytest

from exactspec.cli import main

GEN = ["--no-chat", "--max-new-tokens", "8", "--temperature", "0", "--json"]


@pytest.mark.parametrize(("drafter", "verify"), [(["--prompt-lookup"], "traversal"),
                                                 (["--draft", "MODEL"], "token")])
def test_tree_flag_drafts_trees_and_keeps_greedy_text(model_dir, capsys, drafter, verify):
    drafter = [model_dir if a == "MODEL" else a for a in drafter]
    assert main(["generate", "hi hi hi hi", "--model", model_dir, *GEN]) == 0
    plain = json.loads(capsys.readouterr().out)
    argv = ["generate", "hi hi hi hi", "--model", model_dir, *drafter, "--tree", "2,2",
            "--verify", verify, *GEN]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == plain["token_ids"] and got["verify"] == verify
    assert "tree" in got["drafter"] or "branches" in got["drafter"]


def test_tree_needs_a_tree_drafter(model_dir, capsys):
    assert main(["generate", "hi", "--model", model_dir, "--tree", "2,2", *GEN]) == 2
    assert "--tree only applies with --draft or --prompt-lookup" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", model_dir, "--prompt-lookup", "--tree", "2,0",
                 *GEN]) == 2
