"""The events between the engine and a request's answer, and a request inside the engine.

`Delta` (new tokens of a choice), `Finished` (a choice ended), `Failed` (the request failed);
`Choice` is one row of a request, `Submission` the request between the HTTP handler and the
engine (its events go to the handler's asyncio queue, or down the engine process's pipe).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from exactspec.engine.results import GenerationStats
from exactspec.serve.protocol import ApiError, RequestSpec
from exactspec.serve.rows import RowText


@dataclass
class Delta:
    """New tokens of one choice."""

    index: int  # the choice
    text: str  # text that can be shown now (may be empty while a stop string could start)
    token_ids: list[int]  # the new tokens
    logprobs: list[float] | None  # log p of each, when asked
    top: list[list[tuple[int, float]]] | None  # top (token id, log p) per new token, when asked
    finish_reason: str | None = None  # set on the choice's last delta ("stop" | "length")


@dataclass
class Finished:
    """A choice ended."""

    index: int  # the choice
    finish_reason: str  # OpenAI's: "stop" (EOS or a stop string) | "length"
    text: str  # the choice's whole text, exactly `es.generate`'s
    token_ids: list[int]  # every generated token
    stats: GenerationStats  # steps, drafted, accepted...
    # echo with logprobs: per prompt token its log p (None for the first) and top alternatives
    prompt_logprobs: list[float | None] | None = None
    prompt_top: list[list[tuple[int, float]] | None] | None = None


@dataclass
class Failed:
    """The request failed; no more events follow."""

    error: ApiError  # what to answer


@dataclass
class Choice:
    """One row of a request inside the engine."""

    index: int  # position in the request's choices
    prompt: list[int]  # token ids
    seed: int  # the row's stream seed (64-bit, as RowStreams stores it)
    text: RowText  # incremental text
    finished: bool = False  # its Finished event was sent


@dataclass
class Submission:
    """One request between the HTTP handler and the engine."""

    spec: RequestSpec  # what was asked
    loop: asyncio.AbstractEventLoop | None  # the handler's loop, where events are delivered
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Delta / Finished / Failed
    choices: list[Choice] = field(default_factory=list)  # filled by the engine on submit
    cancelled: bool = False  # set by the handler: nobody reads the events any more
    done: bool = False  # every choice finished, or failed
    submitted: float = field(default_factory=time.perf_counter)  # perf_counter at submit
    first_token: float | None = None  # perf_counter of the first token
    deliver: Callable[[Delta | Finished | Failed], None] | None = None  # instead of `loop`
    on_cancel: Callable[[], None] | None = None  # also told of a cancel (the engine process)
    # echo with logprobs: per prompt, (log p per token, None first; top alternatives)
    echo: list[tuple[list, list]] | None = None

    def cancel(self) -> None:
        """Stop decoding this request (thread-safe; the engine drops it at its next step)."""
        self.cancelled = True
        if self.on_cancel is not None:
            self.on_cancel()

    def send(self, event: Delta | Finished | Failed) -> None:
        if self.deliver is not None:  # the engine process: events go down the pipe
            self.deliver(event)
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening
            self.cancelled = True
