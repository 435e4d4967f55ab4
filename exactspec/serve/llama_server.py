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
import sys
from pathlib import Path

from exactspec.serve.process import ServerProcess

log = logging.getLogger(__name__)

_SERVER_MODULES = ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")


def llama_server_missing() -> str | None:
    """None when the llama-cpp-python server can run here, else what is missing or why its
    build is not used (it failed the smoke test on this machine)."""
    missing = [m for m in _SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return (f"llama-cpp-python's server needs {', '.join(missing)} (make llama-cpp; pip "
                "install 'exactspec[llama-server]')")
    from exactspec.drafters.gguf_draft import llama_cpp_available, llama_cpp_why

    if not llama_cpp_available():  # its build crashed the smoke test here (llama_cpp_check)
        return llama_cpp_why()
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


class LlamaServer(ServerProcess):
    """`python -m llama_cpp.server` on `gguf`, 127.0.0.1, a free port; a context manager."""

    name = "llama.cpp server"
    health = "/v1/models"

    def __init__(self, gguf: Path, *, threads: int, n_ctx: int = 4096,
                 start_timeout: float = 180.0) -> None:
        super().__init__(start_timeout=start_timeout, stop_timeout=30.0)
        self.gguf = gguf  # the model file
        self.cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host",
                    "127.0.0.1", "--port", str(self.port), "--n_threads", str(threads),
                    "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
                    # by default a new request cuts the running one short; queue them instead
                    "--interrupt_requests", "False"]

    def command(self) -> list[str]:
        return self.cmd
