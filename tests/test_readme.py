"""The README's and docs/*.md's examples run as written (issues 26 and 22), so the docs cannot
drift from the code. README.md is the front page; the topic pages in docs/ (one level, `*.md`)
hold the rest and are checked the same way, README first.

- Every ```python block runs as a script of its own: a fresh namespace (a missing import or
  name fails as in a new file), all blocks in one interpreter to keep the test short (a fresh
  interpreter's lazy names are tested in tests/cli/test_second_contact.py). A block that truly needs
  a long job may opt out with a first line `# not run by tests/test_readme.py: REASON`, shown
  in the page itself (the TRL example in docs/batch_and_rl.md does).
- Every `exactspec ...` command line of the shell blocks (continuation lines joined) is parsed
  by the real argument parser, so a renamed or removed flag fails here. Usage synopses (with
  `[` or `|`) are not commands and are skipped.
- The commands that need no long run are run: `generate` (with `--max-new-tokens 8` unless
  the line sets a budget) and `explain`, except lines naming a placeholder (DRAFT, HEAD, ...);
  `serve` is started by the server example's test (the README's first `exactspec serve`
  line). `batch`, `bench`, `audit`, `train-draft` and `bench-serve` take minutes and are
  parsed only.

The examples use the embedded model (converted once into the model cache, like the other
`slow` tests) and the gemma3 model for the cross-vocabulary example.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))  # the topic pages, checked like the README
NOT_RUN = "# not run by tests/test_readme.py:"
RUN = ("generate", "explain")  # subcommands run; the others are only parsed
PLACEHOLDER = re.compile(r"^(DRAFT|HEAD|MODEL|PROMPT|GGUF|ADDRESS|IN\.jsonl|OUT\.jsonl|RUN|"
                         r"CONFIGS|KEY)$")
SERVER_PORT = "8000"  # the port the README's server example uses; the test serves elsewhere


def fenced_blocks(text: str, name: str = "README.md") -> list[tuple[int, str, str]]:
    """(line number of the opening fence, language, body) of every fenced block of page `name`."""
    out, lang, start, body = [], None, 0, []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip(), number, []
            else:
                out.append((start, lang, "\n".join(body) + "\n"))
                lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{name}: the block opened on line {start} is never closed"
    return out


def command_lines(body: str) -> list[str]:
    """`exactspec ...` commands of a shell block, continuation lines joined, comments cut."""
    joined = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("exactspec "):
            out.append(line)
    return out


def split(line: str) -> list[str] | None:
    """The argv of a command line (after `exactspec`), or None for a usage synopsis."""
    words = shlex.split(line, comments=True)
    if any("[" in w or "|" in w for w in words):
        return None
    return words[1:]


def _where(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# (page:line, language, body) of every fenced block, the README's first
BLOCKS = [(f"{_where(path)}:{n}", lang, body) for path in (README, *DOCS)
          for n, lang, body in fenced_blocks(path.read_text(), _where(path))]
PYTHON = [(where, body) for where, lang, body in BLOCKS if lang == "python"]
COMMANDS = [(where, line) for where, lang, body in BLOCKS if lang in ("bash", "")
            for line in command_lines(body) if split(line) is not None]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "EXACTSPEC_PROGRESS": "0",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}


def test_the_readme_has_examples_to_check():
    assert len(PYTHON) >= 10 and len(COMMANDS) >= 15
    front = [w for w, _ in PYTHON + COMMANDS if w.startswith("README.md:")]
    assert len(front) >= 6, front  # the front page keeps worked examples of its own


LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")  # a Markdown link's target, anchor cut


def test_every_relative_link_resolves():
    """A page moved or renamed in docs/ leaves no dead link in the README or the other pages."""
    dead = [(_where(path), target) for path in (README, *DOCS)
            for target in LINK.findall(path.read_text())
            if "://" not in target and not (path.parent / target).exists()]
    assert not dead, dead


@pytest.mark.parametrize(("number", "line"), COMMANDS, ids=[n for n, _ in COMMANDS])
def test_every_command_line_parses(number, line):
    from exactspec.cli import build_parser
    from exactspec.cli.common import ArgumentError

    try:
        build_parser().parse_args(split(line))
    except (ArgumentError, SystemExit) as exc:
        pytest.fail(f"{number}: {line!r} does not parse: {exc}")


def _runnable(argv: list[str]) -> list[str] | None:
    if argv[0] not in RUN or any(PLACEHOLDER.match(w) for w in argv):
        return None
    if argv[0] == "generate" and "--max-new-tokens" not in argv:
        argv = [*argv, "--max-new-tokens", "8"]
    return argv


@pytest.mark.slow
def test_the_short_commands_run(tmp_path):
    """One interpreter runs them one after another (each loads its model from the cache)."""
    runs = [(n, argv) for n, line in COMMANDS if (argv := _runnable(split(line))) is not None]
    assert len(runs) >= 5
    driver = ("import json, sys, time\nfrom exactspec.cli import main\ncodes = []\n"
              "for argv in json.loads(sys.argv[1]):\n"
              "    start = time.perf_counter()\n"
              "    codes.append(main(argv))\n"
              "    print(f'took {time.perf_counter() - start:.1f} s: {argv}', file=sys.stderr)\n"
              "print('\\nCODES', json.dumps(codes))\n")
    done = subprocess.run([sys.executable, "-c", driver, json.dumps([a for _, a in runs])],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    codes = json.loads(done.stdout.rsplit("CODES", 1)[1]) if "CODES" in done.stdout else None
    print("\n".join(line for line in done.stderr.splitlines() if line.startswith("took ")))
    assert codes is not None, done.stderr[-3000:]
    failed = [(n, a, c) for (n, a), c in zip(runs, codes, strict=True) if c != 0]
    assert not failed, (failed, done.stderr[-3000:])


def _server_block(body: str) -> bool:
    return "base_url=" in body


# Runs every block in one interpreter, each in a fresh namespace (a block that forgets an
# import or a name fails as in a new script; lazy names in a fresh interpreter are tested in
# tests/cli/test_second_contact.py), and prints one JSON line per block: null or the error.
DRIVER = """
import json, sys, time, traceback
for number, body in json.loads(sys.stdin.read()):
    start = time.perf_counter()
    try:
        exec(compile(body, number, "exec"), {"__name__": "__main__"})
        error = None
    except BaseException:
        error = traceback.format_exc()[-4000:]
    print("\\nBLOCK", json.dumps([number, error]), flush=True)  # after a block's own output
    print(f"{number} took {time.perf_counter() - start:.1f} s", file=sys.stderr)
"""


@pytest.fixture(scope="module")
def block_errors(readme_server, tmp_path_factory) -> dict[int, str | None]:
    """page:line -> None if the block ran, else its traceback."""
    todo = [(n, body.replace(f"127.0.0.1:{SERVER_PORT}", f"127.0.0.1:{readme_server}")
             if _server_block(body) else body)
            for n, body in PYTHON if not body.startswith(NOT_RUN)]
    done = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(todo),
                          cwd=tmp_path_factory.mktemp("readme"), env=_env(),
                          capture_output=True, text=True, timeout=1200)
    out = dict(json.loads(line[6:]) for line in done.stdout.splitlines()
               if line.startswith("BLOCK "))
    print("\n".join(line for line in done.stderr.splitlines() if " took " in line))
    return {n: out.get(n, f"not reached: {done.stderr[-3000:]}") for n, _ in todo}


@pytest.mark.slow
@pytest.mark.parametrize(("number", "body"), PYTHON, ids=[n for n, _ in PYTHON])
def test_python_block_runs(number, body, request):
    if body.startswith(NOT_RUN):
        pytest.skip(body.splitlines()[0][len(NOT_RUN):].strip())
    error = request.getfixturevalue("block_errors")[number]
    assert error is None, f"{number}:\n{error}"


@pytest.fixture(scope="module")
def readme_server():
    """The README's `exactspec serve` line (the first of its Server section), on a free port."""
    from exactspec.serve.main import free_port

    line = next(line for _, line in COMMANDS if line.startswith("exactspec serve"))
    port = str(free_port())
    argv = [port if w == SERVER_PORT else w for w in split(line)]
    proc = subprocess.Popen([sys.executable, "-m", "exactspec.cli", *argv], cwd=ROOT,
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end, "the README's server did not start in 300 s"
            time.sleep(0.5)
        yield port
    finally:
        proc.terminate()
        proc.wait(60)
