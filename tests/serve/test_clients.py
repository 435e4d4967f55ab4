"""What the clients people use send (issue 38), through the official `openai` SDK against servers
on loopback: fields with "off" values, tool-call histories, the model's own logprobs, a seed's
text with and without speculation, echo with prompt logprobs (lm-evaluation-harness's
log-likelihood shape), models.retrieve, /tokenize and /detokenize, token bytes."""

from __future__ import annotations

import httpx
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import exactspec as es
from exactspec.drafters.vocab_map import byte_decoder
from exactspec.serve.rows import RowText, drop_partial, token_bytes
from tests.engine.tiny import tiny_model
from tests.serve.conftest import NAME, client, start

openai = pytest.importorskip("openai")

MSG = [{"role": "user", "content": "tell me a tale"}]


def test_noop_values_change_nothing(server):
    c = client(server)
    ask = dict(model=NAME, messages=MSG, max_tokens=12, seed=3)
    plain = c.chat.completions.create(**ask).choices[0].message.content
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    noop = c.chat.completions.create(
        **ask, response_format={"type": "text"}, tools=tools, tool_choice="none",
        parallel_tool_calls=False, store=False, n=1, service_tier="auto", metadata={},
        extra_body={"min_tokens": 0, "ignore_eos": False}).choices[0].message.content
    assert noop == plain
    text = dict(model=NAME, prompt="once", max_tokens=12, seed=3)
    assert c.completions.create(**text, best_of=1, suffix="", echo=False).choices[0].text == \
        c.completions.create(**text).choices[0].text


@pytest.mark.parametrize(("extra", "param"), [
    ({"extra_body": {"min_tokens": 3}}, "min_tokens"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"extra_body": {"logprobs_mode": "raw_logits"}}, "logprobs_mode"),
])
def test_what_is_not_served_is_refused_by_name(server, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model=NAME, messages=MSG, max_tokens=2, **extra)
    assert e.value.body["param"] == param and f"'{param}'" in e.value.body["message"]


def test_ignore_eos_runs_to_the_budget(server):
    c = client(server)
    ask = dict(model=NAME, prompt="hello", max_tokens=20, seed=4)  # seed 4 stops at once
    assert c.completions.create(**ask).choices[0].finish_reason == "stop"
    r = c.completions.create(**ask, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 20


CHATML = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if m.tool_calls %}"
          "{% for c in m.tool_calls %}call {{ c.function.name }}{% endfor %}{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("template", [CHATML, CHATML.replace("tool_calls", "calls")])
def test_tool_call_history_goes_through_the_template(template):
    model = tiny_model(0, eos=0)
    model.tokenizer.chat_template = template
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get", "arguments": '{"city": "oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    with start(model) as srv:
        r = client(srv).chat.completions.create(model=NAME, messages=history, max_tokens=3,
                                                seed=1)
    call = ("call get" if "tool_calls" in template
            else '{"name": "get", "arguments": {"city": "oslo"}}')  # dropped by it: in content
    text = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "weather?"},
         {"role": "assistant", "content": "" if "tool_calls" in template else call},
         {"role": "tool", "content": "sunny"}], tokenize=False, add_generation_prompt=True)
    if "tool_calls" in template:
        text = text.replace("<|assistant|><|tool|>", f"<|assistant|>{call}<|tool|>", 1)
    assert r.usage.prompt_tokens == len(model.tokenizer(text, add_special_tokens=False)
                                        ["input_ids"])


def test_logprobs_are_the_models_own_at_temperature_0(server, tiny):
    r = client(server).chat.completions.create(model=NAME, messages=MSG, max_tokens=10,
                                               temperature=0, logprobs=True, top_logprobs=3)
    (g,) = es.generate(tiny, [tiny.encode(MSG[0]["content"], chat=True)], max_new_tokens=10,
                       params=es.SamplingParams(temperature=0), return_logprobs=True,
                       logprobs_mode="raw")
    content = r.choices[0].logprobs.content
    assert [x.logprob for x in content] == g.logprobs and all(x.logprob < 0 for x in content)
    assert all(len(x.top_logprobs) == 3 for x in content)  # always as many as asked
    assert all(x.top_logprobs[0].logprob == x.logprob for x in content)  # greedy: the top one


def test_a_seed_gives_one_text_with_and_without_speculation(server, tiny):
    ask = dict(model=NAME, prompt="once upon a time", max_tokens=40, temperature=1.0)
    plain = [client(server).completions.create(**ask, seed=s).choices[0].text for s in (7, -7)]
    with start(tiny, es.QuantizedDraft(8), engine={"num_draft_tokens": "auto"}) as srv:
        c = client(srv)
        for seed, want in zip((7, -7), plain, strict=True):
            texts = {c.completions.create(**ask, seed=seed).choices[0].text for _ in range(3)}
            assert texts == {want}, seed
    assert plain[0] != plain[1]  # a negative seed is a seed of its own


def test_echo_gives_the_prompt_logprobs(server, tiny):
    c = client(server)
    prompt = tiny.encode("once upon")
    gen = c.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0,
                               logprobs=2)
    token, lp = gen.choices[0].logprobs.tokens[0], gen.choices[0].logprobs.token_logprobs[0]
    whole = prompt + tiny.tokenizer.convert_tokens_to_ids([token])
    for max_tokens in (0, 1):  # lm-evaluation-harness sends one or the other
        r = c.completions.create(model=NAME, prompt=whole, max_tokens=max_tokens, echo=True,
                                 logprobs=1, temperature=0)
        got = r.choices[0].logprobs
        assert r.choices[0].text.startswith(tiny.tokenizer.decode(whole))
        assert len(got.tokens) == len(whole) + max_tokens
        assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
        assert got.token_logprobs[len(whole) - 1] == lp  # the generated token's own float
        assert got.text_offset[: len(whole)] == list(range(len(whole)))
        assert all(len(t) == 1 for t in got.top_logprobs[1:])
    logits = tiny.model(torch.tensor([whole])).logits[0, :-1].float().log_softmax(-1)
    want = logits.gather(-1, torch.tensor(whole[1:])[:, None])[:, 0].tolist()
    assert got.token_logprobs[1: len(whole)] == pytest.approx(want, abs=1e-5)


def test_models_retrieve_and_tokenize(server, tiny):
    c = client(server)
    assert c.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("nope")
    t = httpx.post(server.url + "/tokenize", json={"model": NAME, "prompt": "abc"}).json()
    assert t["tokens"] == tiny.encode("abc") and t["count"] == len(t["tokens"])
    d = httpx.post(server.url + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == tiny.tokenizer.decode(t["tokens"])
    assert httpx.post(server.url + "/detokenize", json={"tokens": [10**6]}).status_code == 400


def _byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: one token per byte (a character may span tokens)."""
    vocab = {ch: b for ch, b in byte_decoder().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_token_bytes_and_no_half_characters():
    tok = _byte_tokenizer()
    ids = tok("é!", add_special_tokens=False)["input_ids"]  # C3 A9 21
    assert [token_bytes(tok, t) for t in ids] == [b"\xc3", b"\xa9", b"!"]
    row = RowText(tok, [])
    assert row.push(ids[:1], finished=False, cut=None) == ""  # half of é waits
    assert row.push(ids[1:2], finished=False, cut=None) == "é"
    assert drop_partial(tok, ids[:1], tok.decode(ids[:1])) == ""  # at the end: dropped
