"""The FastAPI app: OpenAI's chat and text completion endpoints over one `ServingEngine`.

Every error is answered with OpenAI's body {"error": {"message", "type", "param", "code"}}:
400 for a bad field (named in `param`; nothing reaches the engine), 401 without the API key,
404 for another model, 429 when the queue is full (with Retry-After), 503 while shutting
down or while the engine process restarts, 504 when a request runs past its timeout, 500 when
decoding fails (that request only; the server keeps serving). A client that disconnects
cancels its request. The limits on bodies, connections and time (413, 408, 503) are
`guard.py`'s; request bodies are parsed and tokenized in a worker thread, so /health and
/metrics answer while a long prompt is prepared.
Under an opt-in lossy verify rule (`--verify lenient:L` / `typical:EPS`) every completion says
so where an OpenAI client sees it without a schema change: `"lossless": false` (and `"verify"`)
in the response's `exactspec` object (streams: the last chunk's) and the header
`X-Exactspec-Lossless: false` (`"true"` otherwise), also on /v1/models.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from exactspec.drafters.base import Drafter
from exactspec.engine.arguments import parse_verify
from exactspec.engine.verifier import UserRule
from exactspec.models.loading import Model
from exactspec.serve.answers import Answer, collect, error_response, sse
from exactspec.serve.engine import EngineConfig, ServingEngine
from exactspec.serve.guard import Limits
from exactspec.serve.metrics import Metrics
from exactspec.serve.protocol import ApiError, bad, parse_request, prompt_byte_limit
from exactspec.serve.tokens import detokenize, tokenize

log = logging.getLogger(__name__)

PREPARE_THREADS = 2  # worker threads that parse and tokenize request bodies


@dataclass
class ServerConfig:
    """What the HTTP layer needs besides the model."""

    served_name: str  # the model id clients send and /v1/models lists
    api_key: str | None = None  # when set, every endpoint but /health needs "Bearer KEY"
    request_timeout: float = 600.0  # seconds from arrival to the last token; then 504
    max_tokens_cap: int = 1024  # chat default max_tokens: the context left, at most this
    drafter_name: str = "plain"  # reported in responses and /v1/models
    engine: EngineConfig = field(default_factory=EngineConfig)  # batching and drafting
    limits: Limits = field(default_factory=Limits)  # body size, read timeout, connections


def create_app(model: Model, drafter: Drafter | None, config: ServerConfig, *,
               engine=None, metrics: Metrics | None = None,
               speculative: bool | None = None) -> FastAPI:
    """The app; its engine starts with the app's lifespan and drains when it ends.

    `engine` (default: a `ServingEngine` thread over `model` and `drafter`) may be an
    `EngineSupervisor` (the engine in a child process; `model` then only tokenizes, and
    `speculative` says whether that engine has a drafter).
    """
    metrics = metrics or Metrics()
    if engine is None:
        engine = ServingEngine(model, drafter, config.engine, metrics)
    prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="exactspec-prepare")
    max_prompt_bytes = prompt_byte_limit(model)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop, drain=True, timeout=config.request_timeout)
        prepare_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="exactspec", lifespan=lifespan)
    app.state.engine = engine  # for tests and embedding: pause / resume / stop
    app.state.metrics = metrics
    created = int(time.time())
    speculative = drafter is not None if speculative is None else speculative
    verify = config.engine.verify  # reported by name; a callable (tests) by its function's name
    method = parse_verify(verify)  # a method, or a callable as a UserRule (not lossless)
    lossless = not speculative or method.lossless  # False: opt-in lossy rule or a callable
    verify_name = (getattr(method.fn, "__name__", "callable") if isinstance(method, UserRule)
                   else str(verify))  # a method (or its name)
    lossless_header = {"X-Exactspec-Lossless": "true" if lossless else "false"}
    greedy_only = method.greedy_only  # exact at T = 0 only

    if config.api_key is not None:
        app.add_middleware(_ApiKey, key=config.api_key, metrics=metrics)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, exc: HTTPException):
        return error_response(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception):  # logged once, by the Guard
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                                       type="internal_server_error", code="internal_error"))

    @app.get("/health")
    async def health():
        state, detail = engine.health()
        body = {"status": state, "model": config.served_name}
        if state == "ok":
            return body
        return Response(json.dumps({**body, "detail": detail}), status_code=503,
                        media_type="application/json")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": config.served_name, "object": "model", "created": created,
            "owned_by": "exactspec", "max_model_len": model.max_context,
            "drafter": config.drafter_name, "verify": verify_name, "lossless": lossless}]}

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str):
        if model_id != config.served_name:
            return error_response(ApiError(
                404, f"the model {model_id!r} does not exist; this server serves "
                f"{config.served_name!r}", param="model", code="model_not_found"))
        return (await models())["data"][0]

    async def in_pool(request: Request, work) -> Response:
        """A JSON body handled by `work(body)` in the prepare pool; errors as OpenAI's."""
        try:
            raw = await request.body()
            loop = asyncio.get_running_loop()
            return JSONResponse(await loop.run_in_executor(prepare_pool, lambda: work(
                _json(raw))))
        except ApiError as exc:
            if exc.status == 400:
                metrics.count("rejected", "invalid_request")
            return error_response(exc)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await in_pool(request, lambda body: tokenize(body, model, config.served_name,
                                                            max_prompt_bytes))

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await in_pool(request, lambda body: detokenize(body, model, config.served_name))

    @app.get("/metrics")
    async def prometheus():
        text = await engine.render_metrics(metrics)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def prepare(raw: bytes, kind: str):
        """The request body parsed and tokenized (in a worker thread)."""
        body = _json(raw)
        spec = parse_request(body, kind, model, config.served_name, config.max_tokens_cap,
                             max_prompt_bytes=max_prompt_bytes)
        if greedy_only and not spec.params.is_greedy:
            raise bad(f"temperature={spec.params.temperature}: this server verifies "
                      "greedily (--verify greedy), which is the target's law only at "
                      "temperature 0; send temperature=0", "temperature")
        return spec

    async def complete(request: Request, kind: str) -> Response:
        try:
            raw = await request.body()
            loop = asyncio.get_running_loop()
            spec = await loop.run_in_executor(prepare_pool, prepare, raw, kind)
            sub = await engine.enqueue(spec, loop)
        except ApiError as exc:
            if exc.status == 400:
                metrics.count("rejected", "invalid_request")
            return error_response(exc)
        deadline = sub.submitted + config.request_timeout
        answer = Answer(spec, kind, config, sub, lossless, verify_name)
        if spec.stream:
            return StreamingResponse(sse(answer, deadline), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **lossless_header})
        response = await collect(request, answer, deadline)
        response.headers.update(lossless_header)
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, "text")

    return app


def _json(raw: bytes) -> object:
    """A request body decoded; 400 if it is no JSON (or nests too deeply to parse)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise bad("the request body nests JSON too deeply to parse; send a flatter "
                  "object", None) from None
    except ValueError:
        raise bad("the request body is not valid JSON", None) from None


class _ApiKey:
    """ASGI middleware: every path but /health needs 'Authorization: Bearer KEY' (else 401).

    The scheme is matched in any case (RFC 7235 section 2.1: "bearer" works), the key byte for
    byte in constant time. Plain ASGI rather than `@app.middleware`, which would hide client
    disconnects from the handlers behind it.
    """

    def __init__(self, app, *, key: str, metrics: Metrics) -> None:
        self.app, self.key, self.metrics = app, key.encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.strip().partition(b" ")
            right_key = hmac.compare_digest(token.strip(), self.key)  # always compared
            if not (right_key and scheme.lower() == b"bearer"):
                self.metrics.count("rejected", "unauthorized")
                response = error_response(ApiError(
                    401, "missing or wrong API key: send the header 'Authorization: Bearer "
                    "KEY'", code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
