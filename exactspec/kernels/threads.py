"""The thread count of each forward on our kernels, chosen from what the forwards measure.

On a busy machine (another process on one of two cores, a laptop, a container with a CPU
quota) every parallel region waits for its slowest thread, and a thread without a core makes
each of a step's ~120 regions wait for its next time slice: 2 threads ran 9-13x slower than 1
with one of two cores taken. Our kernels give the same bits at any thread count (every output
is reduced in one fixed order, whoever computes it), so the count can change from one forward
to the next without changing any output. `Governor` does that: per kind of forward (which
forward, rows and width, rounded up to powers of two) it keeps the measured seconds of each
candidate count (torch's thread count, and fewer), runs the cheapest, and measures the others
again now and then: the first 2 forwards of a kind run at torch's count, then each other count
once; after that every 32 forwards, twice as long each time that confirms the choice (up to
512), 32 again after it changed, and never so often that trying a dearer count takes more
than 3% of the time (2 threads 10x dearer than 1 with a core taken: once per ~300 forwards). The count in use is smoothed over its last few forwards, so a
core taken by another process is given up within a few forwards, and taken back within ~512
when it frees. Only decode and verify forwards (rows x width <= 64) are governed; a prefill
runs at torch's count (its kinds are many and each is long, so trying another count is dear).
On an idle machine the cost is the forwards tried at another count: 3-6% of a 48-96 token
bench run with re-measures every 8 forwards, before these waits (docs/performance.md).

Only forwards on our kernels are governed (`TargetAdapter` asks): torch's own operators may
give other bits at another thread count. The count is set for the forward and restored after
it, so everything else (standardizing, sampling) runs at the user's count.
`EXACTSPEC_ADAPTIVE_THREADS=0` turns it off.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

ENV = "EXACTSPEC_ADAPTIVE_THREADS"  # "0": every forward at torch's thread count
WARM = 2  # forwards of a kind at torch's count before another count is tried
FIRST_WAIT, MAX_WAIT = 32, 512  # forwards between re-measures of the counts not in use
BUDGET = 0.03  # the most of a run's time the re-measures of dearer counts may take
SMOOTH = 0.3  # weight of a new measurement of the count in use (the others: replaced)
DEAR = 3.0  # a count another kind found this many times its best is tried late by a new kind


def candidates(most: int) -> list[int]:
    """The counts tried under a user's `most` threads: `most`, then halvings down to 1."""
    out, n = [], most
    while n >= 1:
        out.append(n)
        n //= 2
    return out if out[-1] == 1 else [*out, 1]


def _bucket(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass
class _Kind:
    """What one kind of forward measured."""

    cost: dict[int, float] = field(default_factory=dict)  # threads -> seconds (smoothed)
    age: dict[int, int] = field(default_factory=dict)  # threads -> forwards since measured
    wait: int = FIRST_WAIT  # forwards before the counts not in use are measured again
    best: int | None = None  # the count in use
    seen: int = 0  # forwards recorded


class Governor:
    """Chooses each governed forward's thread count (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.kinds: dict[tuple, _Kind] = {}
        self._lock = threading.Lock()
        # what the latest kind with every count measured found: its best count and each
        # count's cost over the best's (a new kind starts from it: a core taken shows in every
        # kind alike, and 2 threads with a core taken cost 10-70x a forward)
        self.prior: tuple[int, dict[int, float]] | None = None

    def _start(self, most: int) -> int:
        """The count a new kind's first forwards run at: the latest measured kind's best (the
        user's count before any)."""
        if self.prior is None or self.prior[0] not in candidates(most):
            return most
        return self.prior[0]

    def _dear(self, n: int, kind: _Kind) -> bool:
        """Whether measuring count n for a young kind waits: another kind found it more than
        DEAR times its best (measured once the kind has run FIRST_WAIT forwards)."""
        return (self.prior is not None and self.prior[1].get(n, 1.0) > DEAR
                and kind.seen < FIRST_WAIT)

    def choose(self, key: tuple, most: int) -> int:
        """The count to run a forward of kind `key` with, under `most` threads."""
        with self._lock:
            kind = self.kinds.setdefault(key, _Kind())
            counts = candidates(most)
            if kind.seen < WARM:  # the first forwards (lazy set-up) at the prior's count
                return self._start(most)
            for n in counts:  # then every other count measured once (a dear one later)
                if n not in kind.cost and not self._dear(n, kind):
                    return n
            if not all(n in kind.cost for n in counts):  # a dear count not measured yet
                return min(kind.cost, key=kind.cost.__getitem__)
            best = kind.best if kind.best in counts else min(counts, key=kind.cost.__getitem__)
            stale = [n for n in counts if n != best and kind.age.get(n, 0) >= self.wait(kind, n, best)]
            return stale[0] if stale else best

    @staticmethod
    def wait(kind: _Kind, n: int, best: int) -> float:
        """Forwards before count n is measured again: the kind's wait, and at least as many as
        keep the re-measures' extra time under BUDGET of the run (a count 10x dearer than the
        one in use, as 2 threads with a core taken, is tried once per ~300 forwards)."""
        extra = kind.cost[n] / max(kind.cost[best], 1e-12) - 1.0  # per re-measure
        return max(kind.wait, extra / BUDGET)

    def record(self, key: tuple, most: int, threads: int, seconds: float) -> None:
        """A forward of kind `key` took `seconds` at `threads`."""
        with self._lock:
            kind = self.kinds.setdefault(key, _Kind())
            kind.seen += 1
            before = kind.best
            measured = all(n in kind.cost for n in candidates(most))  # not a first measure
            if threads == kind.best and threads in kind.cost:
                kind.cost[threads] += SMOOTH * (seconds - kind.cost[threads])
            else:
                kind.cost[threads] = seconds
            for n in kind.age:
                kind.age[n] += 1
            kind.age[threads] = 0
            counts = [n for n in candidates(most) if n in kind.cost]
            kind.best = min(counts, key=kind.cost.__getitem__)
            if len(counts) == len(candidates(most)) and kind.seen > WARM:
                best = kind.cost[kind.best]
                self.prior = (kind.best, {n: kind.cost[n] / max(best, 1e-12) for n in counts})
            if measured and kind.best != before:  # the choice changed: watch closely again
                kind.wait = FIRST_WAIT
            elif measured and threads != before:  # a re-measure confirmed it: wait longer
                kind.wait = min(2 * kind.wait, MAX_WAIT)

    @contextlib.contextmanager
    def run(self, key: tuple) -> Iterator[int]:
        """Run the body (one forward on our kernels) at the chosen count, timed, then give
        torch its count back. Yields the count."""
        most = torch.get_num_threads()
        if most <= 1 or os.environ.get(ENV, "1") == "0":
            yield most
            return
        key = tuple(_bucket(k) if isinstance(k, int) else k for k in key)
        n = self.choose(key, most)
        if n != most:
            torch.set_num_threads(n)
        start = self.clock()
        try:
            yield n
        finally:
            seconds = self.clock() - start
            if n != most:
                torch.set_num_threads(most)
        self.record(key, most, n, seconds)


GOVERNOR = Governor()  # the process's: one machine, one set of measurements


SMALL_SAMPLING = 1 << 22  # elements of p up to which standardizing and verifying run on 1 thread


@contextlib.contextmanager
def sampling_threads(numel: int) -> Iterator[None]:
    """Standardize and verify (torch's operators on [B, K+1, V]) on one thread when p has at
    most SMALL_SAMPLING elements (a step of up to ~85 rows x 49k tokens): a second thread saves
    nothing on so little work, and on a busy machine its waits cost a step 17% (plain decoding,
    one of two cores taken: docs/performance.md); and a reduction then never depends on the
    user's thread count, so p's bits do not either (for the same shapes). Larger p runs at the
    user's count."""
    most = torch.get_num_threads()
    if most <= 1 or numel > SMALL_SAMPLING:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(most)

