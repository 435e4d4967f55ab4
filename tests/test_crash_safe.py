"""A test whose native code kills its pytest worker fails alone, and the run goes on
(tests/crash_safe.py), under `make test`'s own flags (-n 2 --dist loadfile)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 60  # seconds for one nested run (a whole one takes ~5-10 s)
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
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile",
         "--max-worker-restart", "4", "-p", "no:cacheprovider", "-p", "no:randomly",
         "-o", "addopts=", str(tmp_path)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        return proc.communicate(timeout=TIMEOUT)[0]
    except subprocess.TimeoutExpired:  # xdist's own scheduler can also hang after the crash
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()[0] + f"\n(timed out after {TIMEOUT} s)"


def test_a_crash_fails_its_test_and_every_other_test_runs(tmp_path):
    out = _run(tmp_path, plugin=True)
    assert "2 failed, 8 passed" in out, out[-3000:]
    assert "crashed while running 'test_a.py::test_segfault'" in out
    assert "INTERNALERROR" not in out


def test_without_the_scheduler_a_crash_ends_the_run(tmp_path):
    """The wrong variant, xdist's own loadfile scheduler: the crashed test runs again on every
    replacement worker and the run ends without the rest, with an INTERNALERROR, or hangs."""
    out = _run(tmp_path, plugin=False)
    assert "2 failed, 8 passed" not in out, out[-3000:]
