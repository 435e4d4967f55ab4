"""A batch job on Ray: W actors that each load the model once, fed shards from the driver.

Design: plain Ray actors and a driver-side queue, not Ray Data's `map_batches`. The driver
keeps the queue of shards, sends one to each idle actor, and writes each shard's rows to the
one output file as soon as it returns (`ray.wait`), so the output, the resume logic and the
progress bar are exactly the local run's; Ray Data would write its own files per block, order
rows by its own plan, and pull in pyarrow / pandas. A shard whose actor dies (killed, out of
memory, its node lost) comes back as an actor error: the shard goes back to the front of the
queue for another actor, and a fresh actor (loading the model again) takes the dead one's
place, up to `max_failures` times in a job.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import replace

from exactspec.batch.rows import InputRow
from exactspec.batch.work import EngineSpec, Task, Worker
from exactspec.errors import InvalidValue

log = logging.getLogger(__name__)


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*: ")  # "exactspec.errors.MissingFile: ..."
LOCAL_START_ATTEMPTS = 3  # a loaded machine can make a local Ray node miss its start-up window


RAY_MISSING = ("{what} runs on Ray, an optional dependency: pip install 'exactspec[ray]' "
               "(`make test` installs it)")


def require_ray(what: str) -> None:
    """Raise InvalidValue naming the install when Ray is not installed."""
    if importlib.util.find_spec("ray") is None:
        raise InvalidValue(RAY_MISSING.format(what=what))


def start_local_ray(num_cpus: int) -> None:
    """A local Ray cluster on this machine: loopback only, no dashboard, no usage reports.

    On a busy machine Ray's node agents can start too slowly for the raylet, which then gives
    up ("timed out during startup"); the agents get a longer window and the start is retried.
    """
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                     log_to_driver=False, logging_level=logging.WARNING)
            return
        except Exception as exc:  # Ray raises a bare Exception when its node fails to start
            ray.shutdown()
            if attempt == LOCAL_START_ATTEMPTS:
                raise RuntimeError(f"could not start a local Ray cluster ({exc}); is the "
                                   "machine overloaded?") from exc
            log.warning("local Ray start failed (%s); retrying", exc)


class _WorkerActor:
    """The body of one Ray actor: a Worker, built once when the actor starts."""

    def __init__(self, spec: EngineSpec) -> None:
        self.worker = Worker(spec)

    def pid(self) -> int:
        return os.getpid()

    def encode(self, rows: list[InputRow], max_new_tokens: int) -> list[list[int] | str]:
        return self.worker.encode(rows, max_new_tokens)

    def run(self, tasks: list[Task]) -> list[dict]:
        return self.worker.run(tasks)


class RayPool:
    """W Ray actors running shards of tasks; a dead actor's shard is redone by another."""

    def __init__(self, spec: EngineSpec, workers: int, *, address: str | None = None,
                 threads: int | None = None, max_failures: int | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise InvalidValue("--ray needs the ray package: pip install ray") from None
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise InvalidValue(f"workers={workers!r} must be an int >= 1")
        self._ray = ray
        self._started = False  # whether this pool started Ray (and so shuts it down)
        if not ray.is_initialized():
            if address:
                ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
            else:
                start_local_ray(max(os.cpu_count() or 1, workers))
            self._started = True
        cpus = ray.cluster_resources().get("CPU", 1.0)
        self.threads = threads or max(1, int(cpus // workers))  # torch threads per actor
        self.spec = replace(spec, threads=self.threads)
        self._actor_class = ray.remote(num_cpus=min(self.threads, max(cpus / workers, 0.01)),
                                       max_restarts=0)(_WorkerActor)
        self.max_failures = 2 * workers if max_failures is None else max_failures
        self.failures = 0  # actors that died during the job (their shards were redone)
        self.redone = 0  # shards sent again after their actor died
        self.actors = [self._spawn() for _ in range(workers)]
        # Wait until every actor has loaded its model, so a broken spec fails here, once.
        try:
            self.pids = self._ray.get([a.pid.remote() for a in self.actors])
        except ray.exceptions.RayActorError as exc:
            self.close()
            # Ray passes the actor's exception as text only: its last "module.Type: ..." line
            lines = [line.strip() for line in str(exc).splitlines()]
            cause = next((line for line in reversed(lines) if _EXCEPTION_LINE.match(line)),
                         lines[-1] if lines else "")
            message = (f"the Ray workers could not build the engine for model "
                       f"{spec.model!r}: {cause}")
            if cause.startswith("exactspec.errors."):  # a user mistake, e.g. a missing file
                raise InvalidValue(message) from None
            raise RuntimeError(message) from exc

    def _spawn(self):
        return self._actor_class.remote(self.spec)

    def _replace(self, dead):
        """Kill a dead actor's handle and start a new actor in its place; returns the new one."""
        self.failures += 1
        if self.failures > self.max_failures:
            raise RuntimeError(f"{self.failures} Ray workers died in this job (limit "
                               f"{self.max_failures}); see the Ray logs for why")
        log.warning("a Ray worker died; its shard goes to another worker and a new worker "
                    "starts (%d so far)", self.failures)
        self._ray.kill(dead, no_restart=True)
        fresh = self._spawn()
        self.actors[self.actors.index(dead)] = fresh
        return fresh

    def encode(self, rows: list[InputRow], max_new_tokens: int) -> list[list[int] | str]:
        """Prompt tokens (or errors) of every row, from one actor's tokenizer."""
        while True:
            actor = self.actors[0]
            try:
                return self._ray.get(actor.encode.remote(rows, max_new_tokens))
            except self._ray.exceptions.RayActorError:
                self._replace(actor)

    def run(self, shards: list[list[Task]]) -> Iterator[list[dict]]:
        """Each shard's records as soon as it finishes, in finishing order.

        A replacement actor gets work only once it has loaded its model, so a redone shard
        goes to whichever actor is free first."""
        errors = self._ray.exceptions.RayActorError
        pending = deque(shards)
        inflight: dict = {}  # object ref of a run -> (actor, shard)
        starting: dict = {}  # object ref of a replacement's pid() -> the replacement
        idle = list(self.actors)
        while pending or inflight:
            while idle and pending:
                actor, shard = idle.pop(), pending.popleft()
                inflight[actor.run.remote(shard)] = (actor, shard)
            ready, _ = self._ray.wait([*inflight, *starting], num_returns=1)
            for ref in ready:
                if ref in starting:
                    actor = starting.pop(ref)
                    try:
                        self._ray.get(ref)
                    except errors:  # died while loading: replace it again
                        fresh = self._replace(actor)
                        starting[fresh.pid.remote()] = fresh
                        continue
                    idle.append(actor)
                    continue
                actor, shard = inflight.pop(ref)
                try:
                    records = self._ray.get(ref)
                except errors:
                    self.redone += 1
                    pending.appendleft(shard)
                    fresh = self._replace(actor)
                    starting[fresh.pid.remote()] = fresh
                    continue
                idle.append(actor)
                yield records

    def close(self) -> None:
        for a in self.actors:
            self._ray.kill(a, no_restart=True)
        self.actors = []
        if self._started:
            self._ray.shutdown()
