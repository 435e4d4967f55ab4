"""The decoder: rows in, one `decode_step` at a time, rows out; `admit` adds rows between steps.

Invariant: the target's KV cache holds every token of a row but the last, which is fed at the
next step together with the drafts, so one forward of width K+1 scores all K drafts and gives
the distribution of the bonus token. A row that ends leaves the batch at the end of its step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from exactspec.drafters.base import Drafter, TargetInfo
from exactspec.engine.batch import BatchState, Row, RowOutput
from exactspec.engine.policy import AUTO_MAX_DRAFT, DraftLengthPolicy
from exactspec.engine.step import Clock, NoDrafter, StepRules, decode_step, plain_rule
from exactspec.engine.stopping import StopRule
from exactspec.engine.tree_step import tree_rule
from exactspec.models.adapter import TargetAdapter
from exactspec.models.loading import Model, as_model
from exactspec.sampling import RowStreams, SamplingParams, Verdict, verify

VerifyFn = Callable[..., Verdict]


def engine_made(drafter: Drafter) -> bool:
    """Whether the drafter's q is made by exactspec's own code (its class is defined inside
    exactspec, where q comes from probs_from_logits): then it is not re-validated per step.
    A user's drafter, a subclass of ours included, has its q checked every step."""
    return type(drafter).__module__.split(".")[0] == "exactspec"


__all__ = ["BatchDecoder", "DecodeConfig", "Decoder", "Row", "RowOutput", "VerifyFn"]


@dataclass
class DecodeConfig:
    """Everything about how rows are decoded, shared by every row of one decoder."""

    params: SamplingParams | Sequence[SamplingParams]  # shared, or one per row (BatchDecoder)
    max_new_tokens: int  # per row
    num_draft_tokens: int | str  # K, or "auto"
    verify: str | VerifyFn  # "token" | "block" | "greedy" | a callable with verify's signature
    return_logprobs: bool  # collect log p of each emitted token
    eos_token_ids: list[int]  # tokens that end a row
    stop: list[str]  # strings that end a row
    tokenizer: object | None  # for stop strings

    def stop_rule(self) -> StopRule:
        return StopRule(eos_token_ids=self.eos_token_ids, stop=self.stop,
                        tokenizer=self.tokenizer, max_new_tokens=self.max_new_tokens)


def verify_rule(drafter: Drafter | None, verify_arg: str | VerifyFn):
    """The step's acceptance rule: the plain draw without a drafter, else `verify_arg`."""
    if drafter is None:
        return plain_rule
    if callable(verify_arg):
        return lambda p, x, q, streams: verify_arg(p, x, q, generator=streams)
    # p is made by the engine and a user drafter's q is checked before: no second check
    method = "block" if verify_arg == "traversal" else verify_arg  # traversal on a chain
    return lambda p, x, q, streams: verify(p, x, q, method=method, generator=streams,
                                           check=False)


class Decoder:
    """Decodes a changing set of rows: `admit(rows)` between steps, `step()` until empty.

    One target adapter (KV cache) and one drafter serve every row; rows may carry different
    SamplingParams and seeds (each row standardized with its own, equal ones together).
    """

    def __init__(self, target: Model, drafter: Drafter | None, cfg: DecodeConfig) -> None:
        self.clock = Clock(torch.device("cpu"))  # the decode's start: prefill is timed from it
        target = as_model(target)
        self.target = target
        self.cfg = cfg
        self.admitted = False  # whether rows were admitted before (their clocks start later)
        # a speculative run's rare one-row steps do not build the one-row weight copy
        adapter = TargetAdapter(target.model, one_row_copy=drafter is None)
        self.clock.device = adapter.device
        k = 0 if drafter is None else cfg.num_draft_tokens
        extra = 1 + (AUTO_MAX_DRAFT if k == "auto" else int(k))  # the last token + drafts
        layers = None if drafter is None else drafter.hidden_layers
        self.batch = BatchState(
            adapter, drafter if drafter is not None else NoDrafter(),
            TargetInfo(adapter.vocab_size, target.tokenizer, adapter.model),
            DraftLengthPolicy(k, 0), tuple(layers) if layers is not None else None, extra)
        self.rules = StepRules(
            verify=verify_rule(drafter, cfg.verify),
            check_q=not engine_made(self.batch.drafter),
            max_new_tokens=cfg.max_new_tokens, return_logprobs=cfg.return_logprobs,
            tree_step=tree_rule(drafter, cfg.verify))

    @property
    def rows(self) -> list[Row]:
        """The rows still decoding, in batch order."""
        return self.batch.rows

    @torch.inference_mode()
    def admit(self, rows: list[Row]) -> None:
        """Prefill `rows` and add them to the batch; they join at the next step."""
        if not rows:
            return
        started = 0.0
        if self.admitted:  # a later admission: timed alone, its rows' clocks start here
            self.clock.lap()
            started = self.clock.last - self.clock.start
        self.admitted = True
        self.batch.admit(rows, self.cfg.max_new_tokens)
        prefill = self.clock.lap()
        for r in rows:
            r.started = started
            r.output.stats.prefill_seconds = prefill

    @torch.inference_mode()
    def step(self) -> list[tuple[Row, list[int]]]:
        """One step for every row; finished rows leave. Returns (row, new tokens) per row."""
        gained = decode_step(self.batch, self.rules, self.clock)
        alive = [j for j, r in enumerate(self.batch.rows) if r.output.finish_reason is None]
        self.batch.select(alive)
        return gained

    def make_row(self, id: int, prompt: list[int], params: SamplingParams,
                 stream_seed: int) -> Row:
        return Row(id, list(prompt), params, stream_seed, self.cfg.stop_rule())


class BatchDecoder:
    """One fixed batch of prompts; `run()` yields (row, new token ids) after every step.

    `outputs[i]` is row i's growing output; `streams` holds one stream per row.
    """

    def __init__(self, target: Model, drafter: Drafter | None, prompts: list[list[int]],
                 streams: RowStreams, cfg: DecodeConfig) -> None:
        self.decoder = Decoder(target, drafter, cfg)
        params = (list(cfg.params) if not isinstance(cfg.params, SamplingParams)
                  else [cfg.params] * len(prompts))
        seeds = streams.seeds.tolist()
        self._rows = [self.decoder.make_row(i, p, params[i], seeds[i])
                      for i, p in enumerate(prompts)]
        self.outputs = [r.output for r in self._rows]  # indexed like `prompts`

    def run(self) -> Iterator[tuple[int, list[int]]]:
        self.decoder.admit(self._rows)
        while self.decoder.rows:
            for row, new in self.decoder.step():
                if new:
                    yield row.id, new
