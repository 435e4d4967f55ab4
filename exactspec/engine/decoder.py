"""The decoder, the one engine object that `generate`, `batch` and the server drive: `admit`
rows (each with its own budget and stop rule, on the row), `step` them, `drop` rows nobody wants.

Invariant: the target's KV cache holds every token of a row but the last, which is fed at the
next step together with the drafts, so one forward of width K+1 scores all K drafts and gives
the distribution of the bonus token. A row that ends leaves the batch at the end of its step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from exactspec.drafters.base import Drafter, TargetInfo
from exactspec.engine.arguments import parse_verify
from exactspec.engine.commit import Clock, Report
from exactspec.engine.drafting import DraftSide
from exactspec.engine.policy import AUTO_MAX_DRAFT, DraftLengthPolicy
from exactspec.engine.rows import Row, RowBatch, RowOutput, check_fits
from exactspec.engine.step import decode_step
from exactspec.engine.stopping import StopRule
from exactspec.engine.verifier import Method, UserRule, Verifier
from exactspec.errors import InvalidValue
from exactspec.models.adapter import TargetAdapter
from exactspec.models.loading import Model, as_model
from exactspec.sampling import SamplingParams, Verdict, VerifyMethod
from exactspec.sampling.grammar import Grammar

VerifyFn = Callable[..., Verdict]


__all__ = ["DecodeConfig", "Decoder", "Row", "RowOutput", "VerifyFn"]


@dataclass
class DecodeConfig:
    """Everything about how rows are decoded, shared by every row of one decoder."""

    params: SamplingParams | Sequence[SamplingParams]  # shared, or one per row
    max_new_tokens: int  # the budget `make_row` gives a row (a row carries its own)
    num_draft_tokens: int | str  # K, or "auto"
    # the verify method, as `generate` gives it parsed (engine/arguments.py: a VerifyMethod or
    # a UserRule); a name or a callable like verify's (the server, scripts) is parsed here once
    verify: Method | str | VerifyFn
    return_logprobs: bool  # collect log p of each emitted token
    eos_token_ids: list[int]  # tokens that end a row
    stop: list[str]  # strings that end a row
    tokenizer: object | None  # for stop strings
    # the law of logprobs and top alternatives: "processed" (the standardized p each token
    # was drawn from, what RL needs) or "raw" (log_softmax of the model's raw logits)
    logprobs_mode: str = "processed"

    def __post_init__(self) -> None:
        if not isinstance(self.verify, VerifyMethod | UserRule):
            self.verify = parse_verify(self.verify)


class Decoder:
    """Decodes a changing set of rows: `admit(rows)` between steps, `step()` until empty,
    `drop(ids)` for rows nobody reads any more.

    One target adapter (KV cache) and one drafter serve every row; rows may carry different
    SamplingParams, seeds, budgets and stop rules (each row standardized with its own, equal
    ones together). An admission prefills the new rows alone, in the target and in the
    drafter (its admission hook); the running rows keep their caches. on_fault: "raise" (a
    drafter's exception propagates) or "plain" (the server: the rows in flight continue with
    plain decoding, which is exact, and the drafter restarts once they have all left).
    """

    def __init__(self, target: Model, drafter: Drafter | None, cfg: DecodeConfig, *,
                 on_fault: str = "raise") -> None:
        if on_fault not in ("raise", "plain"):
            raise ValueError(f"on_fault={on_fault!r} must be 'raise' or 'plain'")
        self.clock = Clock(torch.device("cpu"))  # the decode's start: prefill is timed from it
        self.model = as_model(target)  # the target model and its tokenizer
        self.cfg = cfg
        self.admitted = False  # whether rows were admitted before (their clocks start later)
        # the target's forward and KV cache; a speculative run's rare one-row steps do not
        # build the one-row weight copy
        self.target = TargetAdapter(self.model.model, one_row_copy=drafter is None)
        self.clock.on(self.target.device)
        k = 0 if drafter is None else cfg.num_draft_tokens
        self.extra_slots = 1 + (AUTO_MAX_DRAFT if k == "auto" else int(k))  # last token + drafts
        info = TargetInfo(self.target.vocab_size, self.model.tokenizer, self.target.model,
                          self.target)
        self.draft = DraftSide(drafter, info, on_fault=on_fault)  # the drafter and its faults
        self.policy = DraftLengthPolicy(k, 0)  # per-row draft lengths
        self.verifier = Verifier(cfg.verify, drafter)  # each step's verdict
        # the rows and their tensors (coupled: drafters draw with the positions' uniforms)
        self.batch = RowBatch(self.target.device, coupled=self.verifier.coupled is not None)
        self.report = Report(cfg.return_logprobs, cfg.logprobs_mode)

    @property
    def rows(self) -> list[Row]:
        """The rows still decoding, in batch order."""
        return self.batch.rows

    @property
    def drafter_faults(self) -> int:
        """Drafter exceptions survived so far (on_fault="plain")."""
        return self.draft.faults

    @torch.inference_mode()
    def admit(self, rows: list[Row]) -> None:
        """Prefill `rows` and add them to the batch; they join at the next step. A row whose
        prompt plus budget exceeds the context is refused (ValueError naming both numbers)
        before anything is prefilled."""
        if not rows:
            return
        self._check_grammars(rows)
        started = 0.0
        if self.admitted:  # a later admission: timed alone, its rows' clocks start here
            self.clock.lap()
            started = self.clock.last - self.clock.start
        self.admitted = True
        t0 = time.perf_counter()
        try:
            self._admit(rows)
        finally:  # a prefill is no step's cost: kept out of the policy's outside time
            self.policy.exclude(time.perf_counter() - t0)
        prefill = self.clock.lap()
        for r in rows:
            r.started = started
            r.output.stats.prefill_seconds = prefill

    def _admit(self, rows: list[Row]) -> None:
        """Prefill `rows` alone, in the target and the drafter, and append them to the batch
        (each row's budget is its own stop rule's max_new_tokens)."""
        target = self.target
        for r in rows:
            check_fits(len(r.prompt), r.stop.max_new_tokens, target.max_context)
        matchers = self.batch.matchers(rows, self.model.tokenizer, target.vocab_size)
        need = max(len(r.prompt) + r.stop.max_new_tokens for r in rows)
        cap = self.batch.capacity(need + self.extra_slots)
        prefill = target.admit if len(self.batch) else target.prefill
        hid0 = prefill([r.prompt[:-1] for r in rows],
                       capacity=min(need + self.extra_slots, target.max_context),
                       hidden_layers=self.draft.layers)  # [R, W, F] or None
        self.batch.add(rows, cap, self._features(len(rows), cap, hid0), matchers)
        self.policy.admit(len(rows), [len(r.prompt) for r in rows])
        lags = self.draft.admit(self.batch, len(self.batch) - len(rows))
        if lags is not None:  # None: a fault is pending, the drafter restarts later
            self.policy.drafter_lags(lags)

    def _features(self, num_rows: int, cap: int,
                  hid0: torch.Tensor | None) -> torch.Tensor | None:  # hid0 [R, W, F]
        """New rows' target-feature buffer [R, cap, F] (their prompts' features first), or
        None when the drafter reads none."""
        if self.draft.layers is None:
            return None
        config = self.target.model.config.get_text_config(decoder=True)
        feat = config.hidden_size * len(self.draft.layers)
        hidden = torch.zeros(num_rows, cap, feat, dtype=self.target.dtype,
                             device=self.target.device)
        if hid0 is not None:
            hidden[:, : hid0.shape[1]] = hid0
        return hidden

    def _check_grammars(self, rows: list[Row]) -> None:
        """Refuse a grammar where its output would not be the target's law restricted to it:
        token trees (their verification reads no grammar mask yet) and the lossy rules."""
        with_grammar = [r for r in rows if r.grammar is not None]
        if not with_grammar:
            return
        if self.verifier.tree is not None:
            raise InvalidValue(f"a grammar ({with_grammar[0].grammar!r}) with a token-tree "
                               "drafter is not supported; draft chains (no tree=) or "
                               "decode without the grammar")
        if self.verifier.refuses_grammar:
            raise InvalidValue(f"a grammar with the lossy verify={self.verifier.method.name!r} "
                               "is refused: "
                               "the output would be neither the target's law nor restricted "
                               "exactly; use verify='token', 'block', 'coupled' or 'greedy'")

    @torch.inference_mode()
    def step(self) -> list[tuple[Row, list[int]]]:
        """One step for every row; finished rows leave. Returns (row, new tokens) per row."""
        gained = decode_step(self.batch, self.target, self.draft, self.verifier, self.policy,
                             self.clock, self.report)
        self._keep([j for j, r in enumerate(self.batch.rows) if r.output.finish_reason is None])
        return gained

    def _keep(self, keep: list[int]) -> None:
        """Keep only the rows at batch positions `keep`, in that order, in every part."""
        if len(keep) == len(self.batch):
            return
        sel = self.batch.select(keep)  # [R] long
        self.policy.select(sel)
        if len(self.batch):  # an empty batch restarts both at the next admit (prefill, begin)
            self.target.select(sel)
        self.draft.select(self.batch, sel)

    @torch.inference_mode()
    def calibrate(self, prompt: list[int], *, passes: int = 2) -> float:
        """Measure what "auto" draft lengths need at one row before serving: one row decodes
        `prompt`'s continuation drafting K = 0, 1, ..., AUTO_MAX_DRAFT in turn, `passes` times
        (the first measurement of each width is dropped), then leaves. A server's first
        answers otherwise paid for the exploration (K started at 4 and climbed one width per
        AUTO_PROBE_EVERY steps; one slow measurement kept a width out). Returns the seconds
        taken; does nothing (0.0) without auto K or with rows in flight."""
        policy = self.policy
        if not policy.auto or self.rows or not prompt:
            return 0.0
        start = time.perf_counter()
        ks = list(range(AUTO_MAX_DRAFT + 1)) * passes
        budget = sum(k + 1 for k in ks)  # tokens, if every draft is kept
        keep = self.model.max_context - budget - AUTO_MAX_DRAFT - 1  # prompt tokens that fit
        if keep < 1:
            return 0.0
        row = self.make_row(-1, prompt[-keep:], SamplingParams(), 0, max_new_tokens=budget,
                            stop=[])
        row.stop.eos = set()  # the sweep runs its whole length
        policy.force(ks)
        self.admit([row])
        try:
            while self.rows and policy.forced:
                self.step()
        finally:
            policy.force([])
            self.drop([row.id])
        return time.perf_counter() - start

    def drop(self, ids) -> list[Row]:
        """Remove the rows with these ids (a client gone) before the next step; returns them."""
        ids = set(ids)
        gone = [r for r in self.batch.rows if r.id in ids]
        if gone:
            self._keep([j for j, r in enumerate(self.batch.rows) if r.id not in ids])
        return gone

    def make_row(self, id: int, prompt: list[int], params: SamplingParams,
                 stream_seed: int, *, max_new_tokens: int | None = None,
                 stop: list[str] | None = None, top_logprobs: int = 0,
                 coupled: bool = False, logprobs_mode: str | None = None,
                 grammar: Grammar | None = None) -> Row:
        """A row with this decoder's stop rule, or its own budget / stop strings; `coupled`:
        verified coupled whatever the decoder's method (Row.coupled; chains only: a tree
        drafter's step verifies every row with its tree rule); `logprobs_mode`: this row's
        law of logprobs ("raw" | "processed"; None: the decoder's); `grammar`: the row's
        output restricted to it (exactspec.sampling.grammar; refused with trees and lossy
        rules when admitted)."""
        cfg = self.cfg
        rule = StopRule(eos_token_ids=cfg.eos_token_ids,
                        stop=cfg.stop if stop is None else list(stop), tokenizer=cfg.tokenizer,
                        max_new_tokens=cfg.max_new_tokens if max_new_tokens is None
                        else max_new_tokens)
        return Row(id, list(prompt), params, stream_seed, rule, top_logprobs=top_logprobs,
                   coupled=coupled, logprobs_mode=logprobs_mode, grammar=grammar)
