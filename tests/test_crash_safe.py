"""A test whose native code kills its pytest worker fails alone, and the run goes on
(tests/crash_safe.py), under `make test`'s own flags (-n 2 --dist loadfile)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CRASHING = """
import os, signal
def test_before(): pass
def test_segfault(): os.kill(os.getpid(), signal.SIGSEGV)
def test_after(): pass
"""
PASSING = "def test_one(): pass\ndef test_two(): pass\n"


def _run(tmp_path: Path, plugin: bool) -> str:
    for name, text in [("test_a.py", CRASHING), ("test_b.py", PASSING),
                       ("test_c.py", CRASHING), ("test_d.py", PASSING)]:
        (tmp_path / name).write_text(text)
    (tmp_path / "conftest.py").write_text(
        'pytest_plugins = ["tests.crash_safe"]\n' if plugin else "")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile",
         "-p", "no:cacheprovider", "-p", "no:randomly", "-o", "addopts=", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    return out.stdout + out.stderr


def test_a_crash_fails_its_test_and_every_other_test_runs(tmp_path):
    out = _run(tmp_path, plugin=True)
    assert "2 failed, 8 passed" in out, out[-3000:]
    assert "crashed while running 'test_a.py::test_segfault'" in out
    assert "INTERNALERROR" not in out


def test_without_the_scheduler_a_crash_ends_the_run(tmp_path):
    """The wrong variant, xdist's own loadfile scheduler: the crashed test runs again on every
    replacement worker and the run ends without the rest (or with an INTERNALERROR)."""
    out = _run(tmp_path, plugin=False)
    assert "2 failed, 8 passed" not in out, out[-3000:]
