"""LangChain's `with_structured_output` (json_schema, function_calling, json_mode) and
`bind_tools(tool_choice=name)`, and litellm's JSON mode, against the server (issue 38), with
and without a drafter. Skipped where langchain-openai or litellm is not installed (they are
not dependencies of exactspec: `pip install langchain-openai litellm`)."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest

from tests.serve.conftest import NAME
from tests.serve.test_structured import DIGIT, MSG, SHIRT, jmodel, jserver  # noqa: F401

pydantic = pytest.importorskip("pydantic")


class Shirt(pydantic.BaseModel):
    """A shirt."""

    ok: bool
    size: Literal["s", "m", "l"]


def chat_model(srv, **kw):
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(model=NAME, base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                         max_tokens=60, timeout=60, **{"seed": 1, **kw})


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(jserver, method):  # noqa: F811
    """strict=True: the schema says additionalProperties false; without it JSON Schema lets a
    model add properties, which a random model does."""
    out = chat_model(jserver).with_structured_output(Shirt, method=method,
                                                     strict=True).invoke("a shirt")
    assert isinstance(out, Shirt)


def test_langchain_json_mode(jserver):  # noqa: F811
    """json_mode asks for any JSON object (the schema is only the prompt's business): seed 3
    writes one within 60 tokens after this prompt on this model (a random one's objects run
    long for most seeds)."""
    out = chat_model(jserver, seed=3).with_structured_output(method="json_mode").invoke(
        "a shirt")
    assert isinstance(out, dict)


def test_langchain_bind_tools_named(jserver):  # noqa: F811
    msg = chat_model(jserver).bind_tools([Shirt], tool_choice="Shirt", strict=True).invoke("a shirt")
    (call,) = msg.tool_calls
    assert call["name"] == "Shirt" and Shirt(**call["args"])


def test_litellm_json_mode(jserver):  # noqa: F811
    litellm = pytest.importorskip("litellm")
    kw = dict(model=f"openai/{NAME}", api_base=jserver.url + "/v1", api_key="unused",
              messages=MSG, max_tokens=60, seed=1)
    r = litellm.completion(**kw, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = litellm.completion(**kw, response_format={
        "type": "json_schema", "json_schema": {"name": "digit", "schema": DIGIT}})
    jsonschema.validate(json.loads(r.choices[0].message.content), DIGIT)
    assert SHIRT  # the module's other schema, used by the LangChain tests through Shirt
