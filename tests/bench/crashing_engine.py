"""A stand-in third-party engine for the isolation tests: it answers, raises, or kills its own
process with SIGSEGV (as llama.cpp's AMX product did on AMX Xeons)."""

from __future__ import annotations

import os
import signal


class CrashingEngine:
    def __init__(self, crash_on_run: bool) -> None:
        self.crash_on_run = crash_on_run

    def echo(self, x):
        return x

    def fail(self):
        raise KeyError("no such row")

    def segfault(self):
        os.kill(os.getpid(), signal.SIGSEGV)

    def run(self, prompts, mode, max_new_tokens, seed):
        from exactspec.bench.specs import Run

        if self.crash_on_run:
            self.segfault()
        return Run(tokens=1, seconds=1.0, texts=[[0] for _ in prompts])
