"""`exactspec bench --busy N`: N busy child processes while the bench runs, gone after."""

from __future__ import annotations

import time

from exactspec.bench.busy import busy_cores
from exactspec.cli import build_parser


def test_busy_processes_spin_while_inside_and_are_gone_after():
    with busy_cores(2) as procs:
        time.sleep(0.3)
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.returncode is not None for p in procs)
    with busy_cores(0) as none:
        assert none == []


def test_the_flag():
    assert build_parser().parse_args(["bench", "--busy", "1"]).busy == 1
    assert build_parser().parse_args(["bench"]).busy == 0
