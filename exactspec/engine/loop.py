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

from exactspec.drafters.base import Drafter, TargetInfo, trusts_q
from exactspec.engine.batch import BatchState, Row, RowOutput
from exactspec.engine.policy import AUTO_MAX_DRAFT, DraftLengthPolicy
from exactspec.engine.step import (
    Clock,
    NoDrafter,
    StepRules,
    decode_step,
    greedy_shortcut,
    plain_rule,
)
from exactspec.engine.stopping import StopRule
from exactspec.engine.tree_step import tree_rule
from exactspec.errors import InvalidValue
from exactspec.models.adapter import TargetAdapter
from exactspec.models.loading import Model, as_model
from exactspec.sampling import (
    DOMAIN_RESAMPLE,
    SamplingParams,
    Verdict,
    VerifyMethod,
    parse_method,
    sample,
)
from exactspec.sampling.grammar import Grammar

VerifyFn = Callable[..., Verdict]


__all__ = ["DecodeConfig", "Decoder", "Row", "RowOutput", "VerifyFn"]


@dataclass
class DecodeConfig:
    """Everything about how rows are decoded, shared by every row of one decoder."""

    params: SamplingParams | Sequence[SamplingParams]  # shared, or one per row
    max_new_tokens: int  # the budget `make_row` gives a row (a row carries its own)
    num_draft_tokens: int | str  # K, or "auto"
    verify: VerifyMethod | str | VerifyFn  # a method (or its name) | a callable like verify's
    return_logprobs: bool  # collect log p of each emitted token
    eos_token_ids: list[int]  # tokens that end a row
    stop: list[str]  # strings that end a row
    tokenizer: object | None  # for stop strings
    # the law of logprobs and top alternatives: "processed" (the standardized p each token
    # was drawn from, what RL needs) or "raw" (log_softmax of the model's raw logits)
    logprobs_mode: str = "processed"


def verify_rule(drafter: Drafter | None, verify_arg: VerifyMethod | str | VerifyFn):
    """The step's acceptance rule: the plain draw without a drafter, else `verify_arg`."""
    if drafter is None:
        return plain_rule
    if callable(verify_arg):
        return lambda p, x, q, streams: verify_arg(p, x, q, generator=streams)
    # p is made by the engine and a user drafter's q is checked before: no second check
    method = parse_method(verify_arg)
    law = method.chain_law  # traversal's chain law is block's
    exact = method.name in ("token", "block", "traversal")

    def rule(p, x, q, streams):
        if exact and x.shape[1] == 0:  # no row drafted (auto's K = 0): plain decoding's cost
            return bonus_rule(p, streams)
        return law(p, x, q, check=False).draw(streams)

    return rule


def bonus_rule(p: torch.Tensor, streams) -> Verdict:  # p [B, 1, V]
    """An exact chain law's verdict when no row drafted: its bonus token, drawn from p with the
    uniform the law would use (the same token), without building the law."""
    tok = sample(p[:, 0], streams, domain=DOMAIN_RESAMPLE)  # [B]
    return Verdict(tokens=tok[:, None], num_accepted=torch.zeros_like(tok))


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
            TargetInfo(adapter.vocab_size, target.tokenizer, adapter.model, adapter),
            DraftLengthPolicy(k, 0), tuple(layers) if layers is not None else None, extra)
        self.batch.on_fault = on_fault
        coupled = None if callable(cfg.verify) else parse_method(cfg.verify)
        coupled = coupled if coupled is not None and coupled.coupled else None
        self.batch.coupled = coupled is not None  # drafters draw with the positions' uniforms
        self.rules = StepRules(
            verify=verify_rule(drafter, cfg.verify),
            check_q=not trusts_q(self.batch.drafter),
            return_logprobs=cfg.return_logprobs, logprobs_mode=cfg.logprobs_mode,
            tree_step=tree_rule(drafter, cfg.verify),
            greedy_verify=greedy_shortcut(drafter, cfg.verify), coupled=coupled)

    @property
    def rows(self) -> list[Row]:
        """The rows still decoding, in batch order."""
        return self.batch.rows

    @property
    def drafter_faults(self) -> int:
        """Drafter exceptions survived so far (on_fault="plain")."""
        return self.batch.faults

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
        self.batch.admit(rows)
        prefill = self.clock.lap()
        for r in rows:
            r.started = started
            r.output.stats.prefill_seconds = prefill

    def _check_grammars(self, rows: list[Row]) -> None:
        """Refuse a grammar where its output would not be the target's law restricted to it:
        token trees (their verification reads no grammar mask yet) and the lossy rules."""
        with_grammar = [r for r in rows if r.grammar is not None]
        if not with_grammar:
            return
        if self.rules.tree_step is not None:
            raise InvalidValue(f"a grammar ({with_grammar[0].grammar!r}) with a token-tree "
                               "drafter is not supported; draft chains (no tree=) or "
                               "decode without the grammar")
        method = None if callable(self.cfg.verify) else parse_method(self.cfg.verify)
        if method is not None and not method.lossless:
            raise InvalidValue(f"a grammar with the lossy verify={method.name!r} is refused: "
                               "the output would be neither the target's law nor restricted "
                               "exactly; use verify='token', 'block', 'coupled' or 'greedy'")

    @torch.inference_mode()
    def step(self) -> list[tuple[Row, list[int]]]:
        """One step for every row; finished rows leave. Returns (row, new tokens) per row."""
        gained = decode_step(self.batch, self.rules, self.clock)
        alive = [j for j, r in enumerate(self.batch.rows) if r.output.finish_reason is None]
        self.batch.select(alive)
        return gained

    @torch.inference_mode()
    def calibrate(self, prompt: list[int], *, passes: int = 2) -> float:
        """Measure what "auto" draft lengths need at one row before serving: one row decodes
        `prompt`'s continuation drafting K = 0, 1, ..., AUTO_MAX_DRAFT in turn, `passes` times
        (the first measurement of each width is dropped), then leaves. A server's first
        answers otherwise paid for the exploration (K started at 4 and climbed one width per
        AUTO_PROBE_EVERY steps; one slow measurement kept a width out). Returns the seconds
        taken; does nothing (0.0) without auto K or with rows in flight."""
        policy = self.batch.policy
        if not policy.auto or self.rows or not prompt:
            return 0.0
        start = time.perf_counter()
        ks = list(range(AUTO_MAX_DRAFT + 1)) * passes
        budget = sum(k + 1 for k in ks)  # tokens, if every draft is kept
        keep = self.target.max_context - budget - AUTO_MAX_DRAFT - 1  # prompt tokens that fit
        if keep < 1:
            return 0.0
        row = self.make_row(-1, prompt[-keep:], SamplingParams(), 0, max_new_tokens=budget,
                            stop=[])
        row.stop.eos = set()  # the sweep runs its whole length
        policy.forced.extend(ks)
        self.admit([row])
        try:
            while self.rows and policy.forced:
                self.step()
        finally:
            policy.forced.clear()
            self.drop([row.id])
        return time.perf_counter() - start

    def drop(self, ids) -> list[Row]:
        """Remove the rows with these ids (a client gone) before the next step; returns them."""
        ids = set(ids)
        gone = [r for r in self.batch.rows if r.id in ids]
        if gone:
            self.batch.select([j for j, r in enumerate(self.batch.rows) if r.id not in ids])
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
