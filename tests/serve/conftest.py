"""Server tests: a real uvicorn server on 127.0.0.1 (a free port) in a thread of the test process,
over tiny random models built from a config (no downloads); tiny models run single-threaded."""

from __future__ import annotations

import pytest

from exactspec.serve import BackgroundServer, EngineConfig, ServerConfig
from tests.engine.tiny import tiny_model
from tests.threads import one_thread as _one_thread  # noqa: F401  (autouse fixture)

openai = pytest.importorskip("openai")

NAME = "tiny"  # the served model id


def client(server: BackgroundServer, **kw):
    """The official OpenAI client for `server`: no retries (a 429 must reach the test)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "unused"),
                         max_retries=0, timeout=kw.pop("timeout", 60.0), **kw)


def start(model, drafter=None, **kw) -> BackgroundServer:
    """A server over `model`: ServerConfig fields as keywords, EngineConfig ones via `engine`."""
    engine = kw.pop("engine", {})
    config = ServerConfig(served_name=NAME, engine=EngineConfig(**engine), **kw)
    return BackgroundServer(model, drafter, config, stop_timeout=20.0)


@pytest.fixture(scope="package")
def tiny():
    """A 2-layer Llama over a 49-symbol character tokenizer; EOS = id 0."""
    return tiny_model(0, eos=0)


@pytest.fixture(scope="package")
def server(tiny):
    with start(tiny, engine={"max_batch": 64, "max_queue": 256}) as srv:
        yield srv
