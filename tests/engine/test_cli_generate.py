"""`exactspec generate` on a tiny model saved to a directory: streams text, stats, clean errors."""

from __future__ import annotations

import json

import pytest

from exactspec.cli import main
from tests.engine.tiny import char_tokenizer, tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(0, eos=0).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def other_vocab_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("other")
    tiny_llama(0, vocab=70).save_pretrained(path)
    return str(path)


def test_streams_text_then_one_stats_line(model_dir, capsys):
    rc = main(["generate", "hello", "--model", model_dir, "--no-chat", "--temperature", "0",
               "--max-new-tokens", "12", "--prompt-lookup"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert "prompt lookup" in out[-1] and "tokens/step" in out[-1]


def test_compare_plain_prints_both_speeds(model_dir, capsys):
    rc = main(["generate", "hello", "--model", model_dir, "--no-chat", "--temperature", "0",
               "--max-new-tokens", "12", "--prompt-lookup", "--compare-plain"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert "prompt lookup" in out[-3] and "plain decoding" in out[-2]
    assert out[-1].startswith("speculative ") and "vs plain" in out[-1] and out[-1].endswith("x")


def test_eagle_head_from_a_directory(model_dir, tmp_path, capsys):
    from exactspec.drafters.eagle import save_head
    from exactspec.drafters.eagle_head import EagleConfig, EagleHead
    from exactspec.models import load

    target = load(model_dir).model
    save_head(EagleHead(EagleConfig.for_target(target.config, (1, -1))), tmp_path / "head")
    argv = ["generate", "hello", "--model", model_dir, "--no-chat", "--temperature", "0",
            "--max-new-tokens", "12", "--eagle", str(tmp_path / "head"), "--json"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert main([*argv[:-3], "--json"]) == 0  # the same without a drafter: greedy is greedy
    assert json.loads(capsys.readouterr().out)["token_ids"] == got["token_ids"]
    assert got["drafter"].startswith("eagle") and got["stats"]["drafted"] > 0
    assert main([*argv[:-2], str(tmp_path / "missing")]) == 2


def test_json_matches_the_library(model_dir, capsys):
    from exactspec import SamplingParams
    from exactspec.engine import generate
    from exactspec.models import load

    rc = main(["generate", "hello", "--model", model_dir, "--no-chat", "--seed", "3",
               "--max-new-tokens", "10", "--draft", model_dir, "--num-draft-tokens", "3",
               "--json"])
    got = json.loads(capsys.readouterr().out)
    assert rc == 0
    m = load(model_dir)
    ids = m.encode("hello")
    from exactspec.drafters import DraftModel
    expect = generate(m, [ids], drafter=DraftModel(m), params=SamplingParams(seed=3),
                      max_new_tokens=10, num_draft_tokens=3)[0]
    assert got["token_ids"] == expect.token_ids and got["text"] == expect.text
    assert got["stats"]["steps"] == expect.stats.steps


@pytest.mark.parametrize("argv", [
    ["generate", ""],
    ["generate", "hi", "--model", "no-such-model"],
    ["generate", "hi", "--max-new-tokens", "0"],
    ["generate", "hi", "--temperature", "-1"],
    ["generate", "hi", "--top-p", "0"],
    ["generate", "hi", "--num-draft-tokens", "lots"],
    ["generate", "hi" * 400],  # longer than the tiny model's 512-token context
    ["generate", "hi", "--draft", "OTHER"],  # vocabulary mismatch
    # greedy verification would silently ignore the temperature (issue 11)
    ["generate", "hi", "--prompt-lookup", "--verify", "greedy", "--temperature", "0.7"],
    ["generate", "hi", "--verify", "greedy", "--temperature", "0.7"],
])
def test_bad_input_exits_2_with_one_line(model_dir, other_vocab_dir, argv, capsys):
    argv = [a.replace("OTHER", other_vocab_dir) for a in argv]
    if "--model" not in argv:
        argv += ["--model", model_dir]
    rc = main([*argv, "--no-chat"])
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if line.strip() and "Loading weights" not in line]  # transformers progress bars
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("exactspec generate: error:")


def test_a_lossy_rule_prints_a_warning_and_is_flagged(model_dir, capsys):
    base = ["generate", "hello", "--model", model_dir, "--no-chat", "--temperature", "1",
            "--seed", "0", "--max-new-tokens", "8", "--prompt-lookup", "--json"]
    assert main([*base, "--verify", "lenient:0.5"]) == 0
    cap = capsys.readouterr()
    assert "warning: --verify lenient:0.5 is a lossy rule" in cap.err
    assert json.loads(cap.out)["lossless"] is False
    assert main([*base, "--verify", "token"]) == 0  # an exact rule: no warning, flagged exact
    cap = capsys.readouterr()
    assert "warning" not in cap.err and json.loads(cap.out)["lossless"] is True
    assert main([*base, "--verify", "lenient:2"]) == 2  # out of range: one line, exit 2
    assert "lenient" in capsys.readouterr().err
