"""A stand-in for llama.cpp in the smoke test's child process: it "decodes" every batch, and
kills its own process with SIGSEGV on a batch of EXACTSPEC_STANDIN_CRASH_AT tokens or more of
a type in EXACTSPEC_STANDIN_CRASH_TYPES (as llama.cpp 0.3.36's AMX product does on AMX Xeons),
so the defence is tested on every machine, AMX or not."""

from __future__ import annotations

import os
import signal
from pathlib import Path


class CrashingLlama:
    def __init__(self, workdir: str) -> None:
        self.at = int(os.environ.get("EXACTSPEC_STANDIN_CRASH_AT", "0") or 0)  # 0: never
        self.types = os.environ.get("EXACTSPEC_STANDIN_CRASH_TYPES", "q8_0,q4_0").split(",")
        self.workdir = Path(workdir)

    def gguf(self, qtype: str) -> Path:
        return self.workdir / f"{qtype}.gguf"

    def decode(self, path: Path, tokens: int) -> None:
        if self.at and tokens >= self.at and path.stem in self.types:
            os.kill(os.getpid(), signal.SIGSEGV)
