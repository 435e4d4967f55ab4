"""CLI tests: tiny models saved to directories (no downloads), run in-process or as subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.tiny import char_tokenizer, tiny_llama
from tests.threads import one_thread as _one_thread  # noqa: F401  (autouse fixture)

ROOT = Path(__file__).resolve().parents[2]  # the repository: subprocesses import exactspec here


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama (EOS = id 0) with the character tokenizer, saved as a model directory."""
    path = tmp_path_factory.mktemp("tiny-cli")
    tiny_llama(0, eos=0).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="package")
def endless_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama with no EOS at all and a long context: generations run until interrupted."""
    path = tmp_path_factory.mktemp("tiny-endless")
    tiny_llama(0, max_pos=1 << 20).save_pretrained(path)
    tok = char_tokenizer()
    tok.eos_token = None  # else its <eos> (id 0) would end the generation
    tok.save_pretrained(path)
    return str(path)


def exactspec_process(*args: str, **kw) -> subprocess.Popen:
    """`python -m exactspec.cli ARGS` from the repository, one torch thread, pipes for output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("EXACTSPEC_PROGRESS", None)
    # SIGINT as a terminal gives it: a harness started in the background (a non-interactive
    # shell's `&`) passes it on ignored, and Python then installs no KeyboardInterrupt handler
    kw.setdefault("preexec_fn", lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return subprocess.Popen([sys.executable, "-m", "exactspec.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
