"""The engine (model, drafter, decode loop) in a child process of the HTTP front, restarted if
it dies.

A drafter that runs native code can kill its process (a segfault), and the kernel's
out-of-memory killer picks the biggest process. With the engine in `exactspec.serve.worker`,
such a death costs the requests in flight, not the server: the front answers each of them 503
in OpenAI's shape naming what happened (code "engine_restarting"), `/health` answers 503
{"status": "restarting"}, new requests are refused 503 until the engine is back, and the
engine is started again (at most `max_restarts` tries in a row, a log line each). The child
is built from the same `EngineSpec`, so the same seed gives the same text after a restart.

The front keeps only the tokenizer and the model's config (`ModelInfo`: the weights on
torch's meta device, no memory), which is all it needs to validate and tokenize requests.
/metrics sums the front's counts (HTTP answers, refusals) with the engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from prometheus_client import generate_latest

from exactspec.models.loading import Model
from exactspec.serve.events import Choice, Failed, Finished, Submission
from exactspec.serve.metrics import Metrics, merge
from exactspec.serve.protocol import ApiError, RequestSpec
from exactspec.serve.rows import RowText

log = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    """What the front needs of the model (sent by the engine process once it has loaded)."""

    config: object  # the transformers config
    generation_config: object  # its generation config (EOS ids)
    tokenizer: object  # the tokenizer, chat template included
    name: str  # the model's name
    drafter_name: str  # reported in responses

    @classmethod
    def of(cls, model: Model, drafter_name: str) -> ModelInfo:
        return cls(model.model.config, model.model.generation_config, model.tokenizer,
                   model.name, drafter_name)

    def model(self) -> Model:
        """A `Model` with this tokenizer and config whose weights take no memory (meta)."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(self.config)
        meta.generation_config = self.generation_config
        return Model(model=meta, tokenizer=self.tokenizer, name=self.name)


class EngineSupervisor:
    """The engine process seen from the front: the engine interface `create_app` drives
    (`start`, `enqueue`, `health`, `render_metrics`, `stop`), over a pipe."""

    def __init__(self, spec, metrics: Metrics, *, max_restarts: int = 5,
                 start_timeout: float = 600.0) -> None:
        self.spec = spec  # the EngineSpec the child builds
        self.metrics = metrics  # the front's
        self.max_restarts = max_restarts  # tries in a row after a death
        self.start_timeout = start_timeout  # seconds for a child to load
        self.info: ModelInfo | None = None  # from the first child
        self.restarts = 0  # engine processes started after a death
        self._state, self._detail = "new", ""  # new|running|restarting|failed|stopping|stopped
        self._lock = threading.Lock()  # guards the fields below and the connection's sends
        self._conn: Connection | None = None
        self._proc: subprocess.Popen | None = None
        self._ids = itertools.count()
        self._subs: dict[int, Submission] = {}  # request id -> its submission, in flight
        self._waits: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._last_metrics = ""  # the engine's last /metrics text

    # --- the front's side -------------------------------------------------------------------

    def launch(self) -> ModelInfo:
        """Start the engine process and wait for it to load; RuntimeError if it cannot."""
        problem = self._spawn()
        if problem is not None:
            raise RuntimeError(f"the engine process did not start: {problem}")
        threading.Thread(target=self._read, name="exactspec-supervisor", daemon=True).start()
        return self.info

    def start(self) -> None:  # the app's lifespan: the child runs since `launch`
        pass

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before it starts)."""
        return None if self._proc is None else self._proc.pid

    def health(self) -> tuple[str, str]:
        with self._lock:
            return ("ok", "") if self._state == "running" else (self._state, self._detail)

    async def enqueue(self, spec: RequestSpec, loop: asyncio.AbstractEventLoop) -> Submission:
        """Send the request to the engine; its acknowledgement, or its ApiError (429, 503)."""
        tok = self.info.tokenizer
        sub = Submission(spec=spec, loop=loop)
        sub.choices = [Choice(i, p, 0, RowText(tok, spec.stop)) for i, p in enumerate(spec.rows)]
        rid = next(self._ids)
        sub.on_cancel = lambda: self._cancel(rid)
        acked = loop.create_future()
        with self._lock:
            if self._state != "running":
                self.metrics.count("rejected", "engine_restarting")
                raise self._unavailable()
            self._subs[rid] = sub
            self._waits[rid] = (loop, acked)
            self._send(("submit", rid, spec))
        error = await acked
        if error is not None:
            with self._lock:
                self._subs.pop(rid, None)
            self.metrics.count("rejected", error.code or str(error.status))
            raise error
        return sub

    async def render_metrics(self, metrics: Metrics) -> str:
        """The front's counts summed with the engine's (its last known ones if it is down)."""
        loop = asyncio.get_running_loop()
        token = -next(self._ids) - 1
        got = loop.create_future()
        with self._lock:
            if self._state == "running":
                self._waits[token] = (loop, got)
                self._send(("metrics", token))
            else:
                got.set_result(None)
        try:
            text = await asyncio.wait_for(got, 2.0)
        except TimeoutError:
            text = None
        with self._lock:
            self._waits.pop(token, None)
        if text is not None:
            self._last_metrics = text
        return generate_latest(_Families(merge([metrics.render(), self._last_metrics]))).decode()

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        with self._lock:
            running = self._state == "running"
            self._state = "stopping"
            if running:
                self._send(("stop", drain, timeout))
        if self._proc is not None:
            try:
                self._proc.wait(None if timeout is None else timeout + 10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        with self._lock:
            self._state = "stopped"

    # --- internals --------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:  # under self._lock
        with contextlib.suppress(OSError):  # a dead child: the reader thread fails what was sent
            self._conn.send(message)

    def _cancel(self, rid: int) -> None:
        with self._lock:
            if self._subs.pop(rid, None) is not None and self._state == "running":
                self._send(("cancel", rid))

    def _unavailable(self) -> ApiError:
        return ApiError(503, f"the engine is {self._state}: {self._detail}; retry shortly",
                        type="server_error", code="engine_restarting",
                        headers={"Retry-After": "2"})

    def _spawn(self) -> str | None:
        """A new engine process, loaded; None, or why it failed."""
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "exactspec.serve.worker", str(theirs.fileno()),
               str(logging.getLogger().getEffectiveLevel())]
        proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()])
        theirs.close()
        conn = Connection(ours.detach())
        conn.send(self.spec)
        end = time.monotonic() + self.start_timeout
        while not conn.poll(0.25):
            if proc.poll() is not None or time.monotonic() > end:
                proc.kill()
                proc.wait()
                return f"it exited ({_how(proc.returncode)}) while loading"
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = ("error", f"it exited ({_how(proc.wait())}) while loading")
        if message[0] != "ready":
            proc.kill()
            proc.wait()
            return message[1]
        self.info = self.info or message[1]
        with self._lock:
            self._conn, self._proc = conn, proc
            self._state, self._detail = "running", ""
        return None

    def _read(self) -> None:
        """The reader thread: delivers the engine's messages; after a death, restarts it."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if not self._died():
                    return
                continue
            kind = message[0]
            if kind == "event":
                _, rid, ev = message
                with self._lock:
                    sub = self._subs.get(rid)
                    if sub is not None and (isinstance(ev, Failed) or (isinstance(
                            ev, Finished) and _last(sub, ev))):
                        del self._subs[rid]
                if sub is not None:
                    sub.send(ev)
            elif kind in ("ack", "metrics"):
                with self._lock:
                    wait = self._waits.pop(message[1], None)
                if wait is not None:
                    loop, fut = wait
                    loop.call_soon_threadsafe(_resolve, fut, message[2])

    def _died(self) -> bool:
        """The engine process ended: fail what it held and start another (False: stop
        reading, because it was asked to stop or every try failed)."""
        code = self._proc.wait()
        with self._lock:
            if self._state in ("stopping", "stopped"):
                return False
            what = f"the engine process died ({_how(code)})"
            self._state, self._detail = "restarting", what
            error = ApiError(503, f"{what} while this request ran; the server is restarting "
                             "it: retry shortly", type="server_error", code="engine_restarting",
                             headers={"Retry-After": "2"})
            subs, self._subs = self._subs, {}
            waits, self._waits = self._waits, {}
        log.error("%s; %d request(s) in flight answered 503", what, len(subs))
        for sub in subs.values():
            sub.done = True
            sub.send(Failed(error))
            self.metrics.count("requests", "engine_died")
        for key, (loop, fut) in waits.items():  # acks fail; /metrics waits (key < 0) get None
            loop.call_soon_threadsafe(_resolve, fut, error if key >= 0 else None)
        for attempt in range(1, self.max_restarts + 1):
            log.warning("restarting the engine process (try %d of %d)", attempt,
                        self.max_restarts)
            start = time.monotonic()
            problem = self._spawn()
            if problem is None:
                self.restarts += 1
                log.warning("the engine process is back after %.1f s (pid %d)",
                            time.monotonic() - start, self._proc.pid)
                return True
            log.error("the engine process did not start: %s", problem)
        with self._lock:
            self._state = "failed"
            self._detail = f"{what}; {self.max_restarts} restarts failed"
        log.error("the engine is down for good: %s", self._detail)
        return False


class _Families:
    """A registry-like object for `generate_latest` over already merged families."""

    def __init__(self, families) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _last(sub: Submission, ev: Finished) -> bool:
    """Whether `ev` finishes the request's last open choice (counted on the submission)."""
    sub.choices[ev.index].finished = True
    return all(c.finished for c in sub.choices)


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"
