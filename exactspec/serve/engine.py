"""The serving engine: one thread owns the model and decodes every request's choices.

HTTP handlers `submit` a validated `RequestSpec` and read its events (`Delta`, `Finished`,
`Failed`) from an asyncio queue; the engine thread posts them with `call_soon_threadsafe`.
The queue of waiting requests is bounded (429 when full); a cancelled request (client gone,
timeout) stops receiving tokens and leaves the batch as soon as no row of it is still wanted.

Randomness: choice i of a request with seed s draws from the row stream (s, i), the stream
`es.generate(rows, params=SamplingParams(seed=s))` gives its row i, so a request's output with
a given seed is the one `es.generate` gives for it alone, whatever else shares the batch (up to
float rounding of batched matrix products, and at a fixed `num_draft_tokens`).

Batching today: requests with the same decode settings (sampling parameters but the seed,
max_tokens, stop, logprobs) that are waiting together are decoded as one batch, each row with
its own seed; a request with other settings waits for the running batch to end. True
continuous batching (rows admitted between steps) waits on the engine's batch state with
`admit` (see the README's Server section).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field, replace

import torch

from exactspec.drafters.base import Drafter
from exactspec.engine.loop import BatchDecoder, DecodeConfig
from exactspec.engine.results import GenerationStats
from exactspec.models.loading import Model
from exactspec.sampling import RowStreams
from exactspec.serve.metrics import Metrics
from exactspec.serve.protocol import ApiError, RequestSpec
from exactspec.serve.rows import RowText, top_logprobs

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    """How the engine batches and drafts."""

    max_batch: int = 32  # rows (choices) decoded together, at most (a request is never split)
    max_queue: int = 64  # requests waiting for the engine; one more is answered 429
    num_draft_tokens: int | str = 4  # K per step, or "auto"
    verify: str = "token"  # the verification method ("token" | "block")
    retry_after: int = 1  # seconds suggested to a client refused with 429


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
    loop: asyncio.AbstractEventLoop  # the handler's loop, where events are delivered
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Delta / Finished / Failed
    choices: list[Choice] = field(default_factory=list)  # filled by the engine on submit
    cancelled: bool = False  # set by the handler: nobody reads the events any more
    done: bool = False  # every choice finished, or failed
    submitted: float = field(default_factory=time.perf_counter)  # perf_counter at submit
    first_token: float | None = None  # perf_counter of the first token

    def cancel(self) -> None:
        """Stop decoding this request (thread-safe; the engine drops it at its next step)."""
        self.cancelled = True

    def send(self, event: Delta | Finished | Failed) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening
            self.cancelled = True


class ServingEngine:
    """A thread that owns `model` (and `drafter`) and decodes submitted requests."""

    def __init__(self, model: Model, drafter: Drafter | None = None,
                 config: EngineConfig | None = None, metrics: Metrics | None = None) -> None:
        self.model = model  # the target
        self.drafter = drafter  # None = plain decoding
        self.config = config or EngineConfig()
        self.metrics = metrics or Metrics()
        self._waiting: collections.deque[Submission] = collections.deque()  # FIFO
        self._cond = threading.Condition()  # guards _waiting, _paused, _state
        self._paused = False  # admissions held (tests, maintenance)
        self._state = "new"  # new | running | draining | stopped
        self._busy = False  # a batch is decoding
        self._thread: threading.Thread | None = None

    # --- control, from any thread ---------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            if self._state != "new":
                return
            self._state = "running"
        self._thread = threading.Thread(target=self._loop, name="exactspec-engine", daemon=True)
        self._thread.start()

    def submit(self, spec: RequestSpec, loop: asyncio.AbstractEventLoop) -> Submission:
        """Queue a validated request; raises ApiError 429 (queue full) or 503 (shutting down)."""
        sub = Submission(spec=spec, loop=loop)
        rows = spec.rows
        seeds = RowStreams.from_seed(spec.params.seed, len(rows)).seeds.tolist()
        sub.choices = [Choice(i, p, s, RowText(self.model.tokenizer, spec.stop))
                       for i, (p, s) in enumerate(zip(rows, seeds, strict=True))]
        with self._cond:
            if self._state != "running":
                self.metrics.count("rejected", "shutting_down")
                raise ApiError(503, "the server is shutting down; retry on another replica",
                               type="server_error", code="shutting_down")
            if len(self._waiting) >= self.config.max_queue:
                self.metrics.count("rejected", "queue_full")
                raise ApiError(429, f"the request queue is full ({self.config.max_queue} "
                               "waiting); retry shortly", type="rate_limit_error",
                               code="rate_limit_exceeded",
                               headers={"Retry-After": str(self.config.retry_after)})
            self._waiting.append(sub)
            self._cond.notify_all()
        with self.metrics.lock:
            self.metrics.waiting = len(self._waiting)
            self.metrics.prompt_tokens += spec.prompt_tokens
        return sub

    def pause(self) -> None:
        """Hold admissions: queued requests wait until `resume` (running ones continue)."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Refuse new requests; with `drain`, finish the queued and running ones first."""
        with self._cond:
            if self._state == "new":
                self._state = "stopped"
                return
            self._state = "draining" if drain else "stopped"
            self._paused = False
            if not drain:
                for sub in self._waiting:
                    sub.send(Failed(ApiError(503, "the server stopped before this request ran",
                                             type="server_error", code="shutting_down")))
                self._waiting.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # --- the engine thread ----------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._ready():
                    self._cond.wait()
                if not self._waiting:  # draining finished, or stopped
                    self._state = "stopped"
                    return
                batch = self._take_batch()
                self._busy = True
            try:
                if batch:
                    self._run(batch)
            finally:
                with self._cond:
                    self._busy = False

    def _ready(self) -> bool:
        if self._state == "stopped":
            return True
        if self._state == "draining" and not self._waiting:
            return True
        return bool(self._waiting) and not self._paused

    def _take_batch(self) -> list[Submission]:
        """The oldest live request and the waiting ones decodable with it, up to max_batch rows."""
        live = [s for s in self._waiting if not s.cancelled]
        self._waiting.clear()
        if not live:
            return []
        key, rows = _batch_key(live[0].spec), 0
        batch, rest = [], []
        for sub in live:
            n = len(sub.choices)
            if _batch_key(sub.spec) == key and (not batch or rows + n <= self.config.max_batch):
                batch.append(sub)
                rows += n
            else:
                rest.append(sub)
        self._waiting.extend(rest)
        with self.metrics.lock:
            self.metrics.waiting = len(self._waiting)
        return batch

    def _run(self, batch: list[Submission]) -> None:
        """Decode `batch` to the end (or until nobody wants its rows); errors fail it alone."""
        spec = batch[0].spec
        choices = [c for sub in batch for c in sub.choices]
        owner = [sub for sub in batch for _ in sub.choices]
        dev = self.model.device
        streams = RowStreams(torch.tensor([c.seed for c in choices], dtype=torch.long,
                                          device=dev))
        cfg = DecodeConfig(params=spec.params, max_new_tokens=spec.max_tokens,
                           num_draft_tokens=self.config.num_draft_tokens,
                           verify=self.config.verify, return_logprobs=spec.logprobs,
                           eos_token_ids=self.model.eos_token_ids, stop=list(spec.stop),
                           tokenizer=self.model.tokenizer)
        dec = BatchDecoder(self.model, self.drafter, [c.prompt for c in choices], streams, cfg)
        with self.metrics.lock:
            self.metrics.running = len(batch)
            self.metrics.batch_rows = len(choices)
        start = time.perf_counter()
        events = dec.run()
        try:
            for j, new in events:
                self._emit(owner[j], choices[j], dec.outputs[j], new)
                if all(s.cancelled or s.done for s in batch):
                    break
        except Exception as exc:
            log.exception("engine batch failed")
            error = ApiError(500, f"internal error while decoding: {type(exc).__name__}: {exc}",
                             type="internal_server_error", code="internal_error")
            for sub in batch:
                if not sub.done:
                    sub.done = True
                    sub.send(Failed(error))
                    self.metrics.count("requests", "error")
        finally:
            events.close()
            steps = max((o.stats.steps for o in dec.outputs), default=0)
            if steps:
                self.metrics.observe_steps(steps, time.perf_counter() - start)
            for c, o in zip(choices, dec.outputs, strict=True):
                if not c.finished:  # cancelled or failed: count what it did
                    self.metrics.observe_row(o.stats)
            for sub in batch:
                if sub.cancelled and not sub.done:
                    sub.done = True
                    self.metrics.count("requests", "cancelled")
            with self.metrics.lock:
                self.metrics.running = 0
                self.metrics.batch_rows = 0

    def _emit(self, sub: Submission, choice: Choice, out, new: list[int]) -> None:
        """Send a choice's new tokens (and its end) to its request."""
        if sub.cancelled or sub.done:
            return
        spec = sub.spec
        now = time.perf_counter()
        if sub.first_token is None:
            sub.first_token = now
            with self.metrics.lock:
                self.metrics.ttft.observe(now - sub.submitted)
        finished = out.finish_reason is not None
        text = choice.text.push(new, finished=finished, cut=out.cut)
        lps = out.logprobs[len(out.logprobs) - len(new):] if spec.logprobs else None
        top = None
        if spec.top_logprobs:
            top = top_logprobs(self.model, choice.prompt, out.tokens,
                               len(out.tokens) - len(new), spec.params, spec.top_logprobs)
        reason = None
        if finished:
            reason = "length" if out.finish_reason == "length" else "stop"
        sub.send(Delta(choice.index, text, list(new), lps, top, reason))
        if not finished:
            return
        choice.finished = True
        final = self.model.tokenizer.decode(out.tokens, skip_special_tokens=True)
        final = final[: out.cut] if out.cut is not None else final
        sub.send(Finished(choice.index, reason, final, list(out.tokens), out.stats))
        self.metrics.observe_row(out.stats)
        if all(c.finished for c in sub.choices):
            sub.done = True
            self.metrics.count("requests", reason)
            with self.metrics.lock:
                self.metrics.e2e.observe(now - sub.submitted)


def _batch_key(spec: RequestSpec) -> tuple:
    """Requests with equal keys can share one decode batch (each row keeps its own seed)."""
    return (replace(spec.params, seed=None), spec.max_tokens, tuple(spec.stop), spec.logprobs)
