"""Every flag works in every combination, or the combination is refused with one line naming
the flags. Found by auditing each subcommand's flags; each refusal and each repaired
combination has a case here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exactspec.cli import main
from exactspec.training.train import TrainConfig

GEN = ["--no-chat", "--max-new-tokens", "6"]
DRAFTERS = [["--prompt-lookup"], ["--draft", "MODEL"], ["--eagle", "HEAD"]]


@pytest.fixture(scope="module")
def head_dir(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """An (untrained) EAGLE head for the tiny model, as train-draft would write it."""
    from exactspec.drafters.eagle import save_head
    from exactspec.drafters.eagle_head import EagleConfig, EagleHead
    from exactspec.models import load

    path = tmp_path_factory.mktemp("head") / "head"
    save_head(EagleHead(EagleConfig.for_target(load(model_dir).model.config, (1, -1))), path)
    return str(path)


def _argv(argv: list[str], model_dir: str, head_dir: str = "") -> list[str]:
    return [a.replace("MODEL", model_dir).replace("HEAD", head_dir) for a in argv]


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("drafter", DRAFTERS, ids=["lookup", "draft", "eagle"])
def test_greedy_verification_with_a_temperature_is_refused_naming_both(
    drafter, model_dir, head_dir, capsys
) -> None:
    argv = _argv(["generate", "hi", "--model", "MODEL", *drafter, "--verify", "greedy",
                  "--temperature", "0.7", *GEN], model_dir, head_dir)
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert "greedy" in line and "temperature" in line, line
    # the same with --temperature 0 is exact, and runs
    argv[argv.index("0.7")] = "0"
    assert main(argv) == 0


@pytest.mark.parametrize(("flags", "named"), [
    (["--num-draft-tokens", "3"], "--num-draft-tokens"),
    (["--num-draft-tokens", "auto"], "--num-draft-tokens"),
    (["--verify", "block"], "--verify"),
    (["--verify", "greedy", "--temperature", "0.7"], "--verify"),
    (["--compare-plain"], "--compare-plain"),
])
def test_drafting_flags_without_a_drafter_are_refused(flags, named, model_dir, capsys) -> None:
    assert main(["generate", "hi", "--model", model_dir, *flags, *GEN]) == 2
    line = _one_error_line(capsys)
    assert named in line and "only applies with a drafter" in line, line


def test_compare_plain_with_json_reports_both(model_dir, capsys) -> None:
    argv = ["generate", "hi", "--model", model_dir, "--prompt-lookup", "--temperature", "0",
            "--compare-plain", "--json", *GEN]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["stats"]["drafted"] > 0 and got["plain_stats"]["drafted"] == 0
    assert got["plain_stats"]["emitted"] == got["stats"]["emitted"] == 6
    assert got["plain_stats"]["acceptance_rate"] is None
    want = got["stats"]["tokens_per_second"] / got["plain_stats"]["tokens_per_second"]
    assert got["speedup"] == pytest.approx(want)


def test_plain_decoding_is_labelled_plain(model_dir, capsys) -> None:
    assert main(["generate", "hi", "--model", model_dir, "--temperature", "0", *GEN]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"[{model_dir}, plain decoding] ")
    assert "verification" not in last and "acceptance" not in last
    assert main(["generate", "hi", "--model", model_dir, "--json", *GEN]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["drafter"] == "plain" and got["verify"] is None
    assert got["stats"]["acceptance_rate"] is None and got["stats"]["drafted"] == 0
    assert got["stats"]["mean_acceptance_length"] == 1.0


def test_speculative_json_keeps_its_acceptance_rate(model_dir, capsys) -> None:
    argv = ["generate", "hi hi hi hi", "--model", model_dir, "--prompt-lookup", "--verify",
            "block", "--temperature", "0", "--json", *GEN]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["verify"] == "block" and got["drafter"] == "prompt lookup"
    stats = got["stats"]
    assert stats["acceptance_rate"] == pytest.approx(stats["accepted"] / stats["drafted"])


def test_bfloat16_target_with_a_draft_model(model_dir, capsys) -> None:
    argv = ["generate", "hi", "--model", model_dir, "--draft", model_dir, "--dtype", "bfloat16",
            "--temperature", "0", "--json", *GEN]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["stats"]["accepted"] == got["stats"]["drafted"] > 0  # the draft is the target


def test_train_draft_resume_refusals(model_dir, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    argv = ["train-draft", "--model", model_dir, "--out", str(out), "--max-steps", "1",
            "--minutes", "0", "--resume"]
    assert main(argv) == 2
    assert "holds no checkpoint.pt" in _one_error_line(capsys)
    (out / "data").mkdir(parents=True)
    saved = TrainConfig(model=model_dir, minutes=0.0, max_steps=1, replies=2)  # an earlier run
    (out / "train-config.json").write_text(json.dumps(saved.to_json()))
    assert main([*argv[:-1], "--replies", "1"]) == 2
    line = _one_error_line(capsys)
    assert "(replies=2 there, 1 now)" in line and "new --out" in line


def test_bench_draft_layers_beyond_the_model_is_refused(model_dir, tmp_path, capsys) -> None:
    argv = ["bench", "--model", model_dir, "--draft-layers", "3", "--out", str(tmp_path),
            "--no-eagle", "--device", "cpu"]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert "--draft-layers 3 must be in 1..2" in line


@pytest.mark.parametrize(("argv", "named", "needs"), [
    (["batch", "in.jsonl", "out.jsonl", "--num-draft-tokens", "3"], "--num-draft-tokens",
     "a drafter"),
    (["batch", "in.jsonl", "out.jsonl", "--verify", "block"], "--verify", "a drafter"),
    (["batch", "in.jsonl", "out.jsonl", "--workers", "2"], "--workers", "--ray"),
    (["serve", "--num-draft-tokens", "auto"], "--num-draft-tokens", "a drafter"),
    (["audit", "--png", "x.png"], "--png", "--lossy"),
])
def test_other_subcommands_refuse_flags_they_would_ignore(argv, named, needs, capsys) -> None:
    assert main(argv) == 2  # refused before reading any input or loading any model
    line = _one_error_line(capsys)
    assert f"{named} only applies with {needs}" in line, line


@pytest.mark.parametrize(("flag", "value"), [("--modes", "greedy,t2"), ("--workloads", "chitchat")])
def test_bench_unknown_modes_or_workloads_are_refused_before_loading(flag, value, capsys) -> None:
    assert main(["bench", flag, value, "--model", "./not/loaded/because/refused/first"]) == 2
    line = _one_error_line(capsys)
    assert f"{flag}: unknown " in line and "choose from" in line, line
