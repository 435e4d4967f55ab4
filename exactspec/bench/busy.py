"""`exactspec bench --busy N`: N cores kept busy by other processes while the bench runs.

A user's machine is rarely idle (a laptop, a server with other work, a container with a CPU
quota), and an engine whose threads wait on each other at every operator collapses when one
of them has no core. Each busy process is a plain Python loop in a child process of its own
(no thread of ours), started before the model loads and killed when the bench ends.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

LOOP = "while True:\n    pass\n"


@contextlib.contextmanager
def busy_cores(n: int) -> Iterator[list[subprocess.Popen]]:
    """N busy child processes for the body's duration."""
    procs = [subprocess.Popen([sys.executable, "-c", LOOP], stdin=subprocess.DEVNULL)
             for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)
