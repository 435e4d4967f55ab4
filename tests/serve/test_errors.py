"""Every error class: 400 naming the field (nothing reaches the engine), 401, 404, 429 with
Retry-After, 500 for that request only, 504 on timeout; a disconnect cancels the row and frees
it at the next step; a drafter that raises fails no request (its rows continue plain)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

import exactspec as es
from tests.serve.conftest import NAME, client, start

openai = pytest.importorskip("openai")

MSG = [{"role": "user", "content": "hi"}]
NO_EOS = {"logit_bias": {"0": -100}}  # id 0 is EOS: long requests run to max_tokens


@pytest.mark.parametrize(("kind", "extra", "param"), [
    ("chat", {"temperature": -1}, "temperature"),
    ("chat", {"temperature": "hot"}, "temperature"),
    ("chat", {"top_p": 0}, "top_p"),
    ("chat", {"n": 0}, "n"),
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_tokens": 10_000}, "max_tokens"),
    ("chat", {"max_completion_tokens": 10_000}, "max_completion_tokens"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("chat", {"top_logprobs": 3}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"stop": [f"s{i}" for i in range(65)]}, "stop"),  # 64 at most
    ("chat", {"logit_bias": {"999": 1}}, "logit_bias"),
    ("chat", {"seed": 2**63}, "seed"),  # any int64 is taken
    ("chat", {"presence_penalty": 3}, "presence_penalty"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"tools": [{"type": "function"}]}, "tools"),
    ("text", {"prompt": ""}, "prompt"),
    ("text", {"prompt": [[1, 2, 10_000]]}, "prompt"),
    ("text", {"logprobs": 6}, "logprobs"),
    ("text", {"echo": True, "stream": True}, "echo"),  # echo is not streamed
])
def test_bad_field_is_400_naming_it_and_never_queued(server, kind, extra, param):
    body = {"model": NAME, **({"messages": MSG} if kind == "chat" else {"prompt": "hi"}), **extra}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    before = server.app.state.metrics.prompt_tokens
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert server.app.state.metrics.prompt_tokens == before  # the engine never saw it


def test_the_client_sees_400_and_404(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, messages=MSG, n=129)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-9", messages=MSG)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    r = httpx.post(server.url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_api_key(tiny):
    with start(tiny, api_key="s3cret") as srv:
        assert httpx.get(srv.url + "/health").status_code == 200  # open without the key
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.get(srv.url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/metrics").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client(srv, api_key="wrong").completions.create(model=NAME, prompt="a", max_tokens=2)
        r = client(srv, api_key="s3cret").completions.create(model=NAME, prompt="a", max_tokens=2)
        assert r.usage.completion_tokens >= 1


def test_full_queue_is_429_with_retry_after_then_served(tiny):
    with start(tiny, engine={"max_queue": 2}) as srv:
        srv.engine.pause()
        results = []

        def ask():
            results.append(client(srv).completions.create(model=NAME, prompt="q", max_tokens=3,
                                                          seed=1))

        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        _wait(lambda: srv.engine.waiting == 2)
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "q"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            client(srv).completions.create(model=NAME, prompt="q", max_tokens=3)
        srv.engine.resume()
        for t in threads:
            t.join(30)
        assert len(results) == 2 and results[0].choices[0].text == results[1].choices[0].text


class Faulty:
    """A drafter that breaks on one token: an internal error inside the engine."""

    hidden_layers = None

    def __init__(self, poison: int) -> None:
        self.inner, self.poison = es.PromptLookup(), poison

    def begin(self, context, target):
        self.inner.begin(context, target)

    def select(self, rows):
        self.inner.select(rows)

    def propose(self, context, num_tokens):
        if (context.tokens == self.poison).any():
            raise RuntimeError("the drafter broke")
        return self.inner.propose(context, num_tokens)


def test_a_raising_drafter_fails_no_request_and_its_rows_continue_plain(tiny):
    """The drafter raises whenever a row holds the poison token: those rows finish with plain
    decoding (greedy: plain greedy's text), the fault is counted, and once they have left the
    drafter restarts and serves the next requests."""
    poison = tiny.encode("z")[0]
    greedy = es.SamplingParams(temperature=0)
    with start(tiny, Faulty(poison)) as srv:
        c = client(srv)
        r = c.completions.create(model=NAME, prompt="zzz", max_tokens=12, temperature=0)
        (g,) = es.generate(tiny, ["zzz"], params=greedy, max_new_tokens=12)
        assert r.choices[0].text == g.text and r.usage.completion_tokens == len(g.token_ids)
        text = "".join(ch.choices[0].text for ch in c.completions.create(
            model=NAME, prompt="zzz", max_tokens=12, temperature=0, stream=True) if ch.choices)
        assert text == g.text
        faults = _metric_value(srv, 'exactspec:drafter_faults_total{where="step"}')
        assert faults >= 2 and srv.app.state.metrics.requests.get("error", 0) == 0
        ok = c.completions.create(model=NAME, prompt="abcabcabcabc", max_tokens=12,
                                  temperature=0, logit_bias={str(poison): -100})
        assert ok.usage.completion_tokens == 12
        assert ok.model_extra["exactspec"]["drafted"] > 0  # the drafter is back
        assert _metric_value(srv, 'exactspec:drafter_faults_total{where="step"}') == faults


class OutOfRange:
    """A drafter whose draft token is no token of the model: the target's forward fails, an
    internal error outside the drafter (500 for the rows in flight)."""

    hidden_layers = None

    def __init__(self, poison: int) -> None:
        self.poison = poison

    def begin(self, context, target):
        pass

    def select(self, rows):
        pass

    def propose(self, context, num_tokens):
        b = num_tokens.shape[0]
        if (context.tokens == self.poison).any():
            return torch.full((b, 1), 10_000, dtype=torch.long), None
        return torch.full((b, 0), -1, dtype=torch.long), None


def test_internal_error_is_500_and_the_server_keeps_serving(tiny):
    poison = tiny.encode("z")[0]
    with start(tiny, OutOfRange(poison)) as srv:
        c = client(srv)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=NAME, prompt="zzz", max_tokens=4)
        assert e.value.status_code == 500 and e.value.body["code"] == "internal_error"
        with pytest.raises(openai.APIError, match="internal error"):  # streams: an error event
            list(c.completions.create(model=NAME, prompt="zz", max_tokens=4, stream=True))
        ok = c.completions.create(model=NAME, prompt="abc", max_tokens=4, temperature=0,
                                  logit_bias={str(poison): -100})
        assert ok.usage.completion_tokens == 4


def test_context_overflow_is_400_naming_both_numbers(server, tiny):
    ctx = tiny.max_context
    with pytest.raises(openai.BadRequestError) as e:
        client(server).completions.create(model=NAME, prompt="abc", max_tokens=ctx)
    message = e.value.body["message"]
    assert f"'max_tokens'={ctx}" in message and "3 tokens" in message
    assert f"context of {ctx} tokens" in message and e.value.body["param"] == "max_tokens"


def _metric_value(srv, name: str) -> float:
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


class Slow:
    """Plain decoding that takes `delay` seconds per step (prompt lookup with nothing found)."""

    hidden_layers = None

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def begin(self, context, target):
        pass

    def select(self, rows):
        pass

    def propose(self, context, num_tokens):
        time.sleep(self.delay)
        return torch.full((num_tokens.shape[0], 0), -1, dtype=torch.long), None


def test_timeout_is_504(tiny):
    with start(tiny, Slow(0.02), request_timeout=0.5) as srv:
        with pytest.raises(openai.APIStatusError) as e:
            client(srv).completions.create(model=NAME, prompt="a", max_tokens=400, **NO_EOS)
        assert e.value.status_code == 504 and e.value.body["code"] == "request_timeout"
        _wait(lambda: _success(srv, "cancelled") == 1)  # the row left the engine


def test_disconnect_cancels_the_row(tiny):
    with start(tiny, Slow(0.01)) as srv:
        with httpx.stream("POST", srv.url + "/v1/completions", json={
                "model": NAME, "prompt": "a", "max_tokens": 400, "stream": True, **NO_EOS}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        _wait(lambda: _success(srv, "cancelled") == 1)
        _wait(lambda: srv.app.state.metrics.batch_rows == 0)  # the row left the batch
        emitted = srv.app.state.metrics.generation_tokens
        assert 0 < emitted < 100  # the row stopped long before its 400 tokens
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
            httpx.post(srv.url + "/v1/completions", timeout=0.3,
                       json={"model": NAME, "prompt": "b", "max_tokens": 400, **NO_EOS})
        _wait(lambda: _success(srv, "cancelled") == 2)
        assert srv.app.state.metrics.generation_tokens < emitted + 100


def _success(srv, reason: str) -> int:
    return srv.app.state.metrics.requests.get(reason, 0)


def _wait(cond, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.01)
