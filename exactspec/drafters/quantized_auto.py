"""What QuantizedDraft(backend="auto") drafts with on the CPU: llama.cpp or the torch kernels.

Neither wins everywhere: llama.cpp's fused Q8_0 / Q4_0 kernels against our own int8 / int4
lean forward (`exactspec/kernels`) depends on the model's size, the CPU and the instruction set.
So "auto" measures: once per process, target and bits, it times a few draft steps of each backend on a one-row synthetic context (a 16-token prompt, greedy, its own
random streams: the real rows' streams are not touched), keeps the faster, and logs one line
with both costs. Not again after an in-place weight update (an RL step): a step's cost depends
on the shapes, not on the values, and a re-measure would rebuild the losing backend's copy at
every policy step. `EXACTSPEC_QUANTIZED_BACKEND=torch|llama.cpp` forces the pick without timing
(tests, reproducible benchmarks); it decides only where both backends can run (a tree, a layer
subset or bits=16 still mean torch), and forcing llama.cpp where it is missing or failed its
smoke test on this machine (drafters/llama_cpp_check.py) is refused in one line. Either choice is exact: the
backend only changes how often drafts are accepted and what a draft token costs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Callable

import torch

from exactspec.drafters.base import DraftContext, TargetInfo
from exactspec.errors import InvalidValue
from exactspec.sampling import RowStreams, SamplingParams

log = logging.getLogger(__name__)

ENV = "EXACTSPEC_QUANTIZED_BACKEND"  # forces auto's pick: "torch" or "llama.cpp"
CHOICES = ("torch", "llama.cpp")
PROMPT_LEN = 16  # synthetic prompt tokens
STEPS = 4  # draft tokens per timed propose
REPEATS = 3  # timed proposes per backend (the fastest counts), after one untimed warm-up

# target -> {bits: picked backend}; forgotten with the target
_PICKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# target -> {bits: {backend: seconds per draft token}}, as logged
COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forced() -> str | None:
    """The backend EXACTSPEC_QUANTIZED_BACKEND forces, or None (unset or empty)."""
    value = os.environ.get(ENV, "")
    if not value:
        return None
    if value not in CHOICES:
        raise InvalidValue(f"{ENV}={value!r} must be one of {list(CHOICES)} (or unset, to "
                           "pick the faster one by measurement)")
    return value


def pick(model, target: TargetInfo, bits: int,
         drafters: dict[str, Callable[[], object]]) -> str:
    """The backend for `model` (both can run it): forced by the environment, else the faster
    of `drafters` (backend -> a function giving a drafter to time), measured once per target
    and bits and cached."""
    force = forced()
    if force is not None:
        return force
    key = bits
    done = _PICKED.setdefault(model, {})
    if key in done:
        return done[key]
    costs = {name: _cost(make(), target) for name, make in drafters.items()}
    choice = min(costs, key=costs.__getitem__)
    log.info("QuantizedDraft(%d bits, backend='auto'): %s per draft token (1 row, rough): "
             "picks %s", bits,
             ", ".join(f"{n} {c * 1e3:.2f} ms" for n, c in costs.items()), choice)
    done[key] = choice
    COSTS.setdefault(model, {})[key] = costs
    return choice


@torch.inference_mode()
def _cost(drafter, target: TargetInfo) -> float:
    """Seconds per draft token of `drafter`: the fastest of REPEATS proposes of STEPS tokens."""
    prompt = (torch.arange(PROMPT_LEN) * 7 + 1) % target.vocab_size  # [P]
    tokens = torch.full((1, PROMPT_LEN + STEPS + 8), -1, dtype=torch.long)  # [1, T]
    tokens[0, :PROMPT_LEN] = prompt
    lengths = torch.tensor([PROMPT_LEN])
    context = DraftContext(tokens, lengths, lengths.clone(), SamplingParams(temperature=0),
                           RowStreams.from_seed(0, 1))
    want = torch.tensor([STEPS])
    # a context of its own, not the target's rows: no target cache to share
    drafter.begin(context, dataclasses.replace(target, adapter=None))
    drafter.propose(context, want)  # warm-up: the prompt's last token, first-call costs
    best = float("inf")
    for _ in range(REPEATS):  # each rolls back to the prompt: STEPS draft forwards
        t0 = time.perf_counter()
        drafter.propose(context, want)
        best = min(best, time.perf_counter() - t0)
    return best / STEPS
