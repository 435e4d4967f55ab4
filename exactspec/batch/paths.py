"""The files of a batch job, checked before anything is read into a model or written.

A job reads one input and writes up to three files: the output, its job record
(`OUT.job.json`) and, with `--errors`, the bad rows. Writing any of them over the input, or two
of them over each other, loses data (the input's rows, or samples mixed with error records),
so every pair is compared through any spelling of the path: relative or absolute, `..`,
symbolic links (`os.path.realpath`) and hard links (`os.path.samefile`).
"""

from __future__ import annotations

import os
from itertools import combinations
from pathlib import Path

from exactspec.batch.output import job_file
from exactspec.errors import InvalidValue, MissingFile


def check_job_paths(input: str | os.PathLike, output: str | os.PathLike,
                    errors: str | os.PathLike | None, model: str | None = None) -> None:
    """Raise a UserError (one line: the paths and the fix) unless the job's files are distinct,
    the input is an existing file and every output names a file in an existing directory.
    `model`: the target as named (a .gguf file or a directory is an input too)."""
    inp = Path(input)
    if not inp.exists():
        raise MissingFile(f"no input file {os.fspath(input)!r}: check the path")
    if not inp.is_file():
        raise InvalidValue(f"the input {os.fspath(input)!r} is not a file: name the JSONL of "
                           "prompts")
    out = Path(output)
    files = {"input": inp, "output": out, "job record": job_file(out)}
    if errors is not None:
        files["errors file"] = Path(errors)
    if model is not None and Path(model).expanduser().exists():
        files["model"] = Path(model).expanduser()
    for role, path in files.items():
        if role in ("input", "model"):
            continue
        flag = "--errors" if role == "errors file" else "OUT.jsonl"
        if path.is_dir():
            raise InvalidValue(f"the {role} {os.fspath(path)!r} is a directory: give {flag} a "
                               "file name")
        if role == "errors file" and not path.parent.is_dir():
            raise MissingFile(f"the errors file {os.fspath(path)!r} is in a directory that does "
                              "not exist: create it or choose another --errors path")
    for (a, pa), (b, pb) in combinations(files.items(), 2):
        if {a, b} == {"input", "model"}:
            continue  # two inputs may coincide (nothing is written to either)
        if same_file(pa, pb):
            raise InvalidValue(
                f"the {a} {os.fspath(pa)!r} and the {b} {os.fspath(pb)!r} are the same file; "
                f"nothing was written: {_fix(a, b)}")


def _fix(a: str, b: str) -> str:
    if "errors file" in (a, b):
        return "choose another --errors file (errors=), none of the job's other files"
    return ("choose another output file, not the input or the model (its job record is "
            "OUT.job.json)")


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: the same resolved path (links followed), or, when both
    exist, the same inode (hard links, bind mounts)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False
