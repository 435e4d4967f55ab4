"""The OpenAI-compatible server: `exactspec serve` (see the README's Server section)."""

from exactspec.serve.app import ServerConfig, create_app
from exactspec.serve.engine import EngineConfig, ServingEngine
from exactspec.serve.main import BackgroundServer, DrafterChoice, build_drafter, serve
from exactspec.serve.protocol import ApiError, RequestSpec, parse_request

__all__ = ["ApiError", "BackgroundServer", "DrafterChoice", "EngineConfig", "RequestSpec",
           "ServerConfig", "ServingEngine", "build_drafter", "create_app", "parse_request",
           "serve"]
