"""Requests' answers: events from the engine turned into OpenAI responses and stream chunks.

`collect` waits for a non-streaming answer (watching for a disconnect and the timeout),
`sse` streams one as server-sent events; both cancel the request's rows if they end early.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from exactspec.engine.results import GenerationStats
from exactspec.serve.events import Delta, Failed, Finished, Submission
from exactspec.serve.guard import error_body
from exactspec.serve.protocol import ApiError, RequestSpec
from exactspec.serve.rows import token_bytes, token_strings
from exactspec.serve.structured import call_id, tool_call_reply

POLL_SECONDS = 0.25  # how often a waiting non-streaming handler checks for a disconnect


def error_response(exc: ApiError) -> Response:
    """OpenAI's error body with `exc`'s status and headers (ASCII-escaped: always renders)."""
    return Response(error_body(exc), status_code=exc.status, headers=exc.headers,
                    media_type="application/json")


def timeout_error(spec: RequestSpec, timeout: float) -> ApiError:
    return ApiError(504, f"the request ran past the server's timeout of {timeout:g} s; ask for "
                    f"fewer tokens (max_tokens={spec.max_tokens})", type="timeout_error",
                    code="request_timeout")


class Answer:
    """Accumulates a request's events into OpenAI responses and stream chunks."""

    def __init__(self, spec: RequestSpec, kind: str, config, sub: Submission,
                 lossless: bool = True, verify: str = "token"):
        self.spec, self.kind, self.sub = spec, kind, sub
        self.config = config  # the ServerConfig: drafter_name, request_timeout
        self.lossless = lossless  # False under an opt-in lossy verify rule
        self.verify = verify  # the verify method's name
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        n = len(sub.choices)
        self.finished: list[Finished | None] = [None] * n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.top: list[list[list[tuple[int, float]]]] = [[] for _ in range(n)]
        self.tokenizer = sub_tokenizer(sub)
        self.tool_text = [""] * n  # streams of a forced tool call: the text so far per choice
        self.tool_started = [False] * n  # and whether its id and name were sent

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finished)

    def add(self, ev: Delta | Finished) -> None:
        if isinstance(ev, Delta):
            self.tokens[ev.index] += ev.token_ids
            self.logprobs[ev.index] += ev.logprobs or []
            self.top[ev.index] += ev.top or []
        else:
            self.finished[ev.index] = ev

    def usage(self) -> dict:
        completion = sum(len(f.token_ids) for f in self.finished if f is not None)
        prompt = self.spec.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def extension(self) -> dict:
        """The speculative statistics of the whole request (its choices summed)."""
        stats = [f.stats for f in self.finished if f is not None]
        total = GenerationStats.total(stats)
        return {"drafter": self.config.drafter_name, "verify": self.verify,
                "lossless": self.lossless, "seed": self.spec.seed,
                "seeded": self.spec.seeded, "steps": total.steps, "drafted": total.drafted,
                "accepted": total.accepted, "acceptance_rate": total.acceptance_rate,
                "mean_acceptance_length": total.mean_acceptance_length,
                "accepted_per_position": total.accepted_per_position}

    def _logprobs(self, i: int, start: int, end: int, offset: int = 0) -> dict | None:
        if not self.spec.logprobs:
            return None
        ids = self.tokens[i][start:end]
        strs = token_strings(self.tokenizer, ids)
        lps = self.logprobs[i][start:end]
        tops = self.top[i][start:end] if self.spec.top_logprobs else [[] for _ in ids]
        tok = self.tokenizer
        if self.kind == "chat":
            return {"content": [
                {"token": s, "logprob": lp, "bytes": list(token_bytes(tok, tid)),
                 "top_logprobs": [{"token": tok.decode([t]), "logprob": v,
                                   "bytes": list(token_bytes(tok, t))} for t, v in top]}
                for tid, s, lp, top in zip(ids, strs, lps, tops, strict=True)]}
        return text_logprobs(tok, strs, lps, tops if self.spec.top_logprobs else None, offset)

    def _echo_logprobs(self, i: int, f: Finished, generated: dict | None) -> dict | None:
        """Text logprobs of choice i's prompt tokens (the first: None) then its own tokens,
        offsets counted from the prompt's start."""
        if not self.spec.logprobs:
            return None
        ids = self.spec.prompts[i // self.spec.n]
        strs = token_strings(self.tokenizer, ids)
        top = f.prompt_top if self.spec.top_logprobs else None
        head = text_logprobs(self.tokenizer, strs, f.prompt_logprobs, top, 0)
        if generated is None:
            return head
        shift = len(self.spec.echo_texts[i // self.spec.n])  # where the choice's text starts
        return {"tokens": head["tokens"] + generated["tokens"],
                "token_logprobs": head["token_logprobs"] + generated["token_logprobs"],
                "top_logprobs": (None if top is None else head["top_logprobs"]
                                 + generated["top_logprobs"]),
                "text_offset": head["text_offset"] + [o + shift for o in
                                                      generated["text_offset"]]}

    def response(self) -> dict:
        choices = []
        for i, f in enumerate(self.finished):
            assert f is not None
            lp = self._logprobs(i, 0, len(self.tokens[i]))
            if self.kind == "chat":
                message, reason = {"role": "assistant", "content": f.text}, f.finish_reason
                if self.spec.tool is not None:  # tool_calls, content null
                    message, reason = tool_call_reply(self.spec.tool, f.text, reason)
                choices.append({"index": i, "message": message, "logprobs": lp,
                                "finish_reason": reason})
            else:
                text = f.text
                if self.spec.echo:  # the prompt (and its logprobs) before the choice's own
                    prompt = self.spec.echo_texts[i // self.spec.n]
                    lp = self._echo_logprobs(i, f, lp)
                    text = prompt + text
                choices.append({"index": i, "text": text, "logprobs": lp,
                                "finish_reason": f.finish_reason})
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat"
                else "text_completion", "created": self.created, "model": self.spec.model,
                "choices": choices, "usage": self.usage(), "exactspec": self.extension()}

    def chunk(self, choices: list[dict], usage: dict | None = None, last: bool = False) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat"
                else "text_completion", "created": self.created, "model": self.spec.model,
                "choices": choices}
        if self.spec.include_usage:
            body["usage"] = usage
        if last:
            body["exactspec"] = self.extension()
        return _event(body)

    def delta_chunk(self, ev: Delta, start: int, sent_chars: int) -> str:
        reason = ev.finish_reason
        end = start + len(ev.token_ids)
        lp = self._logprobs(ev.index, start, end, sent_chars)
        if self.kind == "chat":
            delta = {"content": ev.text} if ev.text else {}
            if self.spec.tool is not None:
                delta, reason = self._tool_delta(ev)
            choice = {"index": ev.index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        else:
            choice = {"index": ev.index, "text": ev.text, "logprobs": lp,
                      "finish_reason": reason}
        return self.chunk([choice])

    def _tool_delta(self, ev: Delta) -> tuple[dict, str | None]:
        """A forced tool call's stream delta: a named tool's arguments as they grow (the
        first delta carries the call's id and name); a "required" call whole, at its end
        (its name is only known once its JSON is)."""
        tool, i, reason = self.spec.tool, ev.index, ev.finish_reason
        started, self.tool_started[i] = self.tool_started[i], True
        self.tool_text[i] += ev.text
        if tool.name is None:  # "required": the call whole, at the end
            if reason is None:
                return {}, None
            message, reason = tool_call_reply(tool, self.tool_text[i], reason)
            if "tool_calls" not in message:
                return {"content": message["content"]}, reason
            return {"tool_calls": [{"index": 0, **message["tool_calls"][0]}]}, reason
        reason = "tool_calls" if reason == "stop" else reason
        if not ev.text and started:
            return {}, reason
        call: dict = {"index": 0, "function": {"arguments": ev.text}}
        if not started:
            call = {"index": 0, "id": call_id(), "type": "function",
                    "function": {"name": tool.name, "arguments": ev.text}}
        return {"tool_calls": [call]}, reason


def text_logprobs(tokenizer, strs: list[str], lps: list, tops: list | None,
                  offset: int) -> dict:
    """/v1/completions' logprobs object: tokens, their logprobs, a {token: logprob} per
    position (None where there is none: echo's first prompt token) and text offsets."""
    offsets, at = [], offset
    for s in strs:
        offsets.append(at)
        at += len(s)
    return {"tokens": strs, "token_logprobs": lps,
            "top_logprobs": None if tops is None else [
                None if top is None else {tokenizer.decode([tid]): v for tid, v in top}
                for top in tops],
            "text_offset": offsets}


def sub_tokenizer(sub: Submission):
    return sub.choices[0].text.tokenizer


async def _next_event(sub: Submission, deadline: float, poll: float | None):
    """The next event, None after `poll` seconds, or TimeoutError past the deadline."""
    remaining = deadline - time.perf_counter()
    if remaining <= 0:
        raise TimeoutError
    wait = remaining if poll is None else min(poll, remaining)
    try:
        return await asyncio.wait_for(sub.events.get(), timeout=wait)
    except TimeoutError:
        if time.perf_counter() >= deadline:
            raise
        return None


async def collect(request: Request, answer: Answer, deadline: float) -> Response:
    """A non-streaming answer: wait for every choice, watching for disconnects and timeout."""
    sub = answer.sub
    checked = time.perf_counter()
    try:
        while not answer.done:
            try:
                ev = await _next_event(sub, deadline, POLL_SECONDS)
            except TimeoutError:
                timeout = answer.config.request_timeout
                return error_response(timeout_error(answer.spec, timeout))
            if time.perf_counter() - checked >= POLL_SECONDS:  # events or not: still there?
                checked = time.perf_counter()
                if await request.is_disconnected():
                    return Response(status_code=499)  # nobody reads it; the rows are cancelled
            if ev is None:
                continue
            if isinstance(ev, Failed):
                return error_response(ev.error)
            answer.add(ev)
        return JSONResponse(answer.response())
    finally:
        if not answer.done:
            sub.cancel()


async def sse(answer: Answer, deadline: float) -> AsyncIterator[str]:
    """A streaming answer as server-sent events; a disconnect ends it and cancels the rows."""
    sub, spec = answer.sub, answer.spec
    n = len(sub.choices)
    start = [0] * n  # tokens already sent per choice
    chars = [0] * n  # text characters already sent per choice (text_offset)
    try:
        if answer.kind == "chat":
            yield answer.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None} for i in range(n)])
        while not answer.done:
            try:
                ev = await _next_event(sub, deadline, None)
            except TimeoutError:
                yield _event(timeout_error(spec, answer.config.request_timeout).body())
                return
            if isinstance(ev, Failed):
                yield _event(ev.error.body())
                return
            answer.add(ev)
            if isinstance(ev, Delta) and (ev.text or ev.token_ids or ev.finish_reason):
                i = ev.index
                yield answer.delta_chunk(ev, start[i], chars[i])
                start[i] += len(ev.token_ids)
                chars[i] += len(ev.text)
        if spec.include_usage:
            yield answer.chunk([], usage=answer.usage(), last=True)
        yield "data: [DONE]\n\n"
    finally:
        if not answer.done:
            sub.cancel()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
