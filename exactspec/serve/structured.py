"""Structured output and forced tool calls: an OpenAI request's fields turned into a `Grammar`.

Pure functions over the JSON body. `response_format` {"type": "json_object"} is any JSON
object, {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} a value valid
under the schema; vLLM's extras `guided_json` / `guided_regex` / `guided_choice` are served the
same way. `tools` with a forced `tool_choice` is a grammar for the call: a named tool's call is
its arguments, a JSON object valid under the tool's `parameters`; "required" is one object
{"name": a tool's name, "arguments": that tool's parameters} (anyOf over the tools).
`tool_choice: "auto"` with tools is refused: deciding whether to call a tool is the model's
free-text choice, and parsing calls out of free text is not done. The grammar's mask is one
more standardizing transform of p and q alike (docs/generate.md), so the output stays exactly
the target's law restricted to the grammar. A bad schema or a wrong tool is a 400 naming the
field.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from exactspec.engine.arguments import parse_verify
from exactspec.engine.grammar import GrammarRows
from exactspec.errors import InvalidType, InvalidValue
from exactspec.sampling import LossyRule
from exactspec.sampling.grammar import Grammar
from exactspec.serve.fields import bad

__all__ = ["GUIDED", "ForcedTool", "Structured", "structured", "tool_call_reply"]

GUIDED = ("guided_json", "guided_regex", "guided_choice")  # vLLM's extras, both endpoints
_FORMATS = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class ForcedTool:
    """A tool call the request forces (crosses to the engine process with the spec)."""

    name: str | None  # the named tool; None for "required" (the output names it)


@dataclass(frozen=True)
class Structured:
    """What a request's output is restricted to, and whether it is a tool call."""

    grammar: Grammar | None = None  # the rows' grammar; None: free text
    tool: ForcedTool | None = None  # set when the output is a tool call's JSON


def structured(body: dict, kind: str) -> Structured:
    """The grammar (and forced tool) of a request body; 400 naming the field on a bad value.
    At most one source of structure per request (response_format, a forced tool or a guided_*
    extra)."""
    found: list[tuple[str, Structured]] = []
    rf = response_format(body.get("response_format"))
    if rf is not None:
        found.append(("response_format", Structured(rf)))
    if kind == "chat":
        tool = tool_grammar(body.get("tools"), body.get("tool_choice"))
        if tool.grammar is not None:
            found.append(("tool_choice", tool))
    for key in GUIDED:
        if body.get(key) is not None:
            found.append((key, Structured(_guided(key, body[key]))))
    if len(found) > 1:
        names = ", ".join(f"'{k}'" for k, _ in found)
        raise bad(f"{names} each restrict the output; send one of them", found[1][0])
    return found[0][1] if found else Structured()


def response_format(value: object) -> Grammar | None:
    """OpenAI's `response_format` as a Grammar; None for {"type": "text"} or no value."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in _FORMATS:
        raise bad(f"'response_format'={_short(value)} must be an object whose 'type' is one "
                  f"of {', '.join(_FORMATS)}", "response_format")
    kind = value["type"]
    extra = set(value) - {"type", "json_schema"}
    if extra or (kind != "json_schema" and "json_schema" in value):
        raise bad(f"'response_format' has unknown fields {sorted(extra or {'json_schema'})} for "
                  f"type {kind!r}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad(f"'{where}' must be an object {{\"name\", \"schema\", \"strict\"}}", where)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad(f"'{where}.name' must be a non-empty string", f"{where}.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"'{where}.strict'={strict!r} must be true or false", f"{where}.strict")
    schema = spec.get("schema", {})
    return schema_grammar(schema, f"{where}.schema")


def schema_grammar(schema: object, where: str) -> Grammar:
    """A JSON schema's grammar; 400 naming `where` if it is no schema llguidance takes."""
    if isinstance(schema, bool) or not isinstance(schema, dict):
        raise bad(f"'{where}' must be a JSON schema object, got {_short(schema)}", where)
    try:
        return Grammar.json_schema(schema)
    except (InvalidValue, InvalidType, ValueError) as exc:
        raise bad(f"'{where}' is not a JSON schema this server can follow: {exc}", where) \
            from None


def tool_grammar(tools: object, choice: object) -> Structured:
    """The forced tool call's grammar; Structured() when no call is forced ("none", or no
    tool_choice and no tools)."""
    if tools is not None and not isinstance(tools, list):
        raise bad("'tools' must be a list of tool objects", "tools")
    param = "tool_choice" if choice is not None else "tools"  # absent: OpenAI's "auto"
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return Structured()
    if choice == "auto":
        if not tools:
            return Structured()
        raise bad("'tool_choice'=\"auto\" (the default with 'tools') is not served: this "
                  "server does not parse tool calls out of free text; send tool_choice "
                  "\"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}} "
                  "(the call is then generated under its schema), or \"none\"", param)
    named = _named(choice)
    if not tools:
        raise bad(f"'tool_choice'={_short(choice)} needs 'tools': the list of tools it "
                  "chooses from", "tool_choice")
    schemas = _tool_schemas(tools)
    if named is not None:
        if named not in schemas:
            raise bad(f"'tool_choice' names the tool {named!r}, which is not in 'tools' "
                      f"({', '.join(schemas)})", "tool_choice")
        i = list(schemas).index(named)
        return Structured(schema_grammar(schemas[named], f"tools[{i}].function.parameters"),
                          ForcedTool(named))
    calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": s},
              "required": ["name", "arguments"], "additionalProperties": False}
             for n, s in schemas.items()]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return Structured(schema_grammar(schema, "tools"), ForcedTool(None))


def _named(choice: object) -> str | None:
    """The tool a tool_choice names; None for "required"; 400 for anything else."""
    if choice == "required":
        return None
    if (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        return choice["function"]["name"]
    raise bad(f"'tool_choice'={_short(choice)} must be \"none\", \"auto\", \"required\" or "
              "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def _tool_schemas(tools: list) -> dict[str, dict]:
    """Each tool's name -> its parameters' schema ({"type": "object"} when it has none)."""
    out: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\", "
                      "\"parameters\"}}", f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not name or name in out:
            raise bad(f"'tools[{i}].function.name'={name!r} must be a non-empty string, unique "
                      "among the tools", f"tools[{i}].function.name")
        params = fn.get("parameters")
        out[name] = {"type": "object"} if params is None else params
    return out


def _guided(key: str, value: object) -> Grammar:
    if key == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise bad("'guided_json' must be a JSON schema (an object or its JSON text)",
                          key) from None
        return schema_grammar(value, key)
    try:
        if key == "guided_regex":
            if not isinstance(value, str):
                raise InvalidValue("must be a string")
            return Grammar.regex(value)
        return Grammar.choice(value)  # type: ignore[arg-type]
    except (InvalidValue, InvalidType, ValueError) as exc:
        raise bad(f"'{key}'={_short(value)} is refused: {exc}", key) from None


def tool_call_reply(tool: ForcedTool, text: str, finish_reason: str) -> tuple[dict, str]:
    """A forced tool call's chat message and finish_reason from the generated text.

    A complete call ("stop") is `tool_calls` with content null and finish_reason
    "tool_calls". A call cut by max_tokens keeps finish_reason "length": a named tool's call
    carries the partial arguments; a "required" call that does not parse is left as content.
    """
    name, arguments = tool.name, text
    if tool.name is None:
        try:
            call = json.loads(text)
            name, arguments = call["name"], json.dumps(call["arguments"])
        except (ValueError, KeyError, TypeError):
            return {"role": "assistant", "content": text}, finish_reason
    message = {"role": "assistant", "content": None, "tool_calls": [{
        "id": call_id(), "type": "function",
        "function": {"name": name, "arguments": arguments}}]}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


def grammar_refusal(drafter, verify) -> str:
    """Why an engine with this drafter and verify method cannot serve a grammar exactly (""
    if it can): the engine refuses a grammar with a token-tree drafter or a lossy rule
    (Decoder._check_grammars) when the rows are admitted, with the whole batch."""
    if getattr(drafter, "tree", None) is not None:
        return ("structured output (a grammar) is not served with this server's token-tree "
                "drafter: its verification reads no grammar mask yet; start the server with "
                "a chain drafter or without one")
    if isinstance(parse_verify(verify), LossyRule):  # a user's callable is not known lossy
        return (f"structured output (a grammar) is not served under the lossy --verify "
                f"{verify}: the output would be neither the target's law nor restricted "
                "exactly; use an exact verify method")
    return ""


def first_mask_error(model, grammar: Grammar) -> str:
    """Why `model`'s tokenizer cannot start writing `grammar` ("" if it can): no tokenizer,
    or no token the grammar allows first (JSON with a tokenizer without '{'). Checked before
    admission, since mid-step it would fail every row of the batch."""
    try:
        rows = GrammarRows(model.tokenizer, list(model.eos_token_ids), model.vocab_size)
        rows.mask_of(rows.matcher(grammar).m)
    except (InvalidValue, ValueError) as exc:
        return f"this model cannot write {grammar!r}: {exc}"
    return ""


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _short(value: object, limit: int = 80) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
