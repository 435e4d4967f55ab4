"""`exactspec generate --tree B1,B2,.. | dynamic:N`: token trees from the command line."""

from __future__ import annotations

import json

import pytest

from exactspec.cli import main
from exactspec.drafters.eagle import save_head
from tests.drafters.test_eagle import make_head
from tests.engine.tiny import tiny_llama

GEN = ["--no-chat", "--max-new-tokens", "8", "--temperature", "0", "--json"]


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory) -> str:
    """A random (sharpened) EAGLE head for the CLI's tiny model, as train-draft writes it."""
    path = tmp_path_factory.mktemp("head")
    save_head(make_head(tiny_llama(0, eos=0)), path)
    return str(path)


@pytest.mark.parametrize(("drafter", "tree", "verify"), [
    (["--prompt-lookup"], "2,2", "traversal"),
    (["--draft", "MODEL"], "2,2", "token"),
    (["--draft", "MODEL"], "dynamic:8:2:4", "token"),
    (["--eagle", "HEAD"], "2,2", "traversal"),
    (["--eagle", "HEAD", "--siblings", "deterministic"], "dynamic:8", "traversal"),
    (["--quantized-draft", "8"], "3,1", "token"),
    (["--quantized-draft", "8", "--draft-backend", "torch"], "dynamic:6:3:3", "greedy"),
])
def test_tree_flag_drafts_trees_and_keeps_greedy_text(model_dir, head_dir, capsys, drafter,
                                                      tree, verify):
    drafter = [{"MODEL": model_dir, "HEAD": head_dir}.get(a, a) for a in drafter]
    assert main(["generate", "hi hi hi hi", "--model", model_dir, *GEN]) == 0
    plain = json.loads(capsys.readouterr().out)
    argv = ["generate", "hi hi hi hi", "--model", model_dir, *drafter, "--tree", tree,
            "--verify", verify, *GEN]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == plain["token_ids"] and got["verify"] == verify
    assert "tree" in got["drafter"] or "branches" in got["drafter"]


def test_tree_needs_a_tree_drafter(model_dir, capsys):
    assert main(["generate", "hi", "--model", model_dir, "--tree", "2,2", *GEN]) == 2
    assert "--tree only applies with --draft, --eagle, --quantized-draft or --prompt-lookup" \
        in capsys.readouterr().err
    assert main(["generate", "hi", "--model", model_dir, "--prompt-lookup", "--tree", "2,0",
                 *GEN]) == 2


@pytest.mark.parametrize(("extra", "message"), [
    (["--quantized-draft", "8", "--draft-backend", "llama.cpp", "--tree", "2,2"],
     "--draft-backend llama.cpp drafts chains only"),
    (["--prompt-lookup", "--tree", "dynamic:8"], "--prompt-lookup drafts fixed trees only"),
    (["--prompt-lookup", "--tree", "2,2", "--siblings", "iid"], "--siblings does not apply"),
    (["--draft", "MODEL", "--siblings", "iid"], "--siblings only applies with --tree"),
    (["--draft", "MODEL", "--tree", "dynamic:0"], "node_budget=0 must be >= 1"),
    (["--draft", "MODEL", "--tree", "dynamic:16", "--verify", "traversal", "--temperature",
      "1"], "verify='traversal' is proven for trees whose shape is fixed"),
])
def test_tree_refusals_are_one_clear_line(model_dir, capsys, extra, message):
    extra = [model_dir if a == "MODEL" else a for a in extra]
    argv = ["generate", "hi", "--model", model_dir, "--no-chat", "--max-new-tokens", "4", *extra]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines()
           if line.strip() and "Loading weights" not in line]
    assert len(err) == 1 and message in err[0], err
