"""The OpenAI request bodies, validated into `RequestSpec` before anything reaches the engine.

A bad field raises `ApiError` (HTTP 400, OpenAI's error body naming the field); nothing about
a rejected request is ever queued. Fields follow OpenAI's chat and text completion APIs, plus
vLLM's top-level extensions `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`min_tokens` (0 only), `logprobs_mode` and `guided_json` / `guided_regex` / `guided_choice`.
A field whose value means "off" (`NOOPS`: e.g. `store: false`, `best_of: 1`) is accepted and
changes nothing; any other value of it is refused by name. `response_format`, `tools` and
`tool_choice` are structured.py's: a grammar for the rows (or nothing, for "text" / "none").
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from exactspec.models.loading import Model
from exactspec.sampling import SamplingParams
from exactspec.sampling.grammar import Grammar
from exactspec.serve.fields import (
    ApiError,
    bad,
    bool_field,
    check_size,
    float_field,
    int_field,
    is_id,
    is_int,
    is_number,
    utf8_size,
)
from exactspec.serve.messages import chat_prompt, chat_text
from exactspec.serve.structured import GUIDED, ForcedTool, structured

__all__ = ["ApiError", "RequestSpec", "bad", "chat_text", "parse_request", "prompt_byte_limit"]

INT64 = 1 << 63  # seeds are any signed 64-bit integer, as OpenAI and vLLM take them
MAX_N = 128  # choices per request (OpenAI's limit)
MAX_TOP_LOGPROBS_CHAT = 20  # OpenAI's limit for chat top_logprobs
MAX_LOGPROBS_TEXT = 5  # OpenAI's limit for text completions' logprobs
MAX_STOP = 64  # stop strings per request (OpenAI caps at 4; each is searched at every step)
MAX_STOP_CHARS = 1024  # characters per stop string
DEFAULT_MAX_TOKENS_TEXT = 16  # OpenAI's default for /v1/completions
# vLLM's logprobs_mode values this server serves -> the engine's (exactspec.engine: "raw" is the
# model's own law before any sampling transform, "processed" the law each token was drawn from)
LOGPROBS_MODES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}
# Fields that have a value meaning "off": that value is accepted (and changes nothing), any
# other is refused by name. `tools` / `tool_choice` / `parallel_tool_calls` are `_tools`'.
NOOPS = {
    "store": (lambda v: v is False, "false"),
    "best_of": (lambda v: v == 1 and is_int(v), "1"),
    "suffix": (lambda v: v == "", '""'),
    "functions": (lambda v: v == [], "[]"),
    "function_call": (lambda v: v == "none", '"none"'),
    "service_tier": (lambda v: v in ("auto", "default"), '"auto"'),
    "modalities": (lambda v: v == ["text"], '["text"]'),
    "metadata": (lambda v: v == {}, "{}"),
    "min_tokens": (lambda v: v == 0 and is_int(v), "0"),
    "prediction": (lambda v: False, "null"),
    "audio": (lambda v: False, "null"),
    "web_search_options": (lambda v: False, "null"),
}
WHY = {  # what a refused value of a NOOPS field would need, said in its 400
    "best_of": "it returns every sample it draws: ask for n choices instead",
    "min_tokens": ("masking EOS for the first N tokens is not served: it must be a "
                   "standardizing transform of p and q alike to stay exact"),
}
CHAT_ONLY = ("messages", "max_completion_tokens", "top_logprobs", "tools",
             "tool_choice", "parallel_tool_calls", "functions", "function_call", "modalities",
             "audio", "prediction", "web_search_options", "reasoning_effort")
# Fields we know but do not implement at all: refused by name rather than silently ignored.
UNSUPPORTED = ("reasoning_effort",)
# The fields each endpoint implements (`user` is an opaque client id: it changes nothing).
# Any other field is refused by name, as OpenAI does ("Unknown parameter"), never ignored.
_COMMON = ("model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream",
           "stream_options", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
           "user", "store", "metadata", "service_tier",
           "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens",
           "logprobs_mode", "response_format", *GUIDED)  # top_k.., guided_*: vLLM's
KNOWN = {"chat": frozenset((*_COMMON, *CHAT_ONLY)),
         "text": frozenset((*_COMMON, "prompt", "echo", "best_of", "suffix"))}


@dataclass
class RequestSpec:
    """One validated completion request: its rows (choices) and how to decode and answer them."""

    kind: str  # "chat" | "text"
    model: str  # the served model's name, echoed in the response
    prompts: list[list[int]]  # token ids per prompt (chat: exactly one)
    n: int  # choices per prompt; choice i * n + j is prompt i's j-th sample
    params: SamplingParams  # every row's sampling parameters (their seed: None, see `seed`)
    seeded: bool  # whether the client chose the seed (otherwise a fresh one was drawn)
    max_tokens: int  # per choice (0: only with echo, the prompt's logprobs alone)
    seed: int = 0  # the rows' stream seed: any signed 64-bit integer (RowStreams.from_seed)
    stop: list[str] = field(default_factory=list)  # strings that end a choice (text cut before)
    stream: bool = False  # answer as server-sent events
    include_usage: bool = False  # streams: a last chunk with usage
    logprobs: bool = False  # return log p of each token
    top_logprobs: int = 0  # and the k most likely tokens at each position
    logprobs_mode: str | None = None  # "raw" | "processed"; None: the server's default
    echo: bool = False  # text completions: the prompt before each choice's text (and its
    # logprobs, every prompt token after the first, when logprobs are asked)
    echo_texts: list[str] = field(default_factory=list)  # per prompt, the text echoed
    ignore_eos: bool = False  # vLLM's: EOS does not end a choice (budget or stop strings do)
    grammar: Grammar | None = None  # every row's output restricted to it (structured.py)
    tool: ForcedTool | None = None  # the output is this forced tool call's JSON

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
    for key in body:
        if key not in KNOWN[kind] and key not in UNSUPPORTED:
            raise ApiError(400, f"Unknown parameter: '{key}'. This server does not implement "
                           "it; remove it (see the README's Server section for the fields "
                           "it takes)", param=key, code="unknown_parameter")
    _noops(body)
    if kind == "chat":
        _tools(body)
    shape = structured(body, kind)
    tools = body.get("tools") if shape.tool is not None else None  # shown to the template
    prompts = (chat_prompt(body, model, max_prompt_bytes, tools) if kind == "chat"
               else _text_prompts(body, model, max_prompt_bytes))
    echo = kind == "text" and bool_field(body, "echo", False)
    n = int_field(body, "n", 1, 1, MAX_N)
    stream = bool_field(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
        if not isinstance(opts, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        include_usage = bool_field(opts, "include_usage", False, "stream_options.include_usage")
    if echo and stream:
        raise bad("'echo' is served without 'stream' only; send stream: false", "echo")
    logprobs, top = _logprobs(body, kind)
    mode = body.get("logprobs_mode")
    if mode is not None and mode not in LOGPROBS_MODES:
        raise bad(f"'logprobs_mode'={mode!r} must be one of {', '.join(LOGPROBS_MODES)} "
                  "(the model's own law, or the law each token was drawn from)",
                  "logprobs_mode")
    stop = _stop(body)
    params, seeded, seed = _params(body, model.vocab_size)
    longest = max(map(len, prompts))
    room = model.max_context - longest
    if room < 1:
        raise bad(f"the prompt has {longest} tokens; this model's context is "
                  f"{model.max_context} tokens, so it takes at most {model.max_context - 1}",
                  "messages" if kind == "chat" else "prompt")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    default = DEFAULT_MAX_TOKENS_TEXT if kind == "text" else min(room, max_tokens_cap)
    if not echo and body.get(key) == 0:
        raise bad(f"'{key}'=0 is only served with 'echo': true (the prompt's logprobs alone); "
                  "ask for at least 1 token", key)
    max_tokens = int_field(body, key, default, 0, None)
    if max_tokens > room:
        raise bad(f"'{key}'={max_tokens} plus the prompt's {longest} tokens exceeds the model's "
                  f"context of {model.max_context} tokens; ask for at most {room}", key)
    texts = _echo_texts(body["prompt"], prompts, model) if echo else []
    return RequestSpec(kind=kind, model=name, prompts=prompts, n=n, params=params,
                       seeded=seeded, max_tokens=max_tokens, seed=seed, stop=stop,
                       stream=stream, include_usage=include_usage, logprobs=logprobs,
                       top_logprobs=top, logprobs_mode=LOGPROBS_MODES.get(mode), echo=echo,
                       echo_texts=texts, ignore_eos=bool_field(body, "ignore_eos", False),
                       grammar=shape.grammar, tool=shape.tool)


def _echo_texts(given, prompts: list[list[int]], model: Model) -> list[str]:
    """What echo puts before each prompt's choices: the client's own string, or its token
    ids decoded (special tokens shown, as the logprobs' tokens are)."""
    items = given if isinstance(given, list) and not all(is_id(t) for t in given) else [given]
    return [p if isinstance(p, str) else
            model.tokenizer.decode(ids) if model.tokenizer is not None else ""
            for p, ids in zip(items, prompts, strict=True)]


def _noops(body: dict) -> None:
    """A field of `NOOPS` takes its "off" value only (accepted, nothing changes)."""
    for key, (is_noop, value) in NOOPS.items():
        given = body.get(key)
        if given is not None and not is_noop(given):
            why = WHY.get(key, "this server does not implement it")
            raise bad(f"'{key}'={given!r} is not supported: {why}; send {value} or leave it "
                      "out", key)


def _tools(body: dict) -> None:
    """`parallel_tool_calls` (true or false) changes nothing: a forced call is one call.
    `tools` and `tool_choice` are structured.py's (a forced call's grammar, or ignored with
    "none")."""
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad(f"'parallel_tool_calls'={parallel!r} must be true or false",
                  "parallel_tool_calls")


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


def _text_prompts(body: dict, model: Model, max_bytes: int | None) -> list[list[int]]:
    prompt = body.get("prompt")
    single_ids = isinstance(prompt, list) and bool(prompt) and all(is_id(t) for t in prompt)
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
            check_size(utf8_size(p, f"prompt[{i}]"), max_bytes, "prompt", model)
            ids = model.encode(p)
        elif isinstance(p, list) and p and all(is_id(t) for t in p):
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
        want = bool_field(body, "logprobs", False)
        top = int_field(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS_CHAT)
        if top and not want:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return want, top
    value = body.get("logprobs")
    if value is None:
        return False, 0
    top = int_field(body, "logprobs", 0, 0, MAX_LOGPROBS_TEXT)
    return True, top


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP or max(map(len, stops), default=0) > MAX_STOP_CHARS:
        raise bad(f"'stop' takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} "
                  f"characters each, got {len(stops)} (the longest "
                  f"{max(map(len, stops), default=0)})", "stop")
    for s in stops:
        utf8_size(s, "stop")
    return list(dict.fromkeys(stops))


def _params(body: dict, vocab: int) -> tuple[SamplingParams, bool, int]:
    """SamplingParams from the body, whether the seed was the client's, and the seed."""
    temperature = float_field(body, "temperature", 1.0, 0.0, 2.0)
    top_p = float_field(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise bad("'top_p' must be in (0, 1]", "top_p")
    top_k = body.get("top_k", 0)
    if top_k == -1:  # vLLM spells "off" as -1
        top_k = 0
    top_k = int_field({"top_k": top_k}, "top_k", 0, 0, None)
    min_p = float_field(body, "min_p", 0.0, 0.0, 1.0)
    rep = float_field(body, "repetition_penalty", 1.0, 0.0, None)
    if rep == 0.0:
        raise bad("'repetition_penalty' must be > 0 (1.0 = off)", "repetition_penalty")
    presence = float_field(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = float_field(body, "frequency_penalty", 0.0, -2.0, 2.0)
    bias = _logit_bias(body, vocab)
    seed = body.get("seed")
    seeded = seed is not None
    if seeded and (not is_int(seed) or not -INT64 <= seed < INT64):
        raise bad(f"'seed'={seed!r} must be a signed 64-bit integer, in [-2**63, 2**63)",
                  "seed")
    if not seeded:
        seed = secrets.randbits(63)
    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repetition_penalty=rep, presence_penalty=presence,
                                frequency_penalty=frequency, logit_bias=bias)
    except ValueError as exc:  # every field was checked above; keep the message if not
        raise bad(str(exc), None) from exc
    return params, seeded, int(seed)


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
        if not 0 <= tok < vocab or not is_number(value) or not -100 <= value <= 100:
            raise bad(f"'logit_bias[{key}]'={value!r}: keys are token ids in [0, {vocab}), "
                      "values numbers in [-100, 100]", "logit_bias")
        out[tok] = float(value)
    return out or None
