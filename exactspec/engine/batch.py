"""The batch state: every per-row tensor of the rows being decoded, with one `select` and `admit`.

A row is one request: its prompt, its SamplingParams, its random stream, its stop rule and its
growing output. The state owns the token buffer, lengths, target features and streams of all
rows; `select` keeps a subset (finished rows leave) and `admit` appends new rows between steps,
in the target's KV cache, the drafter and the draft-length policy too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from exactspec.drafters.base import DraftContext, Drafter, TargetInfo, admit_rows
from exactspec.engine.grammar import GrammarRows
from exactspec.engine.policy import DraftLengthPolicy
from exactspec.engine.results import GenerationStats
from exactspec.engine.stopping import StopRule
from exactspec.errors import InvalidValue
from exactspec.models.adapter import TargetAdapter
from exactspec.sampling import RowStreams, SamplingParams
from exactspec.sampling.grammar import Grammar
from exactspec.sampling.standardize import law_groups

log = logging.getLogger(__name__)
FAULT = object()  # what BatchState.guard returns for a drafter call that raised


def check_fits(prompt: int, max_new_tokens: int, context: int) -> None:
    """A row's prompt plus its token budget must fit the model's context."""
    if prompt + max_new_tokens > context:
        raise InvalidValue(
            f"prompt of {prompt} tokens plus max_new_tokens={max_new_tokens} is "
            f"{prompt + max_new_tokens} tokens, more than the model's context of {context}; "
            "shorten the prompt or lower max_new_tokens")


@dataclass
class RowOutput:
    """One row's growing output inside the loop."""

    tokens: list[int] = field(default_factory=list)  # generated token ids
    logprobs: list[float] = field(default_factory=list)  # log p per token, if asked
    stats: GenerationStats = field(default_factory=GenerationStats)
    finish_reason: str | None = None  # set when the row ends
    cut: int | None = None  # where a stop string starts in the decoded text
    # per emitted token, the row's top_logprobs (token id, log p) pairs with p > 0, most likely
    # first; taken from the p the step verified with, so the emitted token's own entry is its
    # logprob exactly
    top: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class Row:
    """One request: what it decodes from, how, and what it has produced."""

    id: int  # the caller's index for this row
    prompt: list[int]  # token ids, non-empty
    params: SamplingParams  # p (and q) of this row are standardized with these
    stream_seed: int  # the row's 64-bit stream seed (RowStreams.seeds entry)
    stop: StopRule  # when the row ends
    output: RowOutput = field(default_factory=RowOutput)  # tokens so far, stats
    started: float = 0.0  # seconds from the decoder's start to the row's admission
    top_logprobs: int = 0  # also keep the k most likely tokens of p at each emitted position
    # verify this row with coupled verification whatever the decoder's method (the server's
    # seeded requests): its text is plain decoding's for its seed, at any K (sampling/coupled.py)
    coupled: bool = False
    logprobs_mode: str | None = None  # "raw" | "processed": this row's law of logprobs; None:
    # the decoder's (DecodeConfig.logprobs_mode)
    grammar: Grammar | None = None  # the row's output is restricted to this (engine/grammar.py)


class BatchState:
    """The rows in flight and their tensors, aligned by batch position.

    Invariant: the target's KV cache holds every token of a row but the last, which is fed at
    the next step together with the drafts.
    """

    def __init__(self, target: TargetAdapter, drafter: Drafter | None, info: TargetInfo,
                 policy: DraftLengthPolicy, layers: tuple[int, ...] | None,
                 extra_slots: int) -> None:
        self.target = target  # the target's forward and KV cache
        self.drafter = drafter  # NoDrafter for plain decoding
        self.info = info  # what the drafter may check about the target
        self.policy = policy  # per-row draft lengths
        self.layers = layers  # target features the drafter reads, or None
        self.extra_slots = extra_slots  # slots past max_new_tokens: the last token + drafts
        dev = target.device
        self.rows: list[Row] = []  # [B] in batch order
        self.tokens = torch.full((0, 1), -1, dtype=torch.long, device=dev)  # [B, cap] -1 padded
        self.lengths = torch.zeros(0, dtype=torch.long, device=dev)  # [B] real tokens
        self.prompt_lengths = torch.zeros(0, dtype=torch.long, device=dev)  # [B]
        self.hidden: torch.Tensor | None = None  # [B, cap, F] target features, if `layers`
        self.streams = RowStreams(torch.zeros(0, dtype=torch.long, device=dev))  # [B]
        self._groups: list | None = None  # law_groups of the rows' params, cached
        # drafter faults: "raise" (generate, batch) or "plain" (the server: the rows in flight
        # when the drafter raised finish plain, the drafter restarts once they all left)
        self.on_fault = "raise"
        self.faulted: set[int] | None = None  # ids of the rows in flight at a fault, pending
        self.faults = 0  # drafter faults survived so far
        self.coupled = False  # coupled verification: drafters draw with the positions' uniforms
        self.grammar: GrammarRows | None = None  # the rows' grammar matchers, once a row has one

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def params(self) -> list[SamplingParams]:
        return [r.params for r in self.rows]

    @property
    def groups(self) -> list[tuple[SamplingParams, torch.Tensor | None]]:
        """Rows grouped by law, for standardizing each group in one call."""
        if self._groups is None:
            self._groups = law_groups(self.params)
        return self._groups

    @property
    def greedy(self) -> bool:
        """Whether every row decodes greedily (temperature 0: each p is a one-hot)."""
        return all(law.is_greedy for law, _ in self.groups)

    def context(self) -> DraftContext:
        groups = self.groups
        shared = groups[0][0] if len(groups) == 1 and groups[0][1] is None else None
        return DraftContext(self.tokens, self.lengths, self.prompt_lengths, shared, self.streams,
                            self.hidden, None if shared is not None else tuple(self.params),
                            self.coupled or self.coupled_rows(),
                            self.grammar if self.grammar is not None and self.grammar.active
                            else None)

    def coupled_rows(self) -> torch.Tensor | bool:
        """[B] bool: the rows verified coupled by their own choice (`Row.coupled`); False when
        none is (or the whole decoder is coupled: `self.coupled`)."""
        if self.coupled or not any(r.coupled for r in self.rows):
            return False
        return torch.tensor([r.coupled for r in self.rows], device=self.target.device)

    def admit(self, rows: list[Row]) -> None:
        """Prefill `rows` and append them after the current ones (between steps). Each row's
        budget is its own stop rule's max_new_tokens; the running rows are not touched (the
        target and the drafter prefill the new rows alone)."""
        t0 = time.perf_counter()
        try:
            self._admit(rows)
        finally:  # a prefill is no step's cost: kept out of the policy's outside time
            self.policy.exclude(time.perf_counter() - t0)

    def _admit(self, rows: list[Row]) -> None:
        target, dev = self.target, self.target.device
        for r in rows:
            check_fits(len(r.prompt), r.stop.max_new_tokens, target.max_context)
        matchers = self._matchers(rows)  # before any prefill: a grammar error leaves no trace
        need = max(len(r.prompt) + r.stop.max_new_tokens for r in rows)
        cap = max(need + self.extra_slots, self.tokens.shape[1] if self.rows else 0)
        prefill = target.admit if self.rows else target.prefill
        hid0 = prefill([r.prompt[:-1] for r in rows],
                       capacity=min(need + self.extra_slots, target.max_context),
                       hidden_layers=self.layers)  # [R, W, F] or None
        tokens = torch.full((len(rows), cap), -1, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r.prompt)] = torch.tensor(r.prompt, dtype=torch.long)
        lengths = torch.tensor([len(r.prompt) for r in rows], dtype=torch.long, device=dev)
        hidden = None
        if self.layers is not None:
            feat = target.model.config.get_text_config(decoder=True).hidden_size * len(self.layers)
            hidden = torch.zeros(len(rows), cap, feat, dtype=target.dtype, device=dev)
            if hid0 is not None:
                hidden[:, : hid0.shape[1]] = hid0
        seeds = torch.tensor([r.stream_seed for r in rows], dtype=torch.long, device=dev)
        old = bool(self.rows)
        self.tokens = _cat_padded(self.tokens, tokens.to(dev), -1) if old else tokens.to(dev)
        self.hidden = (_cat_padded(self.hidden, hidden, 0) if old and hidden is not None
                       else hidden)
        self.lengths = torch.cat([self.lengths, lengths])
        self.prompt_lengths = torch.cat([self.prompt_lengths, lengths.clone()])
        self.streams = RowStreams(torch.cat([self.streams.seeds, seeds]),
                                  torch.cat([self.streams.steps, torch.zeros_like(seeds)]))
        self.rows += rows
        if matchers is not None:
            self.grammar.rows += matchers
        self._groups = None
        self.policy.admit(len(rows), [len(r.prompt) for r in rows])
        if self.faulted is None:  # while a fault is pending the drafter restarts later
            start = len(self.rows) - len(rows)
            self.guard(admit_rows, self.drafter, self.context(), self.info, start)
            # a drafter that reads the target's cache never lags (no catch-up to charge)
            self.policy.lagging = getattr(self.drafter, "lags_behind", True)
            if not self.policy.lagging:
                self.policy.lag.zero_()

    def _matchers(self, rows: list[Row]) -> list | None:
        """The new rows' grammar matchers (None for a row without a grammar), or None when no
        row ever had a grammar."""
        if self.grammar is None:
            if all(r.grammar is None for r in rows):
                return None
            eos = sorted(set().union(*(r.stop.eos for r in rows)))
            self.grammar = GrammarRows(self.info.tokenizer, eos, self.target.vocab_size)
            self.grammar.rows = [None] * len(self.rows)
        return [self.grammar.matcher(r.grammar) for r in rows]

    def select(self, keep: list[int]) -> None:
        """Keep only the rows at batch positions `keep`, in that order, everywhere."""
        if len(keep) == len(self.rows):
            return
        sel = torch.tensor(keep, dtype=torch.long, device=self.target.device)
        self.rows = [self.rows[j] for j in keep]
        if self.grammar is not None:
            self.grammar.select(keep)
        self._groups = None
        self.tokens, self.lengths = self.tokens[sel], self.lengths[sel]
        self.prompt_lengths = self.prompt_lengths[sel]
        self.hidden = self.hidden[sel] if self.hidden is not None else None
        self.streams = self.streams.select(sel)
        self.policy.select(sel)
        if self.rows:  # an empty batch restarts both at the next admit (prefill, begin)
            self.target.select(sel)
            if self.faulted is None:
                self.guard(self.drafter.select, sel)
        else:
            self.faulted = None

    def guard(self, call, *args):
        """`call(*args)` for a drafter; under on_fault="plain" a raise is logged, the rows in
        flight continue plain, and FAULT is returned instead of the call's result."""
        if self.on_fault == "raise":
            return call(*args)
        try:
            return call(*args)
        except Exception:
            log.exception("the drafter %s failed; the %d rows in flight continue with plain "
                          "decoding", type(self.drafter).__name__, len(self.rows))
            self.faulted = {r.id for r in self.rows}
            self.faults += 1
            return FAULT

    def drafting(self) -> bool:
        """Whether this step may draft: no fault pending, or every row that saw the last fault
        has left (then the drafter restarts over the rows in flight, with `begin`)."""
        if self.faulted is None:
            return True
        if self.faulted & {r.id for r in self.rows}:
            return False
        self.faulted = None
        return self.guard(self.drafter.begin, self.context(), self.info) is not FAULT

    def append(self, emitted: torch.Tensor,  # [B, K+1] verified tokens, -1 padded
               counts: torch.Tensor,  # [B] long: how many of them each row keeps
               feats: torch.Tensor | None) -> None:  # [B, K+1, F] target features or None
        """Write each row's kept tokens (and the step's features) after its context."""
        cols = torch.arange(emitted.shape[1], device=emitted.device)
        idx = (self.lengths[:, None] + cols).clamp(max=self.tokens.shape[1] - 1)  # [B, K+1]
        write = cols[None, :] < counts[:, None]
        self.tokens.scatter_(1, idx, torch.where(write, emitted, self.tokens.gather(1, idx)))
        if self.hidden is not None:  # features of the last token and the drafts, by position
            pos = (self.lengths - 1)[:, None] + cols  # [B, K+1]
            cap = self.hidden.shape[1]
            self.hidden.scatter_(1, pos.clamp(max=cap - 1)[..., None]
                                 .expand(-1, -1, self.hidden.shape[2]), feats.to(self.hidden.dtype))
        self.lengths = self.lengths + counts
        if self.grammar is not None:  # each row's matcher takes the tokens it kept
            self.grammar.advance(emitted, counts)


def _cat_padded(a: torch.Tensor, b: torch.Tensor, fill: float) -> torch.Tensor:
    """Rows of `a` then rows of `b` ([Ra, Ta, ...], [Rb, Tb, ...]), dim 1 padded with `fill`."""
    width = max(a.shape[1], b.shape[1])

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.shape[1] == width:
            return t
        return torch.cat([t, t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), fill)], 1)

    return torch.cat([pad(a), pad(b)])
