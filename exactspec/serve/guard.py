"""What bounds each connection and each request before the app sees it.

`Limits` are the knobs (`exactspec serve --max-body-bytes --read-timeout --limit-concurrency
--keep-alive-timeout`; docs/serving.md). Two pieces enforce them:

- `Guard`, an ASGI middleware outside everything else: it reads a POST body itself, refusing
  one over `max_body_bytes` with 413 (from Content-Length before a byte is read, or by counting
  a chunked body) and one that does not arrive within `read_timeout` with 408; a client that
  hangs up mid-body is one log line. It counts every answer by route and status code, and logs
  an exception that escapes the app once, with one traceback (a 500 in OpenAI's shape has
  already been sent by the app's handler).
- `protocol(limits, metrics)`, uvicorn's httptools protocol with a clock on the request head:
  a connection whose head has not arrived within `read_timeout` (after it opened, or after its
  last answer) is answered 408 and closed; one beyond `limit_concurrency` open connections is
  answered 503. uvicorn itself closes an idle keep-alive connection after `keep_alive` seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from exactspec.serve.metrics import Metrics
from exactspec.serve.protocol import ApiError

log = logging.getLogger(__name__)

ROUTES = frozenset(("/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                    "/metrics"))  # counted by name; any other path is counted as "other"
REASONS = {404: "not_found", 500: "internal_error"}  # refusals counted from the status alone


@dataclass
class Limits:
    """Per-request and per-connection bounds (the defaults are `exactspec serve`'s)."""

    max_body_bytes: int = 8 * 1024 * 1024  # a larger request body is refused with 413
    read_timeout: float = 30.0  # seconds for a request head, and for its body; then 408
    limit_concurrency: int | None = 1024  # open connections; one more is answered 503
    keep_alive: float = 5.0  # seconds an idle keep-alive connection stays open

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={self.max_body_bytes}: give at least 1 byte")
        if not self.read_timeout > 0 or not self.keep_alive > 0:
            raise ValueError(f"read_timeout={self.read_timeout}, keep_alive={self.keep_alive}:"
                             " give positive seconds")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency={self.limit_concurrency}: give at least 1 "
                             "connection (or None: no cap)")


def route_of(path: str) -> str:
    """The route label of a path (bounded: unknown paths share one label)."""
    return path if path in ROUTES else "other"


def error_body(exc: ApiError) -> bytes:
    """OpenAI's error body as bytes, ASCII-escaped so any text (a lone surrogate) renders."""
    return json.dumps(exc.body(), ensure_ascii=True).encode()


async def send_error(send: Callable[[dict], Awaitable[None]], exc: ApiError, *,
                     close: bool = False) -> None:
    """Answer `exc` on a raw ASGI `send`; `close` asks the server to close the connection."""
    body = error_body(exc)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's limit of {limit} "
                    "bytes (--max-body-bytes); send a shorter prompt", code="body_too_large")


def read_timeout(seconds: float, what: str) -> ApiError:
    return ApiError(408, f"the request {what} did not arrive within {seconds:g} s "
                    "(--read-timeout); send it in one go", code="request_timeout")


class Guard:
    """ASGI middleware: body limit and body timeout, answers counted, escaped errors logged."""

    def __init__(self, app, *, limits: Limits, metrics: Metrics) -> None:
        self.app, self.limits, self.metrics = app, limits, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def counted(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if scope["method"] == "POST":
                body = await self._body(scope, receive, counted)
                if body is None:  # refused, or the client left
                    return
                receive = _replay(body, receive)
            await self.app(scope, receive, counted)
        except Exception:  # a bug of ours: the app's handler has answered 500 if it could
            log.exception("internal error answering %s %s", scope["method"], scope["path"])
            if status is None:
                status = 500
                await send_error(send, ApiError(500, "internal error", type="internal_server_error",
                                                code="internal_error"))
        finally:
            if status is not None:
                self.metrics.count_answer(route_of(scope["path"]), status)
                if status in REASONS:
                    self.metrics.count("rejected", REASONS[status])

    async def _body(self, scope, receive, send) -> bytes | None:
        """The whole body, or None once it was refused (413, 408) or the client hung up."""
        limit = self.limits.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            self.metrics.count("rejected", "body_too_large")
            await send_error(send, too_large(limit))  # the body is read and dropped by uvicorn
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.read_timeout
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except TimeoutError:
                self.metrics.count("rejected", "request_timeout")
                await send_error(send, read_timeout(self.limits.read_timeout, "body"), close=True)
                return None
            if message["type"] == "http.disconnect":
                self.metrics.count("rejected", "client_disconnected")
                log.info("a client (%s) hung up while sending its request body, after %d bytes",
                         _peer(scope), size)
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                self.metrics.count("rejected", "body_too_large")
                await send_error(send, too_large(limit), close=True)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive):
    """A `receive` that gives the whole body once, then the connection's own messages (so a
    later disconnect still reaches the app)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _peer(scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "unknown"


def protocol(limits: Limits, metrics: Metrics) -> type:
    """uvicorn's httptools protocol with the head clock and the connection cap of `limits`."""

    async def too_many(scope, receive, send) -> None:
        metrics.count("rejected", "too_many_connections")
        metrics.count_answer(route_of(scope["path"]), 503)
        await send_error(send, ApiError(
            503, f"the server has {limits.limit_concurrency} connections open, its limit "
            "(--limit-concurrency); retry shortly", type="server_error",
            code="too_many_connections", headers={"Retry-After": "1"}), close=True)

    class Guarded(HttpToolsProtocol):
        """Closes a connection whose request head is late (408); refuses one too many (503)."""

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = None  # fires read_timeout after the last answer (or the start)
            self._partial = False  # bytes of a request head arrived, the head is not complete
            cap = limits.limit_concurrency
            if cap is not None and len(self.connections) > cap:
                self.app = too_many  # this connection's requests are refused
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._partial = True

        def on_headers_complete(self) -> None:
            self._partial = False
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self._head_timer = self.loop.call_later(limits.read_timeout, self._expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expired(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete and not self._partial:
                return  # a request is being answered; the Guard times its body
            if self._partial:  # half a head: say why before closing
                metrics.count("rejected", "request_timeout")
                metrics.count_answer("other", 408)
                body = error_body(read_timeout(limits.read_timeout, "head"))
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: "
                                     b"application/json\r\ncontent-length: " +
                                     str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
                                     + body)
            self.transport.close()  # idle, half a head, or a body still coming after its answer

    return Guarded
