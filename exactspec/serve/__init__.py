"""The OpenAI-compatible server: `exactspec serve` (docs/serving.md; the README's Server section).

protocol.py     request bodies validated into `RequestSpec` (unknown fields refused by name)
app.py          the FastAPI endpoints over one `ServingEngine`
engine.py       the engine thread: admits requests into the running batch, steps, drops
rows.py         a choice's text and logprobs as it grows
main.py         drafter choice, uvicorn, `BackgroundServer`
metrics.py      Prometheus metrics        replicas.py  `--replicas N` on Ray Serve
bench.py, llama_server.py                 `exactspec bench-serve` (and llama.cpp's server)
"""

from exactspec.serve.app import ServerConfig, create_app
from exactspec.serve.engine import EngineConfig, ServingEngine
from exactspec.serve.main import BackgroundServer, DrafterChoice, build_drafter, serve
from exactspec.serve.protocol import ApiError, RequestSpec, parse_request

__all__ = ["ApiError", "BackgroundServer", "DrafterChoice", "EngineConfig", "RequestSpec",
           "ServerConfig", "ServingEngine", "build_drafter", "create_app", "parse_request",
           "serve"]
