"""The llama-cpp-python OpenAI server on the same model, for `exactspec bench-serve`.

It is the server a CPU user would pick instead of ours, so bench-serve puts it in the same
table when it can: the optional package llama-cpp-python with its server extra's modules
(sse-starlette, starlette-context, pydantic-settings: `pip install 'exactspec[llama-server]'`)
and a GGUF file of the served model (an embedded model's own GGUF, or --model FILE.gguf).
It runs as a subprocess on 127.0.0.1 and a free port, with the same thread count. Note it
decodes one request at a time (no continuous batching): queued requests wait, which its TTFT
at several streams shows (started with --interrupt_requests False: by default a new request
cuts the running one short, which would count as few tokens, not as a slower server).
"""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from exactspec.serve.main import free_port

log = logging.getLogger(__name__)

_SERVER_MODULES = ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")


def llama_server_missing() -> str | None:
    """None when the llama-cpp-python server can run here, else what is missing."""
    missing = [m for m in _SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return (f"llama-cpp-python's server needs {', '.join(missing)} (make llama-cpp; pip "
                "install 'exactspec[llama-server]')")
    return None


def gguf_of(model: str) -> Path | None:
    """The GGUF file of `model` (a .gguf path, or an embedded model shipped as one file)."""
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path
    from exactspec.models import registry

    if model in registry.EMBEDDED:
        chunks = registry.locate_chunks(registry.get(model))
        if len(chunks) == 1:
            return chunks[0]
    return None


class LlamaServer:
    """`python -m llama_cpp.server` on `gguf`, 127.0.0.1, a free port; a context manager."""

    def __init__(self, gguf: Path, *, threads: int, n_ctx: int = 4096,
                 start_timeout: float = 180.0) -> None:
        self.gguf = gguf  # the model file
        self.port = free_port()  # where it listens
        self.url = f"http://127.0.0.1:{self.port}"  # base URL
        self.cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host",
                    "127.0.0.1", "--port", str(self.port), "--n_threads", str(threads),
                    "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
                    # by default a new request cuts the running one short; queue them instead
                    "--interrupt_requests", "False"]
        self.start_timeout = start_timeout  # seconds to wait for /v1/models
        self.proc: subprocess.Popen | None = None  # the server process, once started
        self.log = None  # its output file, once started

    def __enter__(self) -> LlamaServer:
        # its log goes to a file: llama.cpp writes more than a pipe holds, then blocks
        self.log = tempfile.TemporaryFile()  # the server's stdout and stderr
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        end = time.monotonic() + self.start_timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                self.log.seek(0)
                err = self.log.read().decode(errors="replace")[-400:]
                raise RuntimeError(f"the llama.cpp server exited with {self.proc.returncode}: "
                                   f"{err}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"the llama.cpp server did not answer in {self.start_timeout:g} s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if getattr(self, "log", None) is not None:
            self.log.close()
