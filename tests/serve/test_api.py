"""The OpenAI API through the official client against a real server: every answer is checked
against what `es.generate` gives for the same request alone (exact: same tokens and text)."""

from __future__ import annotations

import math

import httpx
import pytest

import exactspec as es
from tests.serve.conftest import NAME, client

openai = pytest.importorskip("openai")

CHAT = [{"role": "user", "content": "tell me a tale"}]


def reference(model, prompt: str | list[int], *, n: int = 1, chat: bool = False, **kw):
    """es.generate for the request alone: n copies of the prompt, the request's seed; a seeded
    request is decoded coupled (its text is plain decoding's for the seed at any K) and its
    logprobs are the model's own law by default (issue 38)."""
    kw.setdefault("verify", "coupled")
    kw.setdefault("logprobs_mode", "raw")
    ids = prompt if isinstance(prompt, list) else model.encode(prompt, chat=chat)
    params = es.SamplingParams(**{k: kw.pop(k) for k in list(kw) if k in (
        "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "logit_bias")})
    return es.generate(model, [ids] * n, params=params, return_logprobs=True, **kw)


def test_chat_completion_is_generate_alone(server, tiny):
    r = client(server).chat.completions.create(model=NAME, messages=CHAT, max_tokens=24, seed=11,
                                               temperature=0.9, top_p=0.95)
    (g,) = reference(tiny, CHAT[0]["content"], chat=True, max_new_tokens=24, seed=11,
                     temperature=0.9, top_p=0.95)
    assert r.choices[0].message.content == g.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("length" if g.finish_reason == "length" else "stop")
    assert r.usage.completion_tokens == len(g.token_ids)
    assert r.usage.prompt_tokens == len(tiny.encode(CHAT[0]["content"], chat=True))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    ext = r.model_extra["exactspec"]
    assert ext["seed"] == 11 and ext["steps"] == g.stats.steps == len(g.token_ids)
    assert ext["drafted"] == 0 and ext["mean_acceptance_length"] == 1.0


def test_text_completion_n2_are_the_rows_of_one_generate_call(server, tiny):
    r = client(server).completions.create(model=NAME, prompt="once upon", max_tokens=12, n=2,
                                          seed=5)
    gens = reference(tiny, "once upon", n=2, max_new_tokens=12, seed=5)
    assert [c.text for c in r.choices] == [g.text for g in gens]
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == sum(len(g.token_ids) for g in gens)
    assert r.usage.prompt_tokens == len(tiny.encode("once upon"))  # counted once, not per choice


def test_prompt_list_and_token_ids(server, tiny):
    ids = tiny.encode("abc")
    r = client(server).completions.create(model=NAME, prompt=[ids, "xyz"], max_tokens=6, n=2,
                                          seed=9)
    gens = es.generate(tiny, [ids, ids, tiny.encode("xyz"), tiny.encode("xyz")],
                       params=es.SamplingParams(seed=9), max_new_tokens=6, verify="coupled")
    assert [c.text for c in r.choices] == [g.text for g in gens]


def test_stream_with_usage_chunk_equals_the_plain_answer(server):
    c = client(server)
    whole = c.chat.completions.create(model=NAME, messages=CHAT, max_tokens=30, seed=3, n=2)
    chunks = list(c.chat.completions.create(model=NAME, messages=CHAT, max_tokens=30, seed=3,
                                            n=2, stream=True,
                                            stream_options={"include_usage": True}))
    text, reasons = ["", ""], [None, None]
    for ch in chunks[:-1]:
        assert ch.usage is None
        for choice in ch.choices:
            text[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    last = chunks[-1]
    assert last.choices == [] and last.usage == whole.usage
    assert text == [ch.message.content for ch in whole.choices]
    assert reasons == [ch.finish_reason for ch in whole.choices]
    assert chunks[0].choices[0].delta.role == "assistant"


def test_text_stream(server):
    c = client(server)
    whole = c.completions.create(model=NAME, prompt="hello", max_tokens=20, seed=5)
    pieces = [ch.choices[0].text for ch in c.completions.create(
        model=NAME, prompt="hello", max_tokens=20, seed=5, stream=True) if ch.choices]
    assert "".join(pieces) == whole.choices[0].text and len(pieces) > 1


def test_chat_logprobs_are_the_engine_logprobs(server, tiny):
    r = client(server).chat.completions.create(model=NAME, messages=CHAT, max_tokens=16, seed=8,
                                               logprobs=True, top_logprobs=5, temperature=0.7)
    (g,) = reference(tiny, CHAT[0]["content"], chat=True, max_new_tokens=16, seed=8,
                     temperature=0.7)
    content = r.choices[0].logprobs.content
    assert [x.logprob for x in content] == pytest.approx(g.logprobs, abs=0)  # the same floats
    assert "".join(x.token for x in content if x.token != "<eos>") == g.text
    for x in content:
        tops = [t.logprob for t in x.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert sum(math.exp(t) for t in tops) <= 1 + 1e-6
        listed = {t.token: t.logprob for t in x.top_logprobs}
        if x.token in listed:  # the step's own p: its entry is its logprob, the same float
            assert listed[x.token] == x.logprob
        else:
            assert x.logprob <= tops[-1]


def test_text_logprobs_and_greedy_top(server, tiny):
    r = client(server).completions.create(model=NAME, prompt="abc", max_tokens=8, logprobs=3,
                                          temperature=0)
    (g,) = reference(tiny, "abc", max_new_tokens=8, temperature=0)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(g.logprobs, abs=0)  # the model's own law at T=0
    assert all(v < 0 for v in lp.token_logprobs)  # real values, not the one-hot's 0.0
    assert all(len(t) == 3 and max(t, key=t.get) == s  # always 3 entries, the greedy token first
               for t, s in zip(lp.top_logprobs, lp.tokens, strict=True))
    assert lp.text_offset == list(range(len(g.token_ids)))  # one character per token
    processed = client(server).completions.create(  # the law drawn from, on request
        model=NAME, prompt="abc", max_tokens=8, logprobs=3, temperature=0,
        extra_body={"logprobs_mode": "processed_logprobs"}).choices[0].logprobs
    assert processed.token_logprobs == [0.0] * len(g.token_ids)  # greedy: p is one-hot
    assert [list(t) for t in processed.top_logprobs] == [[s] for s in processed.tokens]


def test_seed_reproducible_and_seeds_differ(server):
    c = client(server)
    ask = dict(model=NAME, prompt="the", max_tokens=24)
    a, b = (c.completions.create(seed=21, **ask).choices[0].text for _ in range(2))
    others = {c.completions.create(seed=s, **ask).choices[0].text for s in (22, 23, 24)}
    assert a == b
    assert len(others | {a}) == 4  # 24 tokens at T=1: distinct seeds give distinct texts


def test_stop_strings(server, tiny):
    c = client(server)
    free = c.completions.create(model=NAME, prompt="stop", max_tokens=30, seed=2,
                                temperature=0.5).choices[0].text
    stop = free[5:7]
    assert len(stop) == 2
    r = c.completions.create(model=NAME, prompt="stop", max_tokens=30, seed=2, temperature=0.5,
                             stop=[stop, "@@"])
    (g,) = reference(tiny, "stop", max_new_tokens=30, seed=2, temperature=0.5, stop=[stop, "@@"])
    assert r.choices[0].text == g.text == free[: free.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=NAME, prompt="stop", max_tokens=30, seed=2, temperature=0.5, stop=stop,
        stream=True) if ch.choices)
    assert streamed == g.text  # the held-back characters never leak past the stop string


def test_models_health_metrics(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [NAME]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    before = _metric(server, "exactspec:generation_tokens_total")
    r = c.completions.create(model=NAME, prompt="count", max_tokens=7, seed=1, n=3)
    after = _metric(server, "exactspec:generation_tokens_total")
    assert after - before == r.usage.completion_tokens
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_waiting", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "engine_step_seconds_count",
                 "time_to_first_token_seconds_bucket"):
        assert f"exactspec:{name}" in text


def _metric(server, name: str, labels: str = "") -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    return 0.0
