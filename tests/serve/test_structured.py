"""Structured output and forced tool calls through the official `openai` SDK (issue 38):
`response_format` json_object / json_schema, `tool_choice` named or "required", vLLM's guided_*
extras, streaming and not, with and without a drafter; every reply parses and validates against
its schema. A tiny random Llama over a character tokenizer that spells JSON (no whitespace
token, so the JSON is compact and short) keeps them fast; its schemas are small enums and
booleans. The conversions of structured.py and the 400s are tested alone."""

from __future__ import annotations

import json
import string
from typing import Literal

import httpx
import jsonschema
import pytest
from transformers import PreTrainedTokenizerFast

import exactspec as es
from exactspec.models.loading import Model
from exactspec.serve.fields import ApiError
from exactspec.serve.structured import ForcedTool, structured, tool_call_reply
from tests.engine.tiny import char_tokenizer, tiny_llama
from tests.serve.conftest import NAME, client, start

openai = pytest.importorskip("openai")

ALPHA = string.ascii_lowercase + string.digits + '{}[]":,-_' + "ABC"  # 48 symbols, no space
MSG = [{"role": "user", "content": "hi"}]
SHIRT = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                          "size": {"enum": ["s", "m", "l"]}},
         "required": ["ok", "size"], "additionalProperties": False}
DIGIT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["n"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "shirt", "parameters": SHIRT}},
         {"type": "function", "function": {"name": "digit", "parameters": DIGIT}}]
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "shirt", "schema": SHIRT,
                                                        "strict": True}}


def json_tokenizer() -> PreTrainedTokenizerFast:
    return char_tokenizer(ALPHA)


@pytest.fixture(scope="module")
def jmodel() -> Model:
    return Model(model=tiny_llama(0, eos=0), tokenizer=json_tokenizer(), name="tiny-json")


@pytest.fixture(scope="module", params=["plain", "quantized", "lookup"])
def jserver(request, jmodel):
    drafter = {"plain": None, "quantized": es.QuantizedDraft(8),
               "lookup": es.PromptLookup()}[request.param]
    with start(jmodel, drafter) as srv:
        yield srv


def ask(srv, stream: bool, seed: int, **kw):
    """A chat completion; a stream is gathered into (content, tool_calls, finish_reason)."""
    c = client(srv)
    if not stream:
        ch = c.chat.completions.create(model=NAME, messages=MSG, max_tokens=40, seed=seed,
                                       **kw).choices[0]
        calls = [(t.id, t.function.name, t.function.arguments)
                 for t in ch.message.tool_calls or []]
        return ch.message.content, calls, ch.finish_reason
    content, calls, reason = None, [], None
    for chunk in c.chat.completions.create(model=NAME, messages=MSG, max_tokens=40, seed=seed,
                                           stream=True, **kw):
        for ch in chunk.choices:
            if ch.delta.content:
                content = (content or "") + ch.delta.content
            for t in ch.delta.tool_calls or []:
                if t.id:
                    calls.append([t.id, t.function.name, ""])
                calls[t.index][2] += t.function.arguments or ""
            reason = ch.finish_reason or reason
    return content, [tuple(c) for c in calls], reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_and_json_object_replies_validate(jserver, stream, seed):
    content, calls, reason = ask(jserver, stream, seed, response_format=SCHEMA_FORMAT)
    assert reason == "stop" and not calls
    jsonschema.validate(json.loads(content), SHIRT)
    content, _, reason = ask(jserver, stream, seed, response_format={"type": "json_object"})
    if reason == "stop":  # a random model's object may run past 40 tokens: then it is cut
        assert isinstance(json.loads(content), dict)
    else:
        assert reason == "length" and content.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", [0, 3])
def test_forced_tool_calls(jserver, stream, seed):
    for choice, names in (({"type": "function", "function": {"name": "digit"}}, {"digit"}),
                          ("required", {"shirt", "digit"})):
        content, calls, reason = ask(jserver, stream, seed, tools=TOOLS, tool_choice=choice)
        assert content is None and reason == "tool_calls" and len(calls) == 1
        call_id, name, arguments = calls[0]
        assert call_id.startswith("call_") and name in names
        jsonschema.validate(json.loads(arguments), SHIRT if name == "shirt" else DIGIT)


def test_greedy_under_a_schema_equals_the_plain_server(jmodel, jserver):
    kw = dict(response_format=SCHEMA_FORMAT, temperature=0)
    with start(jmodel) as plain:
        assert ask(jserver, False, 0, **kw) == ask(plain, False, 0, **kw)


def test_guided_extras_on_text_completions(jserver):
    c = client(jserver)
    for extra, check in (({"guided_regex": "[0-9]{3}"}, lambda t: t.isdigit() and len(t) == 3),
                         ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                         ({"guided_json": DIGIT}, lambda t: json.loads(t)["n"] in range(10))):
        r = c.completions.create(model=NAME, prompt="ab", max_tokens=20, seed=1,
                                 extra_body=extra)
        assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), extra
    r = c.completions.create(model=NAME, prompt="ab", max_tokens=40, seed=1,
                             extra_body={"response_format": SCHEMA_FORMAT})
    jsonschema.validate(json.loads(r.choices[0].text), SHIRT)


def test_sdk_parse_with_a_pydantic_model(jserver):
    pydantic = pytest.importorskip("pydantic")

    class Shirt(pydantic.BaseModel):
        ok: bool
        size: Literal["s", "m", "l"]

    c = client(jserver)
    parse = getattr(c.chat.completions, "parse", None) or c.beta.chat.completions.parse
    r = parse(model=NAME, messages=MSG, max_tokens=40, seed=0, response_format=Shirt)
    assert isinstance(r.choices[0].message.parsed, Shirt)


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format.json_schema.schema", "JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format.json_schema.schema", "schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_object"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS}, "tools", '"auto"'),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "free text"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
      "tool_choice": "required"}, "tools", "schema"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"},
     "tool_choice", "send one"),
])
def test_refusals_name_the_field(jserver, extra, param, words):
    r = httpx.post(jserver.url + "/v1/chat/completions",
                   json={"model": NAME, "messages": MSG, "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_a_tokenizer_that_cannot_write_json_is_a_400_alone(server):
    """The char tokenizer of the shared server has no '{': a 400 for that request, and the
    rows decoding beside it are not failed."""
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, messages=MSG, max_tokens=4,
                                  response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format" and "cannot" in e.value.body["message"]
    assert c.chat.completions.create(model=NAME, messages=MSG, max_tokens=4).choices


def test_conversions():
    assert structured({"response_format": {"type": "text"}}, "chat").grammar is None
    assert structured({"tools": TOOLS, "tool_choice": "none"}, "chat").grammar is None
    s = structured({"response_format": SCHEMA_FORMAT}, "chat")
    assert s.grammar == es.Grammar.json_schema(SHIRT) and s.tool is None
    s = structured({"tools": TOOLS, "tool_choice": {"type": "function",
                                                    "function": {"name": "digit"}}}, "chat")
    assert s.grammar == es.Grammar.json_schema(DIGIT) and s.tool == ForcedTool("digit")
    s = structured({"tools": TOOLS, "tool_choice": "required"}, "chat")
    assert s.tool == ForcedTool(None) and "anyOf" in s.grammar.source
    assert structured({"guided_choice": ["a", "b"]}, "text").grammar == \
        es.Grammar.choice(["a", "b"])
    with pytest.raises(ApiError, match="guided_regex"):
        structured({"guided_regex": 3}, "text")
    msg, reason = tool_call_reply(ForcedTool(None), '{"name": "digit", "arguments": {"n": 1}}',
                                  "stop")
    assert reason == "tool_calls" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "digit", "arguments": '{"n": 1}'}
    assert tool_call_reply(ForcedTool("f"), '{"n', "length")[1] == "length"
    assert tool_call_reply(ForcedTool(None), '{"na', "length") == (
        {"role": "assistant", "content": '{"na'}, "length")


def test_grammars_cross_to_the_engine_process(tmp_path):
    """`exactspec serve` decodes in a child process: the request's Grammar is pickled to it, and
    a grammar its tokenizer cannot write comes back as that request's 400."""
    from tests.batch.tiny_dir import save_tiny
    from tests.serve.test_limits import Serve

    with Serve(save_tiny(tmp_path / "model")) as srv:
        c = client(srv)
        r = c.completions.create(model=NAME, prompt="go", max_tokens=8, seed=2,
                                 extra_body={"guided_regex": "[a-c]{4}"})
        assert r.choices[0].finish_reason == "stop" and len(r.choices[0].text) == 4
        assert set(r.choices[0].text) <= set("abc")
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=NAME, messages=MSG, max_tokens=4,
                                      response_format={"type": "json_object"})
        assert e.value.body["param"] == "response_format"
