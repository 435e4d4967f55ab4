"""Chat messages: validated and rendered into the prompt's token ids.

Roles system, developer (as system), user, assistant and tool. An assistant message may carry
`tool_calls` (its content then null) and a tool message the call's result (`tool_call_id`):
both go through the tokenizer's chat template. A template that does not mention `tool_calls`
would drop the calls silently, so for such a template the calls are written into the assistant
message's content as JSON ({"name", "arguments"} per call, one per line). A history the
template cannot render (it raises, e.g. on roles that do not alternate) is a 400 with the
template's own message. Without a template the contents are joined by newlines.
"""

from __future__ import annotations

import json

from exactspec.models.loading import Model
from exactspec.serve.fields import bad, check_size, utf8_size

ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_text(model: Model, messages: list[dict],
              tools: list | None = None) -> tuple[str, bool]:
    """The text a chat is encoded from, and whether it was templated (no BOS added then).

    One user message goes through `Model.apply_chat`, exactly as `exactspec generate` does;
    longer conversations through the tokenizer's chat template. Without a template the
    contents are joined by newlines. `tools` (a forced tool call's) go to a template that
    reads them.
    """
    if not model.has_chat_template:
        return "\n".join(m["content"] or "" for m in messages), False
    template = getattr(model.tokenizer, "chat_template", None)
    tools = tools if tools and isinstance(template, str) and "tools" in template else None
    if len(messages) == 1 and messages[0]["role"] == "user" and tools is None:
        return model.apply_chat(messages[0]["content"]), True
    assert model.tokenizer is not None
    try:
        text = model.tokenizer.apply_chat_template(messages, tokenize=False, tools=tools,
                                                   add_generation_prompt=True)
    except Exception as exc:  # jinja's TemplateError (raise_exception) or a template bug
        raise bad(f"this model's chat template cannot render these messages: {exc}; send a "
                  "history it accepts (e.g. alternating user and assistant turns)",
                  "messages") from None
    assert isinstance(text, str), type(text)
    return text, True


def chat_prompt(body: dict, model: Model, max_bytes: int | None,
                tools: list | None = None) -> list[list[int]]:
    """The prompt's token ids ([one prompt]) from the body's `messages` (and the `tools` of a
    forced call, for a template that shows them); 400 naming the bad message and field."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    if model.tokenizer is None:
        raise bad("this model has no tokenizer, so it cannot take chat messages; use "
                  "/v1/completions with token ids", "messages")
    template = getattr(model.tokenizer, "chat_template", None) or ""
    calls_in_template = isinstance(template, str) and "tool_calls" in template
    clean, size = [], 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"'{where}' must be an object with 'role' and 'content'", where)
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"'{where}.role'={role!r} must be one of {', '.join(ROLES)}",
                      f"{where}.role")
        calls = _tool_calls(m, where) if role == "assistant" else None
        content = _content(m.get("content"), where, nullable=bool(calls))
        size += utf8_size(content, f"{where}.content")
        out = {"role": "system" if role == "developer" else role, "content": content}
        if calls:
            size += utf8_size(json.dumps(calls), f"{where}.tool_calls")
            if calls_in_template:
                out["tool_calls"] = calls
            else:  # the template would drop them: written into the content
                lines = [json.dumps({"name": c["function"]["name"],
                                     "arguments": c["function"]["arguments"]}) for c in calls]
                out["content"] = "\n".join(filter(None, [content, *lines]))
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(m.get(key), str):
                    out[key] = m[key]
        clean.append(out)
    check_size(size, max_bytes, "messages", model)
    text, templated = chat_text(model, clean, tools)
    ids = list(model.tokenizer(text, add_special_tokens=not templated)["input_ids"])
    if not ids:
        raise bad("'messages' encode to no tokens", "messages")
    return [ids]


def _content(content: object, where: str, *, nullable: bool) -> str:
    """A message's text: a string, text content parts joined, or "" when null is allowed
    (an assistant message that carries tool calls)."""
    if content is None and nullable:
        return ""
    if isinstance(content, list):  # content parts: only text is understood
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad(f"'{where}.content' parts must be {{'type': 'text', 'text': ...}}; "
                          "this server handles text only", f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    if not isinstance(content, str):
        raise bad(f"'{where}.content' must be a string (null only for an assistant message "
                  "with 'tool_calls')", f"{where}.content")
    return content


def _tool_calls(m: dict, where: str) -> list[dict] | None:
    """An assistant message's tool calls, as chat templates take them (arguments parsed from
    their JSON string into an object where they are one, as transformers documents)."""
    calls = m.get("tool_calls")
    if calls in (None, []):
        return None
    bad_calls = bad(f"'{where}.tool_calls' must be a list of {{'id', 'type': 'function', "
                    "'function': {'name', 'arguments'}}} objects", f"{where}.tool_calls")
    if not isinstance(calls, list):
        raise bad_calls
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", ""), str | dict):
            raise bad_calls
        args = fn.get("arguments", "")
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args else {}
            except ValueError:
                parsed = args
            args = parsed if isinstance(parsed, dict) else args
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out
