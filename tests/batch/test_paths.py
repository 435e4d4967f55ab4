"""A job's files never overlap (issue 26): no output path (output, errors file, job record) may
be the input or another output, through any spelling, symbolic or hard link; refused with one
line and exit 2 before anything is written, every file left byte for byte as it was."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from exactspec.cli import main
from tests.batch.helpers import prompts, read_output, write_rows

# 10 good rows and 4 bad ones: the input the user lost with `--errors bad.jsonl`
GOOD = [json.dumps(r) for r in prompts(10)]
BAD = ["not json", '{"prompt": "no id"}', '{"id": "x"}', '{"id": "y", "prompt": "p", "top_p": 7}']


@pytest.fixture
def job(tmp_path, monkeypatch) -> Path:
    """tmp_path holding bad.jsonl (10 good rows, 4 bad); the working directory."""
    (tmp_path / "bad.jsonl").write_text("\n".join(GOOD[:5] + BAD + GOOD[5:]) + "\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _snapshot(root: Path) -> dict[str, bytes | str]:
    """Every entry under `root`: a file's bytes, a link's target, a directory's marker."""
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        out[key] = (f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir()
                    else p.read_bytes())
    return out


def _one_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def _refused(job: Path, argv: list[str], capsys, *says: str) -> None:
    before = _snapshot(job)
    assert main(["batch", *argv, "--model", str(job / "no-model-needed"),
                 "--max-new-tokens", "4"]) == 2
    line = _one_line(capsys)
    assert line.startswith("exactspec batch: error: "), line
    for s in says:
        assert s in line, line
    assert _snapshot(job) == before  # nothing written, moved or truncated


def test_errors_file_equal_to_the_input_is_refused_and_the_input_kept(job, capsys):
    """The issue's data loss: `batch bad.jsonl e2.jsonl --errors bad.jsonl` rewrote bad.jsonl
    with the 4 error records, and the 10 good rows were gone."""
    data = (job / "bad.jsonl").read_bytes()
    _refused(job, ["bad.jsonl", "e2.jsonl", "--errors", "bad.jsonl"], capsys,
             "the input 'bad.jsonl' and the errors file 'bad.jsonl' are the same file",
             "nothing was written", "--errors")
    assert (job / "bad.jsonl").read_bytes() == data
    assert not (job / "e2.jsonl").exists() and not (job / "e2.jsonl.job.json").exists()


@pytest.mark.parametrize("spelling", ["./bad.jsonl", "sub/../bad.jsonl", "ABS", "link.jsonl",
                                      "hard.jsonl"])
def test_every_spelling_of_the_input_is_refused_as_the_errors_file(job, capsys, spelling):
    (job / "sub").mkdir()
    (job / "link.jsonl").symlink_to(job / "bad.jsonl")
    os.link(job / "bad.jsonl", job / "hard.jsonl")
    errors = str(job / "bad.jsonl") if spelling == "ABS" else spelling
    _refused(job, ["bad.jsonl", "e2.jsonl", "--errors", errors], capsys, "are the same file")


@pytest.mark.parametrize(("argv", "says"), [
    (["bad.jsonl", "out.jsonl", "--errors", "out.jsonl"],
     "the output 'out.jsonl' and the errors file 'out.jsonl' are the same file"),
    (["bad.jsonl", "out.jsonl", "--errors", "out.jsonl.job.json"],
     "the job record 'out.jsonl.job.json' and the errors file"),
    (["bad.jsonl", "link.jsonl"], "the input 'bad.jsonl' and the output 'link.jsonl'"),
    (["bad.jsonl", "./bad.jsonl"], "are the same file"),
    (["o.jsonl.job.json", "o.jsonl"], "the input 'o.jsonl.job.json' and the job record"),
])
def test_outputs_never_overlap_inputs_or_each_other(job, capsys, argv, says):
    (job / "link.jsonl").symlink_to("bad.jsonl")
    (job / "o.jsonl.job.json").write_text('{"id": 1, "prompt": "a job record?"}\n')
    _refused(job, argv, capsys, says)


@pytest.mark.parametrize(("argv", "says"), [
    (["bad.jsonl", "m.gguf"], "the output 'm.gguf' and the model 'm.gguf'"),
    (["bad.jsonl", "out.jsonl", "--errors", "./m.gguf"], "the errors file 'm.gguf' and the model"),
])
def test_the_model_file_is_an_input_too(job, capsys, argv, says):
    (job / "m.gguf").write_bytes(b"GGUF weights")
    before = _snapshot(job)
    assert main(["batch", *argv, "--model", "m.gguf"]) == 2
    assert says in _one_line(capsys)
    assert _snapshot(job) == before


def test_errors_naming_a_directory_is_one_line(job, capsys):
    (job / "errs").mkdir()
    _refused(job, ["bad.jsonl", "out.jsonl", "--errors", "errs"], capsys,
             "the errors file 'errs' is a directory", "--errors")


def test_errors_in_a_missing_directory_is_one_line(job, capsys):
    _refused(job, ["bad.jsonl", "out.jsonl", "--errors", "no/such/e.jsonl"], capsys,
             "does not exist")


def test_output_naming_a_directory_is_one_line(job, capsys):
    (job / "outdir").mkdir()
    _refused(job, ["bad.jsonl", "outdir"], capsys, "the output 'outdir' is a directory")


def test_a_missing_input_is_a_user_error_not_an_internal_one(job, capsys):
    _refused(job, ["nothere.jsonl", "out.jsonl"], capsys, "no input file 'nothere.jsonl'")


def test_a_refused_resume_leaves_the_errors_file_alone(tiny_dir, job, capsys):
    """The errors file is written only once the output accepted the job: a resume with other
    settings is refused with the errors file (and the output) as they were."""
    argv = ["batch", "bad.jsonl", "out.jsonl", "--model", str(tiny_dir), "--seed", "1",
            "--errors", "e.jsonl"]
    assert main([*argv, "--max-new-tokens", "4"]) == 0, capsys.readouterr().err
    assert len((job / "e.jsonl").read_text().splitlines()) == 4
    assert len(read_output(job / "out.jsonl")) == 10
    capsys.readouterr()
    (job / "e.jsonl").write_text("kept\n")
    before = _snapshot(job)
    assert main([*argv, "--max-new-tokens", "5"]) == 2
    assert "was written with other settings" in _one_line(capsys)
    assert _snapshot(job) == before


def test_distinct_files_still_run(tiny_dir, job, capsys):
    write_rows(job / "in.jsonl", prompts(3))
    assert main(["batch", "in.jsonl", "out.jsonl", "--model", str(tiny_dir), "--seed", "1",
                 "--max-new-tokens", "4", "--errors", "e.jsonl"]) == 0, capsys.readouterr().err
    assert len(read_output(job / "out.jsonl")) == 3 and (job / "e.jsonl").read_text() == ""
