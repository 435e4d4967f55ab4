"""The serving engine: one thread owns the model and decodes every request's choices.

HTTP handlers `submit` a validated `RequestSpec` and read its events (`Delta`, `Finished`,
`Failed`) from an asyncio queue; the engine thread posts them with `call_soon_threadsafe`.
The queue of waiting requests is bounded (429 when full); a cancelled request (client gone,
timeout) stops receiving tokens and leaves the batch as soon as no row of it is still wanted.

Randomness: choice i of a request with seed s draws from the row stream (s, i), the stream
`es.generate(rows, params=SamplingParams(seed=s))` gives its row i, so a request's output with
a given seed is the one `es.generate` gives for it alone, whatever else shares the batch (up to
float rounding of batched matrix products, and at a fixed `num_draft_tokens`).

Continuous batching through the engine's one boundary, `Decoder`: the loop admits waiting
requests between decode steps (`admit`, up to `max_batch` rows; the new rows are prefilled
alone, in the target and the drafter, the running ones keep their caches), runs one `step`
for every row in flight, and `drop`s cancelled rows; finished rows leave by themselves. Each
row carries its own sampling parameters, seed, stop strings, max_tokens and top_logprobs;
rows of equal parameters are standardized together. Top log-probabilities come from the p
the step verified with (no second forward). A drafter that raises inside a step does not
fail any request: the rows in flight continue with plain decoding (exact) and the drafter
restarts once they have left (counted in `exactspec:drafter_faults_total`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from exactspec.drafters.base import Drafter
from exactspec.engine.arguments import parse_verify
from exactspec.engine.decoder import DecodeConfig, Decoder
from exactspec.engine.rows import Row, RowOutput
from exactspec.engine.verifier import Method
from exactspec.models.loading import Model
from exactspec.sampling import RowStreams, SamplingParams
from exactspec.serve.echo import prompt_logprobs
from exactspec.serve.events import Choice, Delta, Failed, Finished, Submission
from exactspec.serve.metrics import Metrics
from exactspec.serve.protocol import ApiError, RequestSpec
from exactspec.serve.rows import RowText, drop_partial
from exactspec.serve.structured import first_mask_error, grammar_refusal

__all__ = ["Choice", "Delta", "EngineConfig", "Failed", "Finished", "ServingEngine",
           "Submission"]

log = logging.getLogger(__name__)
# what the engine decodes to calibrate "auto" draft lengths before serving (any text works)
CALIBRATION_TEXT = ("The lighthouse stood at the end of the harbour wall. Every evening the "
                    "keeper climbed its stairs, trimmed the wick and wrote the weather in his "
                    "book. Ships passed in the night, and")


@dataclass
class EngineConfig:
    """How the engine batches and drafts."""

    max_batch: int = 32  # rows (choices) decoded together, at most (a request is never split)
    max_queue: int = 64  # requests waiting for the engine; one more is answered 429
    num_draft_tokens: int | str = 4  # K per step, or "auto"
    verify: str = "token"  # the verification method ("token" | "block")
    retry_after: int = 1  # seconds suggested to a client refused with 429
    # the law logprobs report unless a request asks otherwise: "raw" (the model's own, before
    # temperature, top-k/p and penalties: OpenAI's and vLLM's) or "processed" (the law each
    # token was drawn from, what an RL trainer needs)
    logprobs_mode: str = "raw"
    # how a seeded request is verified: "coupled" (its text is plain decoding's for the seed, at
    # any draft length, with or without the drafter; fewer drafts accepted at high temperature)
    # or "method" (the `verify` method, as unseeded requests: the text then depends on K)
    seeded_verify: str = "coupled"


def couples_seeds(method: Method) -> bool:
    """Whether seeded requests are verified coupled under `method` (parsed, `parse_verify`):
    the exact chain methods "token", "block" and "coupled"; a lossy or greedy-only rule, or a
    user's callable (a UserRule, never lossless), keeps its own rule."""
    return method.lossless and method.name in ("token", "block", "coupled")


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
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()  # engine row ids
        # seeded requests are verified coupled (their text is plain decoding's for the seed,
        # at any K, with or without the drafter) under the exact chain methods; a tree
        # drafter, a lossy or greedy-only rule or a callable verify keep their own rule
        verify = self.config.verify
        if self.config.seeded_verify not in ("coupled", "method"):
            raise ValueError(f"seeded_verify={self.config.seeded_verify!r} must be 'coupled' or "
                             "'method'")
        self.seeds_coupled = (self.config.seeded_verify == "coupled"
                              and couples_seeds(parse_verify(verify))
                              and getattr(drafter, "tree", None) is None)
        self.grammar_refused = grammar_refusal(drafter, verify)  # why no grammar is served
        self._grammar_errors: dict = {}  # Grammar -> why this tokenizer cannot write it ("")

    # --- control, from any thread ---------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            if self._state != "new":
                return
            self._state = "running"
        self._thread = threading.Thread(target=self._loop, name="exactspec-engine", daemon=True)
        self._thread.start()

    def submit(self, spec: RequestSpec, loop: asyncio.AbstractEventLoop | None, *,
               deliver: Callable | None = None) -> Submission:
        """Queue a validated request; raises ApiError 429 (queue full) or 503 (shutting down).
        Its events go to `loop`'s queue, or to `deliver` (the engine process's pipe)."""
        sub = Submission(spec=spec, loop=loop, deliver=deliver)
        rows = spec.rows
        seeds = RowStreams.from_seed(spec.seed, len(rows)).seeds.tolist()
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

    async def enqueue(self, spec: RequestSpec, loop: asyncio.AbstractEventLoop) -> Submission:
        """`submit`, as the app calls every engine (`EngineSupervisor` answers later)."""
        return self.submit(spec, loop)

    def health(self) -> tuple[str, str]:
        """("ok", "") while this thread's engine serves (it has no restart state)."""
        return "ok", ""

    async def render_metrics(self, metrics: Metrics) -> str:
        """The /metrics text: `metrics` hold everything in this process."""
        return metrics.render()

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
        decoder = self._calibrated()  # the engine: rows in flight; rebuilt after an error
        live: dict[int, tuple[Submission, Choice, Row]] = {}  # row id -> its request
        while True:
            with self._cond:
                while not (live or self._ready()):
                    self._cond.wait()
                if not live and not self._waiting and self._state != "running":
                    self._state = "stopped"  # drained, or stopped
                    return
                taken = self._take(len(live)) if not self._paused else []
            try:
                if decoder is None:
                    decoder = self._decoder()
                decoder.admit(self._rows(decoder, taken, live))
                self._drop_cancelled(decoder, live)
                if decoder.rows:
                    self._step(decoder, live)
            except Exception as exc:  # fail what was in flight; the next request starts afresh
                log.exception("engine step failed")
                error = ApiError(500, f"internal error while decoding: {type(exc).__name__}: "
                                 f"{exc}", type="internal_server_error", code="internal_error")
                failed = {id(s): s for s, _, _ in live.values()}
                failed.update({id(s): s for s in taken})
                for sub in failed.values():
                    if not sub.done:
                        sub.done = True
                        sub.send(Failed(error))
                        self.metrics.count("requests", "error")
                live.clear()
                decoder = None
            with self.metrics.lock:
                self.metrics.running = len({id(s) for s, _, _ in live.values()})
                self.metrics.batch_rows = len(live)

    def _ready(self) -> bool:
        if self._state != "running":
            return True
        return bool(self._waiting) and not self._paused

    def _take(self, in_flight: int) -> list[Submission]:
        """Waiting requests that fit next to `in_flight` rows (FIFO; a request is never split)."""
        taken, rows = [], in_flight
        while self._waiting:
            sub = self._waiting[0]
            if sub.cancelled:  # its client left while it waited: it never decodes
                self._waiting.popleft()
                if not sub.done:
                    sub.done = True
                    self.metrics.count("requests", "cancelled")
                continue
            n = len(sub.choices)
            if rows and rows + n > self.config.max_batch:
                break
            taken.append(self._waiting.popleft())
            rows += n
        with self.metrics.lock:
            self.metrics.waiting = len(self._waiting)
        return taken

    def _decoder(self) -> Decoder:
        """The engine object this thread drives; a row carries its own budget, stop strings,
        sampling parameters and seed, so nothing here changes per request. A drafter that
        raises inside a step leaves its rows to continue plain (exact) and the server serving."""
        cfg = DecodeConfig(params=SamplingParams(), max_new_tokens=1,
                           num_draft_tokens=self.config.num_draft_tokens,
                           verify=self.config.verify, return_logprobs=True,
                           eos_token_ids=self.model.eos_token_ids, stop=[],
                           tokenizer=self.model.tokenizer,
                           logprobs_mode=self.config.logprobs_mode)
        return Decoder(self.model, self.drafter, cfg, on_fault="plain")

    def _calibrated(self) -> Decoder | None:
        """With a drafter and "auto" K, the decoder, its draft-length policy calibrated on one
        row (`Decoder.calibrate`: every verify width measured, a second or two on a small
        model) before the first request, which otherwise paid for the exploration; requests
        arriving meanwhile wait in the queue. None (built at the first request) otherwise,
        or if calibrating failed (logged: the policy explores as it serves)."""
        if self.drafter is None or self.config.num_draft_tokens != "auto":
            return None
        try:
            decoder = self._decoder()
            prompt = self.model.encode(CALIBRATION_TEXT) if self.model.tokenizer is not None \
                else [0] * 16  # token ids only: any ids do
            seconds = decoder.calibrate(prompt)
        except Exception:
            log.exception("calibrating the draft-length policy failed; it explores as it serves")
            return None
        log.info("calibrated the draft-length policy in %.1f s", seconds)
        return decoder

    def _rows(self, decoder: Decoder, subs: list[Submission],
              live: dict[int, tuple[Submission, Choice, Row]]) -> list[Row]:
        rows = []
        for sub in subs:
            spec = sub.spec
            if spec.grammar is not None and self._grammar_error(spec.grammar):
                sub.done = True  # refused alone: at admission it would fail the whole batch
                self.metrics.count("rejected", "invalid_request")
                sub.send(Failed(ApiError(400, self._grammar_error(spec.grammar), param=(
                    "tool_choice" if spec.tool is not None else "response_format"))))
                continue
            if spec.echo and spec.logprobs:  # the prompts' own logprobs, once per prompt
                mode = spec.logprobs_mode or self.config.logprobs_mode
                sub.echo = [prompt_logprobs(self.model, p, spec.params, mode,
                                            spec.top_logprobs) for p in spec.prompts]
            if spec.max_tokens == 0:  # echo alone: every choice ends now
                for c in sub.choices:
                    self._emit(sub, c, RowOutput(finish_reason="length"), [])
                continue
            for c in sub.choices:
                row = decoder.make_row(next(self._ids), c.prompt, spec.params, c.seed,
                                       max_new_tokens=spec.max_tokens, stop=list(spec.stop),
                                       top_logprobs=spec.top_logprobs or 0,
                                       coupled=spec.seeded and self.seeds_coupled,
                                       logprobs_mode=spec.logprobs_mode, grammar=spec.grammar)
                if spec.ignore_eos:  # stopping is not sampling: the law is unchanged
                    row.stop.eos = set()
                live[row.id] = (sub, c, row)
                rows.append(row)
        return rows

    def _grammar_error(self, grammar) -> str:
        """Why `grammar` cannot be served here ("" if it can), remembered per grammar."""
        if grammar not in self._grammar_errors:
            if len(self._grammar_errors) > 256:
                self._grammar_errors.clear()
            self._grammar_errors[grammar] = self.grammar_refused or first_mask_error(
                self.model, grammar)
        return self._grammar_errors[grammar]

    def _drop_cancelled(self, decoder: Decoder, live: dict) -> None:
        """Rows nobody reads any more leave the batch now (a client gone, a timeout)."""
        gone = decoder.drop([i for i, (sub, _, _) in live.items() if sub.cancelled])
        for row in gone:
            sub, _, _ = live.pop(row.id)
            self.metrics.observe_row(row.output.stats)
            if not sub.done:
                sub.done = True
                self.metrics.count("requests", "cancelled")

    def _step(self, decoder: Decoder, live: dict) -> None:
        start = time.perf_counter()
        faults = decoder.drafter_faults
        gained = decoder.step()
        self.metrics.observe_steps(1, time.perf_counter() - start)
        if decoder.drafter_faults > faults:
            self.metrics.count("drafter_faults", "step", decoder.drafter_faults - faults)
        with self.metrics.lock:
            self.metrics.peak_batch_rows = max(self.metrics.peak_batch_rows, len(gained))
        for row, new in gained:
            sub, choice, _ = live[row.id]
            if row.output.finish_reason is not None:
                del live[row.id]
            if new or row.output.finish_reason is not None:
                self._emit(sub, choice, row.output, new)

    def _emit(self, sub: Submission, choice: Choice, out, new: list[int]) -> None:
        """Send a choice's new tokens (and its end) to its request."""
        if sub.done:
            return
        if sub.cancelled:  # nobody reads it; a row that ended now still counts, once
            if out.finish_reason is not None:
                choice.finished = True
                self.metrics.observe_row(out.stats)
                if all(c.finished for c in sub.choices):  # no row left for _drop_cancelled
                    sub.done = True
                    self.metrics.count("requests", "cancelled")
            return
        spec = sub.spec
        now = time.perf_counter()
        if sub.first_token is None:
            sub.first_token = now
            self.metrics.ttft.observe(now - sub.submitted)
        finished = out.finish_reason is not None
        text = choice.text.push(new, finished=finished, cut=out.cut)
        lps = out.logprobs[len(out.logprobs) - len(new):] if spec.logprobs else None
        if not finished and not new:
            return
        top = out.top[len(out.top) - len(new):] if spec.top_logprobs else None
        reason = None
        if finished:
            reason = "length" if out.finish_reason == "length" else "stop"
        sub.send(Delta(choice.index, text, list(new), lps, top, reason))
        if not finished:
            return
        choice.finished = True
        final = self.model.tokenizer.decode(out.tokens, skip_special_tokens=True)
        final = final[: out.cut] if out.cut is not None else drop_partial(
            self.model.tokenizer, out.tokens, final)
        lps, top = sub.echo[choice.index // spec.n] if sub.echo else (None, None)
        sub.send(Finished(choice.index, reason, final, list(out.tokens), out.stats, lps, top))
        self.metrics.observe_row(out.stats)
        if all(c.finished for c in sub.choices):
            sub.done = True
            self.metrics.count("requests", reason)
            self.metrics.e2e.observe(now - sub.submitted)

