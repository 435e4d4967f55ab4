"""An engine crash survived (issue 37): `exactspec serve` runs its engine in a child process;
SIGKILL it mid-stream and the requests in flight get 503 in OpenAI's shape naming what happened,
/health says it is restarting, the engine comes back, and the same seed gives the same text."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.batch.tiny_dir import save_tiny
from tests.serve.conftest import NAME
from tests.serve.test_limits import Serve

LONG = {"max_tokens": 500, "n": 32, "logit_bias": {"0": -100}}  # id 0 is EOS: runs to the end


def engine_pid(front: int) -> int:
    """The one child process of the server (the engine), from /proc."""
    kids = set()
    for task in Path(f"/proc/{front}/task").iterdir():
        kids |= {int(p) for p in (task / "children").read_text().split()}
    assert len(kids) == 1, kids
    return kids.pop()


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    model_dir = save_tiny(tmp_path_factory.mktemp("crash") / "model")
    with Serve(model_dir, "-v", "--engine-restarts", "2") as server:
        yield server


def ask(srv, **body) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", timeout=120,
                      json={"model": NAME, "prompt": "go", **body})


def test_sigkill_mid_stream_is_503_then_the_engine_restarts_with_the_same_text(srv):
    greedy = ask(srv, max_tokens=24, temperature=0).json()["choices"][0]["text"]
    sampled = ask(srv, max_tokens=24, seed=7).json()["choices"][0]["text"]
    first = engine_pid(srv.proc.pid)
    plain: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: plain.append(ask(srv, **LONG)))
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=120, json={
            "model": NAME, "prompt": "go", "stream": True, **LONG}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # decoding has begun
        waiting.start()
        time.sleep(0.2)
        os.kill(first, signal.SIGKILL)
        events = [line[6:] for line in lines if line.startswith("data: ")]
    waiting.join(120)
    health = httpx.get(srv.url + "/health", timeout=10)
    error = json.loads(events[-1])["error"]  # the stream ends with the error event
    assert error["code"] == "engine_restarting" and "killed by SIGKILL" in error["message"]
    assert events[-1] != "[DONE]"
    (r,) = plain
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_restarting", r.text
    assert "killed by SIGKILL" in r.json()["error"]["message"]
    if health.status_code == 503:  # still loading: it says so
        assert health.json()["status"] == "restarting"
    end = time.monotonic() + 180
    while httpx.get(srv.url + "/health", timeout=10).status_code != 200:
        refused = ask(srv, max_tokens=2)  # meanwhile: refused in OpenAI's shape
        assert refused.status_code in (200, 503), refused.text
        assert time.monotonic() < end, "the engine did not come back"
        time.sleep(0.2)
    assert engine_pid(srv.proc.pid) != first
    assert ask(srv, max_tokens=24, temperature=0).json()["choices"][0]["text"] == greedy
    assert ask(srv, max_tokens=24, seed=7).json()["choices"][0]["text"] == sampled
    log = srv.output()
    assert "the engine process died (killed by SIGKILL)" in log
    assert "restarting the engine process (try 1 of 2)" in log and "Traceback" not in log
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'exactspec:http_requests_total{code="503",route="/v1/completions"}' in metrics
