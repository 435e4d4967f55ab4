"""The OpenAI request bodies, validated into `RequestSpec` before anything reaches the engine.

A bad field raises `ApiError` (HTTP 400, OpenAI's error body naming the field); nothing about
a rejected request is ever queued. Fields follow OpenAI's chat and text completion APIs, plus
vLLM's top-level extensions `top_k`, `min_p` and `repetition_penalty`.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

from exactspec.models.loading import Model
from exactspec.sampling import SamplingParams

SEED_LIMIT = 1 << 63  # seeds are ints in [0, 2**63), as SamplingParams takes them
MAX_N = 128  # choices per request (OpenAI's limit)
MAX_TOP_LOGPROBS_CHAT = 20  # OpenAI's limit for chat top_logprobs
MAX_LOGPROBS_TEXT = 5  # OpenAI's limit for text completions' logprobs
MAX_STOP = 4  # OpenAI's limit on stop strings
DEFAULT_MAX_TOKENS_TEXT = 16  # OpenAI's default for /v1/completions
# Request fields we know but do not implement: refused by name rather than silently ignored.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format",
               "suffix", "best_of", "prediction", "audio", "modalities", "reasoning_effort",
               "parallel_tool_calls", "web_search_options", "service_tier", "store", "metadata")
# The fields each endpoint implements (`user` is an opaque client id: it changes nothing).
# Any other field is refused by name, as OpenAI does ("Unknown parameter"), never ignored.
_COMMON = ("model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream",
           "stream_options", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
           "user", "top_k", "min_p", "repetition_penalty")  # the last three: vLLM's
KNOWN = {"chat": frozenset((*_COMMON, "messages", "max_completion_tokens", "top_logprobs")),
         "text": frozenset((*_COMMON, "prompt", "echo"))}


class ApiError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status  # HTTP status code
        self.message = message  # what went wrong and how to fix it
        self.param = param  # the request field at fault, if any
        self.type = type  # OpenAI error type
        self.code = code  # OpenAI error code, if any
        self.headers = headers or {}  # extra response headers (Retry-After on 429)

    def __reduce__(self):  # pickled across the engine process's pipe
        return (ApiError, (self.status, self.message), dict(self.__dict__))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass
class RequestSpec:
    """One validated completion request: its rows (choices) and how to decode and answer them."""

    kind: str  # "chat" | "text"
    model: str  # the served model's name, echoed in the response
    prompts: list[list[int]]  # token ids per prompt (chat: exactly one)
    n: int  # choices per prompt; choice i * n + j is prompt i's j-th sample
    params: SamplingParams  # every row's sampling parameters, `seed` = the request's seed
    seeded: bool  # whether the client chose the seed (otherwise a fresh one was drawn)
    max_tokens: int  # per choice
    stop: list[str] = field(default_factory=list)  # strings that end a choice (text cut before)
    stream: bool = False  # answer as server-sent events
    include_usage: bool = False  # streams: a last chunk with usage
    logprobs: bool = False  # return log p of each token
    top_logprobs: int = 0  # and the k most likely tokens at each position

    @property
    def rows(self) -> list[list[int]]:
        """The prompt of each choice, in choice order (what `es.generate` would be given)."""
        return [p for p in self.prompts for _ in range(self.n)]

    @property
    def prompt_tokens(self) -> int:
        """Usage: prompt tokens counted once per prompt, not per choice (as OpenAI does)."""
        return sum(map(len, self.prompts))


def parse_request(body: object, kind: str, model: Model, served_name: str,
                  max_tokens_cap: int, *, max_prompt_bytes: int | None = None) -> RequestSpec:
    """Validate an OpenAI request body (already JSON-decoded) against the served model.

    `max_prompt_bytes` (see `prompt_byte_limit`) refuses a prompt text too long for the
    context before it is tokenized; text that is not valid Unicode (a lone surrogate, which
    JSON's \\ud800 escapes can carry) is refused naming its field.
    """
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None)
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise bad("'model' is required: the served model's id (see GET /v1/models)", "model")
    if name != served_name:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                       f"{served_name!r}", param="model", code="model_not_found")
    for key in UNSUPPORTED:
        if body.get(key) not in (None, [], {}):
            raise bad(f"'{key}' is not supported by this server; remove it", key)
    if body.get("echo"):
        raise bad("'echo' is not supported by this server; remove it", "echo")
    for key in body:
        if key not in KNOWN[kind] and key not in UNSUPPORTED:
            raise ApiError(400, f"Unknown parameter: '{key}'. This server does not implement "
                           "it; remove it (see the README's Server section for the fields "
                           "it takes)", param=key, code="unknown_parameter")
    prompts = (_chat_prompt(body, model, max_prompt_bytes) if kind == "chat"
               else _text_prompts(body, model, max_prompt_bytes))
    n = _int(body, "n", 1, 1, MAX_N)
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
        if not isinstance(opts, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        include_usage = _bool(opts, "include_usage", False, "stream_options.include_usage")
    logprobs, top = _logprobs(body, kind)
    stop = _stop(body)
    params = _params(body, model.vocab_size)
    longest = max(map(len, prompts))
    room = model.max_context - longest
    if room < 1:
        raise bad(f"the prompt has {longest} tokens; this model's context is "
                  f"{model.max_context} tokens, so it takes at most {model.max_context - 1}",
                  "messages" if kind == "chat" else "prompt")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    default = DEFAULT_MAX_TOKENS_TEXT if kind == "text" else min(room, max_tokens_cap)
    max_tokens = _int(body, key, default, 1, None)
    if max_tokens > room:
        raise bad(f"'{key}'={max_tokens} plus the prompt's {longest} tokens exceeds the model's "
                  f"context of {model.max_context} tokens; ask for at most {room}", key)
    return RequestSpec(kind=kind, model=name, prompts=prompts, n=n, params=params[0],
                       seeded=params[1], max_tokens=max_tokens, stop=stop, stream=stream,
                       include_usage=include_usage, logprobs=logprobs, top_logprobs=top)


def chat_text(model: Model, messages: list[dict]) -> tuple[str, bool]:
    """The text a chat is encoded from, and whether it was templated (no BOS added then).

    One user message goes through `Model.apply_chat`, exactly as `exactspec generate` does;
    longer conversations through the tokenizer's chat template. Without a template the
    contents are joined by newlines.
    """
    if not model.has_chat_template:
        return "\n".join(m["content"] for m in messages), False
    if len(messages) == 1 and messages[0]["role"] == "user":
        return model.apply_chat(messages[0]["content"]), True
    assert model.tokenizer is not None
    text = model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str), type(text)
    return text, True


def prompt_byte_limit(model: Model, factor: int = 2) -> int | None:
    """The longest prompt text, in UTF-8 bytes, that could fit the context: `factor` times the
    context times the tokenizer's longest token (in bytes of its vocabulary string). No token
    covers more bytes than that, so a longer text has more tokens than the context holds and
    is refused before tokenizing it; `factor` leaves room for normalizers that shorten text.
    None without a tokenizer (prompts are token ids, bounded by the body size)."""
    tok = model.tokenizer
    if tok is None:
        return None
    vocab = tok.get_vocab()
    # a vocabulary string's own length only bounds what it covers from above (byte-level
    # BPE spells a byte as one or two characters); the longest ones decode to what they cover
    longest = sorted(vocab, key=lambda t: len(t.encode("utf-8", "replace")))[-64:]
    covered = max((len(tok.convert_tokens_to_string([t]).encode("utf-8", "replace"))
                   for t in longest), default=1)
    shorter = len(longest[0].encode("utf-8", "replace")) if len(vocab) > len(longest) else 0
    return factor * max(covered, shorter, 1) * model.max_context


def _utf8_size(text: str, where: str) -> int:
    """The UTF-8 length of `text`; 400 naming `where` if it holds a lone surrogate."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise bad(f"'{where}' holds {text[exc.start]!r} at character {exc.start}, a lone UTF-16 "
                  "surrogate that is no Unicode character; send valid UTF-8 text (a "
                  "surrogate pair for characters beyond U+FFFF)", where) from None


def _check_size(size: int, limit: int | None, where: str, model: Model) -> None:
    if limit is not None and size > limit:
        raise bad(f"'{where}' is {size} bytes of text, more than this model's context of "
                  f"{model.max_context} tokens can hold (at most {limit} bytes, from the "
                  "tokenizer's longest token); send a shorter prompt", where)


def _chat_prompt(body: dict, model: Model, max_bytes: int | None) -> list[list[int]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    clean, size = [], 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"'{where}' must be an object with 'role' and 'content'", where)
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad(f"'{where}.role'={role!r} must be one of system, developer, user, "
                      "assistant", f"{where}.role")
        if isinstance(content, list):  # content parts: only text is understood
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise bad(f"'{where}.content' parts must be {{'type': 'text', 'text': ...}}; "
                              "this server handles text only", f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad(f"'{where}.content' must be a string", f"{where}.content")
        size += _utf8_size(content, f"{where}.content")
        clean.append({"role": "system" if role == "developer" else role, "content": content})
    if model.tokenizer is None:
        raise bad("this model has no tokenizer, so it cannot take chat messages; use "
                  "/v1/completions with token ids", "messages")
    _check_size(size, max_bytes, "messages", model)
    text, templated = chat_text(model, clean)
    ids = list(model.tokenizer(text, add_special_tokens=not templated)["input_ids"])
    if not ids:
        raise bad("'messages' encode to no tokens", "messages")
    return [ids]


def _text_prompts(body: dict, model: Model, max_bytes: int | None) -> list[list[int]]:
    prompt = body.get("prompt")
    single_ids = isinstance(prompt, list) and bool(prompt) and all(_is_id(t) for t in prompt)
    if isinstance(prompt, str) or single_ids:
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad("'prompt' must be a string, a list of strings, a list of token ids or a list "
                  "of token-id lists", "prompt")
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            if not p:
                raise bad(f"'prompt[{i}]' is empty", "prompt")
            if model.tokenizer is None:
                raise bad("this model has no tokenizer; send token ids", "prompt")
            _check_size(_utf8_size(p, f"prompt[{i}]"), max_bytes, "prompt", model)
            ids = model.encode(p)
        elif isinstance(p, list) and p and all(_is_id(t) for t in p):
            ids = list(p)
            if max(ids) >= model.vocab_size:
                raise bad(f"'prompt[{i}]' has token id {max(ids)}, outside the vocabulary "
                          f"[0, {model.vocab_size})", "prompt")
        else:
            raise bad(f"'prompt[{i}]' must be a non-empty string or list of token ids", "prompt")
        if not ids:
            raise bad(f"'prompt[{i}]' encodes to no tokens", "prompt")
        out.append(ids)
    return out


def _logprobs(body: dict, kind: str) -> tuple[bool, int]:
    if kind == "chat":
        want = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS_CHAT)
        if top and not want:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return want, top
    value = body.get("logprobs")
    if value is None:
        return False, 0
    top = _int(body, "logprobs", 0, 0, MAX_LOGPROBS_TEXT)
    return True, top


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP:
        raise bad(f"'stop' takes at most {MAX_STOP} strings, got {len(stops)}", "stop")
    for s in stops:
        _utf8_size(s, "stop")
    return list(dict.fromkeys(stops))


def _params(body: dict, vocab: int) -> tuple[SamplingParams, bool]:
    """SamplingParams from the body, and whether the seed was the client's."""
    temperature = _float(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _float(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise bad("'top_p' must be in (0, 1]", "top_p")
    top_k = body.get("top_k", 0)
    if top_k == -1:  # vLLM spells "off" as -1
        top_k = 0
    top_k = _int({"top_k": top_k}, "top_k", 0, 0, None)
    min_p = _float(body, "min_p", 0.0, 0.0, 1.0)
    rep = _float(body, "repetition_penalty", 1.0, 0.0, None)
    if rep == 0.0:
        raise bad("'repetition_penalty' must be > 0 (1.0 = off)", "repetition_penalty")
    presence = _float(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = _float(body, "frequency_penalty", 0.0, -2.0, 2.0)
    bias = _logit_bias(body, vocab)
    seed = body.get("seed")
    seeded = seed is not None
    if seeded and (not _is_int(seed) or not 0 <= seed < SEED_LIMIT):
        raise bad(f"'seed'={seed!r} must be an integer in [0, 2**63)", "seed")
    if not seeded:
        seed = secrets.randbits(63)
    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repetition_penalty=rep, presence_penalty=presence,
                                frequency_penalty=frequency, logit_bias=bias, seed=int(seed))
    except ValueError as exc:  # every field was checked above; keep the message if not
        raise bad(str(exc), None) from exc
    return params, seeded


def _logit_bias(body: dict, vocab: int) -> dict[int, float] | None:
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise bad("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            raise bad(f"'logit_bias' key {key!r} must be a token id", "logit_bias") from None
        if not 0 <= tok < vocab or not _is_number(value) or not -100 <= value <= 100:
            raise bad(f"'logit_bias[{key}]'={value!r}: keys are token ids in [0, {vocab}), "
                      "values numbers in [-100, 100]", "logit_bias")
        out[tok] = float(value)
    return out or None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_id(v: object) -> bool:
    return _is_int(v) and v >= 0  # type: ignore[operator]


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _int(body: dict, key: str, default: int, low: int, high: int | None) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad(f"'{key}'={value!r} must be an integer {span}", key)
    return value


def _float(body: dict, key: str, default: float, low: float, high: float | None) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not _is_number(value) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad(f"'{key}'={value!r} must be a number {span}", key)
    return float(value)


def _bool(body: dict, key: str, default: bool, name: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name or key}'={value!r} must be true or false", name or key)
    return value
