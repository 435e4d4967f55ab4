"""The rows being decoded and their tensors, aligned by batch position.

A row is one request: its prompt, its SamplingParams, its random stream, its stop rule and its
growing output. `RowBatch` holds the rows and their token buffer, lengths, target features,
streams and grammar matchers, nothing else (the target, the drafter and the policy are the
decoder's other parts); `add` appends rows between steps, `select` keeps a subset (finished rows
leave), `append` writes a step's kept tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from exactspec.drafters.base import DraftContext
from exactspec.engine.grammar import GrammarRows
from exactspec.engine.results import GenerationStats
from exactspec.engine.stopping import StopRule
from exactspec.errors import InvalidValue
from exactspec.sampling import RowStreams, SamplingParams
from exactspec.sampling.grammar import Grammar
from exactspec.sampling.standardize import law_groups


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


class RowBatch:
    """The rows in flight and their tensors, aligned by batch position.

    Invariant: the target's KV cache holds every token of a row but the last, which is fed at
    the next step together with the drafts.
    """

    def __init__(self, device: torch.device, *, coupled: bool) -> None:
        self.device = device  # the target's: every tensor lives there
        self.coupled = coupled  # every row draws coupled (the verifier's method is coupled)
        self.rows: list[Row] = []  # [B] in batch order
        self.tokens = torch.full((0, 1), -1, dtype=torch.long, device=device)  # [B, cap] -1 padded
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)  # [B] real tokens
        self.prompt_lengths = torch.zeros(0, dtype=torch.long, device=device)  # [B]
        self.hidden: torch.Tensor | None = None  # [B, cap, F] target features, if read
        self.streams = RowStreams(torch.zeros(0, dtype=torch.long, device=device))  # [B]
        self._groups: list | None = None  # law_groups of the rows' params, cached
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
        """The rows as a drafter sees them (drafters/base.py)."""
        groups = self.groups
        shared = groups[0][0] if len(groups) == 1 and groups[0][1] is None else None
        return DraftContext(self.tokens, self.lengths, self.prompt_lengths, shared, self.streams,
                            self.hidden, None if shared is not None else tuple(self.params),
                            self.coupled or self.coupled_rows(),
                            self.grammar if self.grammar is not None and self.grammar.active
                            else None)

    def coupled_rows(self) -> torch.Tensor | bool:
        """[B] bool: the rows verified coupled by their own choice (`Row.coupled`); False when
        none is (or every row is: `self.coupled`)."""
        if self.coupled or not any(r.coupled for r in self.rows):
            return False
        return torch.tensor([r.coupled for r in self.rows], device=self.device)

    def output_positions(self, n: int) -> torch.Tensor:  # [B, n] long
        """Each row's next n output positions (0 = its first generated token)."""
        return self.context().output_positions(0, n)

    def room(self, max_context: int) -> torch.Tensor:  # [B] long, on the CPU
        """Drafts each row could still emit: its budget less the token every step emits, and
        what the context leaves (negative for a row at its end)."""
        room = torch.tensor([r.stop.max_new_tokens - len(r.output.tokens) for r in self.rows])
        return torch.minimum(room - 1, max_context - self.lengths.cpu())

    def last_tokens(self) -> torch.Tensor:  # [B, 1] long
        """Each row's last token, the one the target has not seen yet."""
        return self.tokens.gather(1, (self.lengths - 1)[:, None])

    def capacity(self, need: int) -> int:
        """Token slots per row once rows needing `need` slots join."""
        return max(need, self.tokens.shape[1] if self.rows else 0)

    def matchers(self, rows: list[Row], tokenizer, vocab: int) -> list | None:
        """The new rows' grammar matchers (None for a row without a grammar), or None when no
        row ever had a grammar. Built before any prefill: a grammar error leaves no trace."""
        if self.grammar is None:
            if all(r.grammar is None for r in rows):
                return None
            eos = sorted(set().union(*(r.stop.eos for r in rows)))
            self.grammar = GrammarRows(tokenizer, eos, vocab)
            self.grammar.rows = [None] * len(self.rows)
        return [self.grammar.matcher(r.grammar) for r in rows]

    def add(self, rows: list[Row], cap: int, hidden: torch.Tensor | None,  # [R, cap, F]
            matchers: list | None) -> None:
        """Append `rows` (prefilled by the target) after the current ones, with `cap` token
        slots each and their target features (None unless the drafter reads them)."""
        dev = self.device
        tokens = torch.full((len(rows), cap), -1, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r.prompt)] = torch.tensor(r.prompt, dtype=torch.long)
        lengths = torch.tensor([len(r.prompt) for r in rows], dtype=torch.long, device=dev)
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

    def select(self, keep: list[int]) -> torch.Tensor:  # [R] long
        """Keep only the rows at batch positions `keep`, in that order; returns them as a
        tensor for the decoder's other parts."""
        sel = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.rows = [self.rows[j] for j in keep]
        if self.grammar is not None:
            self.grammar.select(keep)
        self._groups = None
        self.tokens, self.lengths = self.tokens[sel], self.lengths[sel]
        self.prompt_lengths = self.prompt_lengths[sel]
        self.hidden = self.hidden[sel] if self.hidden is not None else None
        self.streams = self.streams.select(sel)
        return sel

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
