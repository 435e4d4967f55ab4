"""The FastAPI app: OpenAI's chat and text completion endpoints over one `ServingEngine`.

Every error is answered with OpenAI's body {"error": {"message", "type", "param", "code"}}:
400 for a bad field (named in `param`; nothing reaches the engine), 401 without the API key,
404 for another model, 429 when the queue is full (with Retry-After), 503 while shutting
down, 504 when a request runs past its timeout, 500 when decoding fails (that request only;
the server keeps serving). A client that disconnects cancels its request.
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
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from exactspec.drafters.base import Drafter
from exactspec.engine.results import GenerationStats
from exactspec.models.loading import Model
from exactspec.sampling import is_lossless, parse_method
from exactspec.serve.engine import Delta, EngineConfig, Failed, Finished, ServingEngine, Submission
from exactspec.serve.metrics import Metrics
from exactspec.serve.protocol import ApiError, RequestSpec, bad, parse_request
from exactspec.serve.rows import token_strings

log = logging.getLogger(__name__)

_POLL_SECONDS = 0.25  # how often a waiting non-streaming handler checks for a disconnect


@dataclass
class ServerConfig:
    """What the HTTP layer needs besides the model."""

    served_name: str  # the model id clients send and /v1/models lists
    api_key: str | None = None  # when set, every endpoint but /health needs "Bearer KEY"
    request_timeout: float = 600.0  # seconds from arrival to the last token; then 504
    max_tokens_cap: int = 1024  # chat default max_tokens: the context left, at most this
    drafter_name: str = "plain"  # reported in responses and /v1/models
    engine: EngineConfig = field(default_factory=EngineConfig)  # batching and drafting


def create_app(model: Model, drafter: Drafter | None, config: ServerConfig) -> FastAPI:
    """The app; its engine thread starts with the app's lifespan and drains when it ends."""
    metrics = Metrics()
    engine = ServingEngine(model, drafter, config.engine, metrics)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop, drain=True, timeout=config.request_timeout)

    app = FastAPI(title="exactspec", lifespan=lifespan)
    app.state.engine = engine  # for tests and embedding: pause / resume / stop
    app.state.metrics = metrics
    created = int(time.time())
    lossless = drafter is None or is_lossless(config.engine.verify)  # False: an opt-in lossy rule
    verify = config.engine.verify  # reported by name; a callable (tests) by its function's name
    verify_name = (str(verify) if not callable(verify)  # a method (or its name)
                   else getattr(verify, "__name__", "callable"))
    lossless_header = {"X-Exactspec-Lossless": "true" if lossless else "false"}
    greedy_only = not callable(verify) and parse_method(verify).greedy_only  # T = 0 only

    if config.api_key is not None:
        app.add_middleware(_ApiKey, key=config.api_key, metrics=metrics)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, exc: HTTPException):
        return _error(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception):
        log.exception("internal error")
        return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                               type="internal_server_error", code="internal_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": config.served_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": config.served_name, "object": "model", "created": created,
            "owned_by": "exactspec", "max_model_len": model.max_context,
            "drafter": config.drafter_name, "verify": verify_name, "lossless": lossless}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    async def complete(request: Request, kind: str) -> Response:
        try:
            try:
                body = json.loads(await request.body())
            except ValueError:
                raise bad("the request body is not valid JSON", None) from None
            spec = parse_request(body, kind, model, config.served_name, config.max_tokens_cap)
            if greedy_only and not spec.params.is_greedy:
                raise bad(f"temperature={spec.params.temperature}: this server verifies "
                          "greedily (--verify greedy), which is the target's law only at "
                          "temperature 0; send temperature=0", "temperature")
            sub = engine.submit(spec, asyncio.get_running_loop())
        except ApiError as exc:
            if exc.status == 400:
                metrics.count("rejected", "invalid_request")
            return _error(exc)
        deadline = sub.submitted + config.request_timeout
        answer = _Answer(spec, kind, config, sub, lossless, verify_name)
        if spec.stream:
            return StreamingResponse(_sse(answer, deadline), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **lossless_header})
        response = await _collect(request, answer, deadline)
        response.headers.update(lossless_header)
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, "text")

    return app


class _ApiKey:
    """ASGI middleware: every path but /health needs 'Authorization: Bearer KEY' (else 401).

    Plain ASGI rather than `@app.middleware`, which would hide client disconnects from the
    handlers behind it.
    """

    def __init__(self, app, *, key: str, metrics: Metrics) -> None:
        self.app, self.expected, self.metrics = app, f"Bearer {key}".encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                self.metrics.count("rejected", "unauthorized")
                response = _error(ApiError(401, "missing or wrong API key: send the header "
                                           "'Authorization: Bearer KEY'", code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _timeout_error(spec: RequestSpec, timeout: float) -> ApiError:
    return ApiError(504, f"the request ran past the server's timeout of {timeout:g} s; ask for "
                    f"fewer tokens (max_tokens={spec.max_tokens})", type="timeout_error",
                    code="request_timeout")


class _Answer:
    """Accumulates a request's events into OpenAI responses and stream chunks."""

    def __init__(self, spec: RequestSpec, kind: str, config: ServerConfig, sub: Submission,
                 lossless: bool = True, verify: str = "token"):
        self.spec, self.kind, self.config, self.sub = spec, kind, config, sub
        self.lossless = lossless  # False under an opt-in lossy verify rule
        self.verify = verify  # the verify method's name
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        n = len(sub.choices)
        self.finished: list[Finished | None] = [None] * n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.top: list[list[list[tuple[int, float]]]] = [[] for _ in range(n)]
        self.tokenizer = sub_tokenizer(sub)

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finished)

    def add(self, ev: Delta | Finished) -> None:
        if isinstance(ev, Delta):
            self.tokens[ev.index] += ev.token_ids
            self.logprobs[ev.index] += ev.logprobs or []
            self.top[ev.index] += ev.top or []
        else:
            self.finished[ev.index] = ev

    def usage(self) -> dict:
        completion = sum(len(f.token_ids) for f in self.finished if f is not None)
        prompt = self.spec.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def extension(self) -> dict:
        """The speculative statistics of the whole request (its choices summed)."""
        stats = [f.stats for f in self.finished if f is not None]
        total = GenerationStats()
        for st in stats:
            total.steps += st.steps
            total.drafted += st.drafted
            total.accepted += st.accepted
            total.emitted += st.emitted
            for i, c in enumerate(st.accepted_per_position):
                if i == len(total.accepted_per_position):
                    total.accepted_per_position.append(0)
                total.accepted_per_position[i] += c
        return {"drafter": self.config.drafter_name, "verify": self.verify,
                "lossless": self.lossless, "seed": self.spec.params.seed,
                "seeded": self.spec.seeded, "steps": total.steps, "drafted": total.drafted,
                "accepted": total.accepted, "acceptance_rate": total.acceptance_rate,
                "mean_acceptance_length": total.mean_acceptance_length,
                "accepted_per_position": total.accepted_per_position}

    def _logprobs(self, i: int, start: int, end: int, offset: int = 0) -> dict | None:
        if not self.spec.logprobs:
            return None
        ids = self.tokens[i][start:end]
        strs = token_strings(self.tokenizer, ids)
        lps = self.logprobs[i][start:end]
        tops = self.top[i][start:end] if self.spec.top_logprobs else [[] for _ in ids]
        if self.kind == "chat":
            return {"content": [
                {"token": s, "logprob": lp, "bytes": list(s.encode()),
                 "top_logprobs": [{"token": (t := self.tokenizer.decode([tid])), "logprob": v,
                                   "bytes": list(t.encode())} for tid, v in top]}
                for s, lp, top in zip(strs, lps, tops, strict=True)]}
        offsets, at = [], offset
        for s in strs:
            offsets.append(at)
            at += len(s)
        return {"tokens": strs, "token_logprobs": lps,
                "top_logprobs": ([{self.tokenizer.decode([tid]): v for tid, v in top}
                                  for top in tops] if self.spec.top_logprobs else None),
                "text_offset": offsets}

    def response(self) -> dict:
        choices = []
        for i, f in enumerate(self.finished):
            assert f is not None
            lp = self._logprobs(i, 0, len(self.tokens[i]))
            if self.kind == "chat":
                choices.append({"index": i, "message": {"role": "assistant", "content": f.text},
                                "logprobs": lp, "finish_reason": f.finish_reason})
            else:
                choices.append({"index": i, "text": f.text, "logprobs": lp,
                                "finish_reason": f.finish_reason})
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat"
                else "text_completion", "created": self.created, "model": self.spec.model,
                "choices": choices, "usage": self.usage(), "exactspec": self.extension()}

    def chunk(self, choices: list[dict], usage: dict | None = None, last: bool = False) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat"
                else "text_completion", "created": self.created, "model": self.spec.model,
                "choices": choices}
        if self.spec.include_usage:
            body["usage"] = usage
        if last:
            body["exactspec"] = self.extension()
        return _event(body)

    def delta_chunk(self, ev: Delta, start: int, sent_chars: int) -> str:
        reason = ev.finish_reason
        end = start + len(ev.token_ids)
        lp = self._logprobs(ev.index, start, end, sent_chars)
        if self.kind == "chat":
            choice = {"index": ev.index, "delta": {"content": ev.text} if ev.text else {},
                      "logprobs": lp, "finish_reason": reason}
        else:
            choice = {"index": ev.index, "text": ev.text, "logprobs": lp,
                      "finish_reason": reason}
        return self.chunk([choice])


def sub_tokenizer(sub: Submission):
    return sub.choices[0].text.tokenizer


async def _next_event(sub: Submission, deadline: float, poll: float | None):
    """The next event, None after `poll` seconds, or TimeoutError past the deadline."""
    remaining = deadline - time.perf_counter()
    if remaining <= 0:
        raise TimeoutError
    wait = remaining if poll is None else min(poll, remaining)
    try:
        return await asyncio.wait_for(sub.events.get(), timeout=wait)
    except TimeoutError:
        if time.perf_counter() >= deadline:
            raise
        return None


async def _collect(request: Request, answer: _Answer, deadline: float) -> Response:
    """A non-streaming answer: wait for every choice, watching for disconnects and timeout."""
    sub = answer.sub
    checked = time.perf_counter()
    try:
        while not answer.done:
            try:
                ev = await _next_event(sub, deadline, _POLL_SECONDS)
            except TimeoutError:
                return _error(_timeout_error(answer.spec, answer.config.request_timeout))
            if time.perf_counter() - checked >= _POLL_SECONDS:  # events or not: still there?
                checked = time.perf_counter()
                if await request.is_disconnected():
                    return Response(status_code=499)  # nobody reads it; the rows are cancelled
            if ev is None:
                continue
            if isinstance(ev, Failed):
                return _error(ev.error)
            answer.add(ev)
        return JSONResponse(answer.response())
    finally:
        if not answer.done:
            sub.cancel()


async def _sse(answer: _Answer, deadline: float) -> AsyncIterator[str]:
    """A streaming answer as server-sent events; a disconnect ends it and cancels the rows."""
    sub, spec = answer.sub, answer.spec
    n = len(sub.choices)
    start = [0] * n  # tokens already sent per choice
    chars = [0] * n  # text characters already sent per choice (text_offset)
    try:
        if answer.kind == "chat":
            yield answer.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None} for i in range(n)])
        while not answer.done:
            try:
                ev = await _next_event(sub, deadline, None)
            except TimeoutError:
                yield _event(_timeout_error(spec, answer.config.request_timeout).body())
                return
            if isinstance(ev, Failed):
                yield _event(ev.error.body())
                return
            answer.add(ev)
            if isinstance(ev, Delta) and (ev.text or ev.token_ids or ev.finish_reason):
                i = ev.index
                yield answer.delta_chunk(ev, start[i], chars[i])
                start[i] += len(ev.token_ids)
                chars[i] += len(ev.text)
        if spec.include_usage:
            yield answer.chunk([], usage=answer.usage(), last=True)
        yield "data: [DONE]\n\n"
    finally:
        if not answer.done:
            sub.cancel()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
