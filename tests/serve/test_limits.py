"""The server holds under hostile and broken clients (issue 37): one `exactspec serve` process
on 127.0.0.1, a tiny model, short timeouts; every test bounded in time, the server stopped by
its own pid. Each row: a 20 MB body (413, memory flat), /health during a 2 MB prompt, stalled
connections (408, closed), hang-ups mid-body (no traceback), lone surrogates and deep nesting
(400), the lower-case auth scheme, idle keep-alive, the connection cap, the status counter."""

from __future__ import annotations

import json
import logging
import socket
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from exactspec.serve.process import ServerProcess
from tests.batch.tiny_dir import save_tiny
from tests.serve.conftest import NAME, start

KEY = "K3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
READ_TIMEOUT = 3.0  # --read-timeout of the server under test
CAP = 24  # --limit-concurrency
MIB = 1024 * 1024


class Serve(ServerProcess):
    """`exactspec serve` on the tiny model directory, with the limits under test."""

    name = "exactspec serve"

    def __init__(self, model_dir, *flags: str) -> None:
        super().__init__(start_timeout=240.0, stop_timeout=30.0)
        self.model_dir, self.flags = model_dir, flags

    def command(self) -> list[str]:
        return [sys.executable, "-m", "exactspec.cli", "serve", "--model", str(self.model_dir),
                "--port", str(self.port), "--threads", "1", "--served-name", NAME, *self.flags]

    def rss(self, field: str = "VmRSS") -> int:
        """The server process's resident memory (VmRSS) or its peak (VmHWM), in bytes."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise AssertionError(f"no {field} for pid {self.proc.pid}")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    model_dir = save_tiny(tmp_path_factory.mktemp("limits") / "model")
    with Serve(model_dir, "--api-key", KEY, "--read-timeout", str(READ_TIMEOUT),
               "--limit-concurrency", str(CAP), "--keep-alive-timeout", "1", "-v") as server:
        yield server


def post(srv, path: str, content: bytes, headers: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(srv.url + path, content=content, timeout=60,
                      headers={**AUTH, "content-type": "application/json", **(headers or {})},
                      **kw)


def samples(srv) -> dict:
    text = httpx.get(srv.url + "/metrics", headers=AUTH, timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def answers(srv, route: str, code: int) -> float:
    return samples(srv).get(("exactspec:http_requests_total",
                             (("code", str(code)), ("route", route))), 0.0)


def openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code, err
    return err


def test_a_20mb_body_is_413_before_it_is_read_and_memory_stays_flat(srv):
    idle = srv.rss()
    big = json.dumps({"model": NAME, "prompt": "a" * (20 * MIB)}).encode()
    for path in ("/v1/completions", "/v1/chat/completions"):
        err = openai_error(post(srv, path, big), 413, "body_too_large")
        assert "8388608 bytes" in err["message"]

    def chunked():  # no Content-Length: the server counts the bytes
        for _ in range(20):
            yield b" " * MIB

    openai_error(post(srv, "/v1/completions", chunked()), 413, "body_too_large")
    assert srv.rss("VmHWM") - idle < 100 * MIB  # never near the body's 20 MB, let alone 2.9 GB
    ok = post(srv, "/v1/completions", json.dumps(
        {"model": NAME, "prompt": "ab", "max_tokens": 2}).encode())
    assert ok.status_code == 200, ok.text  # the server serves on


def test_health_answers_within_half_a_second_while_a_2mb_prompt_is_prepared(srv):
    body = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x" * (2 * MIB)}]})
    worst, done = [0.0], threading.Event()

    def poll():
        with httpx.Client(timeout=10) as c:
            while not done.is_set():
                t = time.perf_counter()
                assert c.get(srv.url + "/health").status_code == 200
                worst[0] = max(worst[0], time.perf_counter() - t)
                time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for _ in range(3):
            err = openai_error(post(srv, "/v1/chat/completions", body.encode()), 400)
            assert err["param"] == "messages" and "context of 512 tokens" in err["message"]
    finally:
        done.set()
        poller.join(30)
    assert worst[0] < 0.5, worst[0]


def _connect(srv) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    return s


def _read_all(s: socket.socket) -> bytes:
    """Everything until the server closes the connection (socket timeout: 30 s)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_stalled_connections_are_answered_408_and_closed_within_the_read_timeout(srv):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
    socks = []
    for i in range(8):  # half a head; a whole head and part of its body
        s = _connect(srv)
        s.sendall(head[:30] if i % 2 == 0 else head + b'{"model": "')
        socks.append(s)
    start = time.monotonic()
    got = [_read_all(s) for s in socks]
    elapsed = time.monotonic() - start
    for s in socks:
        s.close()
    assert READ_TIMEOUT - 1 < elapsed < READ_TIMEOUT + 20, elapsed  # closed by the timeout
    for i, raw in enumerate(got):
        assert raw.startswith(b"HTTP/1.1 408 "), raw[:200]
        body = json.loads(raw.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "request_timeout"
        assert ("head" if i % 2 == 0 else "body") in body["error"]["message"]


def test_idle_keep_alive_is_closed(srv):
    """Closed by the keep-alive (1 s), silently, before the read timeout (3 s) would answer the
    idle connection 408 and close it."""
    # The client's own keep-alive (60 s) outlasts the wait: the connection's expiry is the
    # server's close (httpcore: idle and readable), not the client's clock.
    with httpx.Client(timeout=10, limits=httpx.Limits(keepalive_expiry=60)) as c:
        assert c.get(srv.url + "/health").status_code == 200
        (conn,) = [p for p in c._transport._pool.connections]
        start = time.monotonic()
        while not conn.has_expired():
            assert time.monotonic() - start < READ_TIMEOUT, "kept past the keep-alive"
            time.sleep(0.05)
    s = _connect(srv)  # the same in raw bytes: one answer, then the close, no 408
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    start = time.monotonic()
    raw = _read_all(s)
    s.close()
    assert raw.startswith(b"HTTP/1.1 200 ") and raw.count(b"HTTP/1.1 ") == 1, raw
    assert time.monotonic() - start < READ_TIMEOUT


def test_hangups_mid_body_write_at_most_one_line_and_no_traceback(srv):
    before = srv.output()
    for _ in range(10):
        s = _connect(srv)
        s.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n"
                   f"Authorization: Bearer {KEY}\r\n\r\n").encode() + b'{"model": "tiny", ')
        time.sleep(0.05)
        s.close()
    end = time.monotonic() + 30
    while samples(srv).get(("exactspec:request_rejected_total",
                            (("reason", "client_disconnected"),)), 0) < 10:
        assert time.monotonic() < end, "the hang-ups were not counted"
        time.sleep(0.1)
    new = srv.output()[len(before):]
    assert "Traceback" not in new and "Exception" not in new, new
    lines = [line for line in new.splitlines() if "GET /metrics" not in line]  # our polls
    assert len(lines) == 10 and all("hung up" in line for line in lines), new  # a line each


@pytest.mark.parametrize(("path", "raw", "param"), [
    ("/v1/completions", b'{"model": "tiny", "prompt": "ab\\ud800c"}', "prompt[0]"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ["ok", "\\udfff"]}', "prompt[1]"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "ab", "stop": "\\ud800"}', "stop"),
    ("/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}',
     "messages[0].content"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "a", "\\ud800": 1}', "\ud800"),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
     None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', None),
])
def test_surrogates_deep_nesting_and_bad_utf8_are_400(srv, path, raw, param):
    err = openai_error(post(srv, path, raw), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if param is None and raw.startswith(b"["):
        assert "too deeply" in err["message"]


def test_the_auth_scheme_is_case_insensitive(srv):
    for auth, status in ((f"bearer {KEY}", 200), (f"BEARER {KEY}", 200),
                         (f"Bearer  {KEY}", 200), ("Bearer wrong", 401), (f"Basic {KEY}", 401),
                         (KEY, 401), ("", 401)):
        r = httpx.get(srv.url + "/v1/models", headers={"Authorization": auth})
        assert r.status_code == status, (auth, r.text)


def test_one_connection_too_many_is_503(srv):
    idle = [_connect(srv) for _ in range(CAP)]  # open, silent: each holds a slot
    try:
        time.sleep(0.3)
        s = _connect(srv)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = _read_all(s)
        s.close()
    finally:
        for s in idle:
            s.close()
    assert raw.startswith(b"HTTP/1.1 503 "), raw[:200]
    assert json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
    end = time.monotonic() + 20
    while True:  # the slots free as the idle ones close
        try:
            if httpx.get(srv.url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < end
        time.sleep(0.2)


def test_every_answer_is_counted_by_route_and_status(srv):
    before = {(route, code): answers(srv, route, code) for route, code in (
        ("/v1/completions", 404), ("other", 404), ("/v1/completions", 413),
        ("/v1/completions", 400), ("/v1/models", 401))}
    httpx.get(srv.url + "/nowhere", headers=AUTH)
    post(srv, "/v1/completions", b'{"model": "gpt-9", "prompt": "a"}')
    post(srv, "/v1/completions", b"x" * (9 * MIB))
    post(srv, "/v1/completions", b"{")
    httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer no"})
    for key, value in before.items():
        assert answers(srv, *key) == value + 1, key
    got = samples(srv)
    for reason in ("not_found", "body_too_large", "invalid_request", "unauthorized"):
        assert got[("exactspec:request_rejected_total", (("reason", reason),))] >= 1, reason
    assert answers(srv, "/health", 200) >= 1


def test_a_bug_of_ours_is_500_logged_once_with_one_traceback(tiny):
    """An exception inside a handler (not a client's mistake): 500 in OpenAI's shape, one log
    record with its traceback (not uvicorn's as well), counted as a 500."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    keep = Keep()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn.error")]
    with start(tiny) as server:
        async def broken(spec, loop):
            raise RuntimeError("a bug")

        server.app.state.engine.enqueue = broken
        for lg in loggers:
            lg.addHandler(keep)
        try:
            r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "a"})
            end = time.monotonic() + 30  # counted and logged just after the answer is sent
            while not server.app.state.metrics.answers.get(("/v1/completions", "500")):
                assert time.monotonic() < end
                time.sleep(0.01)
        finally:
            for lg in loggers:
                lg.removeHandler(keep)
        err = openai_error(r, 500, "internal_error")
        assert "RuntimeError: a bug" in err["message"]
        metrics = server.app.state.metrics
        assert metrics.answers[("/v1/completions", "500")] == 1
        assert metrics.rejected["internal_error"] == 1
    traced = {id(rec): rec for rec in records if rec.exc_info}
    assert len(traced) == 1, [rec.getMessage() for rec in records]
    (rec,) = traced.values()
    assert rec.name == "exactspec.serve.guard" and rec.exc_info[0] is RuntimeError
