"""Running the server: drafter choice, uvicorn (SIGTERM drains), and a background server.

`serve(...)` is what `exactspec serve` calls: uvicorn handles SIGTERM / SIGINT by closing the
listening socket and waiting for the open requests (running and queued) to finish, then the
app's lifespan stops the engine. `BackgroundServer` runs the same app in a thread of this
process, on 127.0.0.1 and a free port, for tests. `EngineSpec` is what a server in another
process (a Ray replica, `exactspec bench-serve`'s servers) builds for itself: `build_server`.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from dataclasses import Field, dataclass, field, fields, replace

import uvicorn

from exactspec.drafters.base import Drafter
from exactspec.drafters.registry import DRAFTERS, DrafterSpec, build, drafter_flags
from exactspec.errors import InvalidValue
from exactspec.models.loading import Model
from exactspec.serve.app import ServerConfig, create_app
from exactspec.serve.guard import Guard, protocol


@dataclass
class DrafterChoice:
    """Which drafter the server speculates with (at most one field set): the registry's
    spec (what the command line's flags say), or one of the named fields."""

    prompt_lookup: bool = False  # n-gram copies from the context
    draft: str | None = None  # a draft model: embedded name, directory or .gguf
    eagle: str | None = None  # an EAGLE-style head: shipped name or train-draft directory
    quantized_draft: int | None = None  # the target itself, weight-only quantized: 8, 4 or 16
    cross_vocab_draft: str | None = None  # a draft model with another tokenizer (CrossVocabDraft)
    spec: DrafterSpec | None = None  # any drafter of exactspec.drafters.registry, with options

    @classmethod
    def of(cls, spec: DrafterSpec | None) -> DrafterChoice:
        """The choice of a registry spec: its named field when it has one and no options."""
        if spec is None:
            return cls()
        named = _named_fields()
        if spec.name in named and spec == DrafterSpec(spec.name, spec.source):
            return cls(**{named[spec.name].name: True if spec.source is None else spec.source})
        return cls(spec=spec)

    def to_spec(self) -> DrafterSpec | None:
        """The registry's spec of this choice (None: plain decoding)."""
        named = []
        for name, own in _named_fields().items():
            value = getattr(self, own.name)
            if own.default is False:  # a switch (prompt_lookup): given when true, no source
                named += [DrafterSpec(name)] if value else []
            elif value is not None:
                named.append(DrafterSpec(name, value))
        named += [self.spec] if self.spec is not None else []
        if len(named) > 1:
            raise InvalidValue(f"choose at most one drafter: {drafter_flags()}")
        return named[0] if named else None


def _named_fields() -> dict[str, Field]:
    """Registry name -> DrafterChoice's field, for the drafters of the registry that have a
    field of their own (its name with "-" -> "_")."""
    own = {f.name: f for f in fields(DrafterChoice)}
    return {name: own[name.replace("-", "_")] for name in DRAFTERS
            if name.replace("-", "_") in own}


def build_drafter(choice: DrafterChoice, target: Model) -> tuple[Drafter | None, str]:
    """The drafter and its name for reports ("draft:MODEL"); raises InvalidValue for an
    impossible choice."""
    spec = choice.to_spec()
    if spec is None:
        return None, "plain"
    return build(spec, target), spec.name + ("" if spec.source in (None, "") else
                                              f":{spec.source}")


@dataclass
class EngineSpec:
    """What a server in another process builds for itself (sent there, so plain data)."""

    model: str  # es.load's argument: embedded name, transformers directory or .gguf
    drafter: DrafterChoice = field(default_factory=DrafterChoice)  # none: plain decoding
    config: ServerConfig | None = None  # the HTTP and engine settings
    threads: int | None = None  # torch CPU threads (None: torch's default)
    host: str | None = "127.0.0.1"  # where its server listens; None: its node's IP (Ray)
    kv_cache: str = "float32"  # es.load's kv_cache: the target's KV cache
    dtype: str = "float32"  # es.load's dtype: the target's weights


def build_server(spec: EngineSpec) -> tuple[Model, Drafter | None, ServerConfig]:
    """Load the model and build the drafter a spec names, in this process; the config names
    the drafter."""
    import torch

    from exactspec._collector import collector_paused, settle
    from exactspec.models import load

    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    with collector_paused():  # this process serves this model to its end: see _collector.py
        model = load(spec.model, dtype=spec.dtype, kv_cache=spec.kv_cache)
        drafter, name = build_drafter(spec.drafter, model)
        settle()
    config = replace(spec.config or ServerConfig(served_name=spec.model), drafter_name=name)
    return model, drafter, config


def serve(model: Model | None, drafter: Drafter | None, config: ServerConfig, *,
          host: str = "127.0.0.1", port: int = 8000, engine_process: EngineSpec | None = None,
          max_restarts: int = 5) -> None:
    """Serve until SIGTERM / SIGINT, then drain the open requests and return.

    With `engine_process`, `model` and `drafter` are unused: the engine is built from that
    spec in a child process and restarted if it dies (`serve_engine_process`).
    uvicorn re-raises the signal it caught once it has drained; SIGTERM then ends the
    process with exit status 0 (a requested stop, not a crash).
    """
    if engine_process is not None:
        serve_engine_process(replace(engine_process, config=config), host=host, port=port,
                             max_restarts=max_restarts)
        return
    assert model is not None, "serve needs a model or an engine_process spec"
    app = create_app(model, drafter, config)
    signal.signal(signal.SIGTERM, _exit_cleanly)
    uvicorn.Server(uvicorn_config(app, config, host=host, port=port, log_level="info",
                                  timeout_graceful_shutdown=int(config.request_timeout) + 5)
                   ).run()


def serve_engine_process(spec: EngineSpec, *, host: str = "127.0.0.1", port: int = 8000,
                         max_restarts: int = 5) -> None:
    """`serve` with the engine in a child process (`supervisor.EngineSupervisor`): built
    there from `spec`, restarted if it dies; this process answers HTTP and tokenizes.
    RuntimeError if the engine cannot start (the child's reason in the message)."""
    from exactspec.serve.metrics import Metrics
    from exactspec.serve.supervisor import EngineSupervisor

    metrics = Metrics()
    supervisor = EngineSupervisor(spec, metrics, max_restarts=max_restarts)
    info = supervisor.launch()
    config = replace(spec.config or ServerConfig(served_name=spec.model),
                     drafter_name=info.drafter_name)
    app = create_app(info.model(), None, config, engine=supervisor, metrics=metrics,
                     speculative=info.drafter_name != "plain")
    signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        uvicorn.Server(uvicorn_config(app, config, host=host, port=port, log_level="info",
                                      timeout_graceful_shutdown=int(config.request_timeout) + 5)
                       ).run()
    finally:
        supervisor.stop(drain=False, timeout=10)  # a no-op after the lifespan's drain


def uvicorn_config(app, config: ServerConfig, **kw) -> uvicorn.Config:
    """uvicorn's settings for `app` (from `create_app`) under `config.limits`: the app behind
    the `Guard`, the guarded protocol, the keep-alive timeout; `kw` for uvicorn.Config."""
    limits, metrics = config.limits, app.state.metrics
    return uvicorn.Config(Guard(app, limits=limits, metrics=metrics),
                          http=protocol(limits, metrics), timeout_keep_alive=limits.keep_alive,
                          **kw)


def _exit_cleanly(_sig, _frame) -> None:
    raise SystemExit(0)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` (default 127.0.0.1) that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """The app served by uvicorn in a thread of this process, on 127.0.0.1 (or `host`).

    `with BackgroundServer(model, drafter, config) as srv: srv.url` ... On exit the server
    stops accepting, drains, and its thread is joined (bounded by `stop_timeout`).
    """

    def __init__(self, model: Model, drafter: Drafter | None, config: ServerConfig, *,
                 start_timeout: float = 30.0, stop_timeout: float = 30.0,
                 host: str = "127.0.0.1") -> None:
        self.app = create_app(model, drafter, config)
        self.port = free_port(host)  # where it listens
        self.url = f"http://{host}:{self.port}"  # base URL; the OpenAI client takes url + /v1
        cfg = uvicorn_config(self.app, config, host=host, port=self.port, log_level="warning",
                             timeout_graceful_shutdown=int(stop_timeout))
        self.server = uvicorn.Server(cfg)
        self.start_timeout = start_timeout  # seconds to wait for it to listen
        self.stop_timeout = stop_timeout  # seconds to wait for it to drain and stop
        self._thread = threading.Thread(target=self.server.run, name="exactspec-uvicorn",
                                        daemon=True)

    @property
    def engine(self):
        return self.app.state.engine

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        end = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(self.stop_timeout)
