"""Request fields the server does not implement are refused by name (400, OpenAI's error body),
never answered 200 as if they had been applied (issue 26)."""

from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import NAME, client

openai = pytest.importorskip("openai")

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("kind", "extra"), [
    ("chat", {"foo": 1}),
    ("chat", {"reasoning_effort": "low"}),
    ("chat", {"response_format": {"type": "xml"}}),  # json_object / json_schema are served
    ("chat", {"store": True}),  # only its no-op value, false, is taken
    ("chat", {"prompt": "hi"}),  # a text-completion field sent to chat
    ("text", {"foo": "bar"}),
    ("text", {"top_logprobs": 2}),  # a chat field sent to text completions
    ("text", {"reasoning_effort": "high"}),
])
def test_unknown_or_unimplemented_field_is_400_naming_it(server, kind, extra):
    body = {"model": NAME, **({"messages": MSG} if kind == "chat" else {"prompt": "hi"}),
            "max_tokens": 2, **extra}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    before = server.app.state.metrics.prompt_tokens
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    (key,) = extra
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == key
    assert f"'{key}'" in err["message"]
    assert server.app.state.metrics.prompt_tokens == before  # nothing was queued


def test_every_documented_field_is_still_accepted(server):
    """The fields the README lists (and `user`) pass, so the refusal is not a blanket one."""
    chat = {"model": NAME, "messages": MSG, "max_tokens": 2, "max_completion_tokens": 2,
            "temperature": 0.5, "top_p": 0.9, "n": 2, "stop": ["zz"], "seed": 1,
            "stream": False, "logprobs": True, "top_logprobs": 2, "presence_penalty": 0.1,
            "frequency_penalty": 0.1, "logit_bias": {"3": 1}, "top_k": 5, "min_p": 0.01,
            "repetition_penalty": 1.1, "user": "u1", "tools": []}
    text = {"model": NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0.5, "logprobs": 2,
            "echo": False, "seed": 1, "user": "u1"}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", text)):
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text


def test_the_openai_client_sees_the_refusal(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model=NAME, messages=MSG, max_tokens=2,
                                               reasoning_effort="low")
    assert e.value.body["param"] == "reasoning_effort"
