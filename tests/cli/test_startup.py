"""`import exactspec`, `exactspec --help` and `--version` never import torch (that is what made
`--help` take ~5 s); the lazy top level still exports every public name."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

from tests.cli.conftest import ROOT

# every name `exactspec` exported before it became lazy (others may add more)
EXPORTED = [
    "DraftContext", "DraftModel", "Drafter", "EagleDrafter", "Generation", "GenerationStats",
    "Model", "PromptLookup", "SamplingParams", "TargetInfo", "TextStream", "Verdict",
    "as_model", "generate", "load", "load_drafter", "probs_from_logits", "stream", "verify",
]


def _python(code: str) -> str:
    """Run `code` in a fresh interpreter (a clean sys.modules) and return its stdout."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["generate", "--help"],
                                  ["bench", "--help"], ["train-draft", "--help"],
                                  ["audit", "--help"], ["explain", "--help"]])
def test_help_and_version_leave_torch_unimported(argv: list[str]) -> None:
    out = _python(
        "import sys, contextlib, io\n"
        "import exactspec.cli\n"
        "assert 'torch' not in sys.modules, 'import exactspec.cli imported torch'\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        f"    rc = exactspec.cli.main({argv!r})\n"
        "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
        "print(buf.getvalue())\n")
    status, text = out.split("\n", 1)
    assert status == "0 False False"
    assert ("exactspec 0.1.0" in text) if argv == ["--version"] else ("usage:" in text)


def test_import_is_lazy_but_exports_every_name() -> None:
    assert _python("import sys, exactspec\nprint('torch' in sys.modules)\n").split() == ["False"]
    import exactspec as es
    from exactspec.models import load

    assert [n for n in EXPORTED if n not in es.__all__] == []
    assert [n for n in es.__all__ if getattr(es, n, None) is None] == []  # the table resolves
    assert es.load is load and "load" in dir(es)


def test_unknown_name_is_an_attribute_error() -> None:
    import exactspec

    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        exactspec.nonsense  # noqa: B018


def test_collector_paused_gives_the_caller_back_its_state() -> None:
    from exactspec._collector import collector_paused

    was_on = gc.isenabled()
    try:
        for before in (True, False):
            (gc.enable if before else gc.disable)()
            with collector_paused():
                assert not gc.isenabled()
            assert gc.isenabled() == before
        gc.enable()
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("inside")
        assert gc.isenabled()
    finally:
        (gc.enable if was_on else gc.disable)()


def test_settle_frees_the_garbage_then_freezes_what_lives() -> None:
    from exactspec._collector import settle

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: freed only by a collection
    gone = weakref.ref(a)
    del a, b
    try:
        settle()
        assert gone() is None  # collected, not frozen
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


@pytest.mark.slow
def test_a_command_loads_with_the_collector_paused_then_settles() -> None:
    """exactspec/_collector.py: until the model is loaded no full collection runs but settle's
    own (the collector off), then the modules and the model sit in the permanent generation and
    the collector is on again."""
    out = _python(
        "import contextlib, gc, io\n"
        "import exactspec.cli\n"
        "runs = []\n"
        "def seen(phase, info):\n"
        "    if phase == 'start':\n"
        "        runs.append((info['generation'], gc.isenabled(), gc.get_freeze_count()))\n"
        "gc.callbacks.append(seen)\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    rc = exactspec.cli.main(['generate', '--model', 'smollm2-135m', '--temperature',\n"
        "                             '0', '--max-new-tokens', '2', 'Hello'])\n"
        "full = [on for g, on, frozen in runs if g == 2 and frozen == 0]\n"
        "print(rc, gc.isenabled(), gc.get_freeze_count() > 100_000, full)\n")
    assert out.split("\n")[0] == "0 True True [False]"
