"""The drafter Protocol: what the engine needs from anything that proposes draft tokens.

A drafter is stateful over one batch of rows. The engine calls, in order:

    drafter.begin(context, target)            # a new batch; prompts are in `context`
    loop:
        tokens, q = drafter.propose(context, num_tokens)
        ... the target verifies; `context` gains the emitted tokens ...
        drafter.select(rows)                  # when some rows finished: keep these rows
        drafter.admit(context, target, start) # when rows were admitted between steps: rows
                                              # start.. of `context` are new (appended at the
                                              # end); rows before keep their draft state

`admit` is the admission hook: the new rows are prefilled alone, the running rows' caches and
statistics stay as they are (every exactspec drafter has it). A drafter without `admit` (a
user's, written before the hook) is restarted with `begin` over the whole batch instead; that
is exact too, only slower (every running row is prefilled again).

`propose` returns draft_tokens [B, K] (K = max(num_tokens), rows padded with -1 at the end,
fewer tokens than asked allowed, including none) and draft_probs [B, K, V], the exact
distribution q each token was drawn from, or None for a point-mass draft. Rollback needs no
hook: at the next `propose` the context shows what was kept, and a drafter with its own cache
keeps only the prefix that agrees with it. A sampled drafter draws its token at draft position
j with `context.draw(q_j, j)`: by inverse CDF of q_j in token-id order with the row's uniform
for that position, `DOMAIN_DRAFT + j` of `context.streams` (never the verifier's uniforms), or,
under coupled verification (`context.coupled`), the uniform of the output position the target
draws its own token there with, so a draft equal to the target's draw is kept. A drafter that
draws otherwise stays exact under every method; under coupled verification it is only accepted
less often.

Optional parts, each read through one function here: `admit` (above; `admit_rows`),
`standardized_q` (`trusts_q`), and `lags_behind` (`lags_behind`): whether rows the drafter does
not draft for fall behind in its own state, to be caught up when they next draft (the
draft-length policy charges that catch-up); a drafter without it is taken to lag. A drafter that
keeps a cache fills new rows' prompts into it at once only under `prefills_at_once` (the policy
assumes the same rule for the lag it counts).

Every drafter declares `hidden_layers`: None when it needs no target features, else a tuple of
indices into transformers' `hidden_states` (EAGLE-style heads); the engine then fills
`DraftContext.hidden` from the target's own prefill and verification forwards, at no extra cost.

Trees. A drafter that can propose token trees is a `TreeDrafter`: it declares `tree` (a
`TreeSpec`: a fixed `Branching` per depth or a `DynamicTree`, exactspec.drafters.tree_shape;
None while it drafts chains), `siblings` (how a node's children are drawn, SIBLING_KINDS) and
`propose_tree`. The engine reads nothing else from it.

Trust. The engine validates a drafter's q at every step unless the drafter's own class
declares `standardized_q = True` (q made by `DraftContext.standardize` / probs_from_logits, or
point masses); a subclass must declare it again, since it may change how q is made.

Rows may carry different SamplingParams (`DraftContext.row_params`); `context.params` is the
shared one only when every row has the same law. Standardize q with `context.standardize`, which
applies each row's own parameters and history exactly as the engine does for p, and a row's
grammar (`DraftContext.grammar`): q then gives no mass to a token the grammar forbids, so such a
token is never drawn. A point-mass draft the grammar forbids is cut by the engine (exact: it
would be rejected with certainty and its residual is p).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch

from exactspec.sampling import (
    DOMAIN_DRAFT,
    DraftTree,
    RowStreams,
    SamplingParams,
    position_uniforms,
    sample,
    sample_from_weights,
)
from exactspec.sampling.history import history as token_history
from exactspec.sampling.history import prefix_history
from exactspec.sampling.standardize import probs_from_logits_rows

__all__ = ["AdmitsRows", "DraftContext", "Drafter", "ReportsLag", "TargetInfo", "TokenMasks",
           "TreeDrafter", "TreeSpec", "admit_rows", "empty_proposal", "history", "lags_behind",
           "prefills_at_once", "prefix_history", "rows_of", "trusts_q"]


@dataclass
class DraftContext:
    """The rows being generated, as the engine sees them before a step."""

    tokens: torch.Tensor  # [B, T] long: prompt then emitted tokens, padded with -1 at the end
    lengths: torch.Tensor  # [B] long: real tokens per row
    prompt_lengths: torch.Tensor  # [B] long: leading tokens that are prompt (for penalties)
    # the parameters the target's p is standardized with, when every row shares one law
    # (rows may still differ by seed); None when rows differ: use row_params / standardize
    params: SamplingParams | None
    streams: RowStreams  # one random stream per row, advanced once per engine step
    # [B, T, F] target features aligned with `tokens`, only for drafters with `hidden_layers`:
    # hidden[b, i] = the target's hidden states at token i for transformers' `hidden_states`
    # indices in drafter.hidden_layers, concatenated; valid for i < lengths[b] - 1 (the last
    # token has not been through the target yet). None for other drafters.
    hidden: torch.Tensor | None = None
    row_params: tuple[SamplingParams, ...] | None = None  # [B] each row's; None: all `params`
    # coupled verification: draft position j draws with the uniform of the row's output
    # position lengths - prompt_lengths + j (`draw`), the one the target draws there with;
    # a [B] bool tensor: only the rows marked (the others draw from their step streams)
    coupled: bool | torch.Tensor = False
    # the rows' grammars (exactspec.engine.grammar.GrammarRows), or None: `standardize` then
    # restricts q to the tokens each row's grammar allows after the drafts so far, as p is
    grammar: TokenMasks | None = None

    def rows_params(self) -> tuple[SamplingParams, ...]:
        """One SamplingParams per row."""
        if self.row_params is not None:
            return self.row_params
        assert self.params is not None
        return (self.params,) * int(self.tokens.shape[0])

    @property
    def uses_history(self) -> bool:
        """Whether some row's penalties read the token history."""
        if self.row_params is None:
            return self.params is not None and self.params.uses_history
        return any(p.uses_history for p in self.row_params)

    @property
    def greedy(self) -> bool:
        """Whether every row decodes greedily (temperature 0): each standardized q is a one-hot,
        and `sample(q, streams, greedy=True)` draws it without a CDF."""
        if self.row_params is None:
            return self.params is not None and self.params.is_greedy
        return all(p.is_greedy for p in self.row_params)

    def output_positions(self, start: int, n: int) -> torch.Tensor:  # [B, n] long
        """Output positions start..start+n-1 after each row's context (0 = the first
        generated token): where draft position j, or p at verification slot j, draws."""
        done = (self.lengths - self.prompt_lengths)[:, None]  # [B, 1] tokens generated so far
        return done + torch.arange(start, start + n, device=self.lengths.device)[None, :]

    def draw(self, q: torch.Tensor,  # [B, V] the standardized q of draft position j
             j: int, *, greedy: bool = False) -> torch.Tensor:  # [B] long
        """Draft position j's token from q by inverse CDF in token-id order (module docstring):
        the uniform is DOMAIN_DRAFT + j of the step's streams, or, when `coupled`, the one of
        the output position (RowStreams.at_positions), which the target's draw there uses.
        greedy: every q is a one-hot (`greedy`), its hot index is drawn without a CDF."""
        mask = self.coupled
        if mask is False:
            return sample(q, self.streams, domain=DOMAIN_DRAFT + j, greedy=greedy)
        if greedy:
            return q.argmax(-1)
        u = position_uniforms(self.streams, self.output_positions(j, 1))[:, 0]  # [B]
        drawn = sample_from_weights(q, u.to(q.device))  # [B]
        if mask is True:
            return drawn
        own = sample(q, self.streams, domain=DOMAIN_DRAFT + j)  # [B] the other rows' draws
        return torch.where(mask.to(drawn.device), drawn, own)

    def draft_uniforms(self, k: int) -> torch.Tensor:  # [B, K] float64
        """The uniform `draw` takes at draft positions 0..k-1 when it draws by inverse CDF
        (column j: DOMAIN_DRAFT + j of the step's streams, or the output position's under
        `coupled`), all at once: a draw that takes them from here (the native draft step)
        uses the streams exactly as `draw` does. RowStreams only (counter-based, so computing
        them early moves nothing)."""
        if not isinstance(self.streams, RowStreams):
            raise TypeError("draft_uniforms needs RowStreams (counter-based streams)")
        mask = self.coupled
        own = None
        if mask is not True:
            own = torch.cat([self.streams.uniform(1, DOMAIN_DRAFT + j) for j in range(k)], 1)
        if mask is False:
            return own
        at = position_uniforms(self.streams, self.output_positions(0, k))  # [B, K]
        if mask is True:
            return at
        return torch.where(mask.to(at.device)[:, None], at, own.to(at.device))

    def standardize(self, logits: torch.Tensor,  # [B, V]
                    drafted: torch.Tensor | None = None,  # [B, J] drafts before this position
                    ) -> torch.Tensor:  # [B, V]
        """q at the position after `drafted`: each row's own params, the target's history."""
        dev = logits.device
        prev = history(self, drafted).to(dev) if self.uses_history else None
        allowed = None if self.grammar is None else self.grammar.allowed(drafted).to(dev)
        return probs_from_logits_rows(logits, self.rows_params(), prev,
                                      self.prompt_lengths.to(dev), allowed=allowed)


@runtime_checkable
class TokenMasks(Protocol):
    """The tokens each row may take next: a grammar's mask (exactspec.engine.grammar)."""

    def allowed(self, drafted: torch.Tensor | None  # [B, J] long drafts so far, -1 padded
                ) -> torch.Tensor:  # [B, V] bool
        """Each row's allowed tokens after its drafts (all True for a row without one)."""

    def subset(self, rows: torch.Tensor) -> TokenMasks:
        """The same masks for the rows at these indices ([R] long)."""


@dataclass(frozen=True)
class TargetInfo:
    """What a drafter may check against the target before drafting for it."""

    vocab_size: int  # width of the target's logits
    tokenizer: object | None  # the target's tokenizer, when known
    model: object | None = None  # the target's transformers model (heads share its embeddings)
    # the target's TargetAdapter (exactspec.models.adapter): a self-draft of the same layers
    # reads the target's KV cache of the context from it instead of prefilling its own
    adapter: object | None = None


@runtime_checkable
class Drafter(Protocol):
    """Anything with these three methods and `hidden_layers` can draft for the engine (see the
    module docstring)."""

    # None: the drafter needs no target features; else indices into transformers'
    # hidden_states whose concatenation the engine passes in DraftContext.hidden
    hidden_layers: tuple[int, ...] | None

    def begin(self, context: DraftContext, target: TargetInfo) -> None:
        """Start a new batch of rows; raise ValueError if this drafter cannot serve `target`."""

    def propose(
        self, context: DraftContext, num_tokens: torch.Tensor  # [B] long, >= 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [B, K] long -1 padded, [B, K, V] | None
        """Up to num_tokens[b] draft tokens per row, and the q they were drawn from."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` ([R] long indices into the current batch), in that order."""


@runtime_checkable
class TreeSpec(Protocol):
    """The shape of a drafter's token tree (exactspec.drafters.tree_shape: Branching,
    DynamicTree)."""

    # True: the layout of the nodes is fixed before anything is drawn (a branching per depth);
    # False: the nodes kept depend on the draft (a dynamic tree), which traversal verification
    # accepts only when nothing is drawn (siblings "deterministic")
    fixed: ClassVar[bool]

    @property
    def node_budget(self) -> int:
        """The most nodes one tree holds (the target scores node_budget + 1 positions)."""

    @property
    def depth(self) -> int:
        """The deepest node's depth (draft forwards per step)."""

    def text(self) -> str:
        """The CLI's spelling: '3,2,1', 'dynamic:16'."""

    def as_json(self) -> list[int] | dict:
        """The shape for a result file: the branching list, or a dynamic tree's fields."""


@runtime_checkable
class TreeDrafter(Protocol):
    """A drafter that can propose token trees (see the module docstring)."""

    tree: TreeSpec | tuple[int, ...] | None  # None: drafting chains now; a tuple is a Branching
    siblings: str  # how children are drawn: "iid" | "without_replacement" | "deterministic"

    def propose_tree(self, context: DraftContext,
                     max_depth: torch.Tensor) -> DraftTree:  # max_depth [B] long
        """A tree per row, no node deeper than max_depth[b]; q of every node (or point masses)."""


def trusts_q(drafter) -> bool:
    """Whether the engine may skip validating `drafter`'s q: its own class (not a parent)
    declares `standardized_q = True`."""
    return vars(type(drafter)).get("standardized_q", False) is True


@runtime_checkable
class AdmitsRows(Protocol):
    """The admission hook beside `Drafter` (optional for a user's drafter; see the module
    docstring)."""

    def admit(self, context: DraftContext, target: TargetInfo, start: int) -> None:
        """Rows start.. of `context` joined the batch (appended after the running ones):
        prefill them alone; rows 0..start-1 keep their draft state."""


def admit_rows(drafter, context: DraftContext, target: TargetInfo, start: int) -> None:
    """Tell `drafter` that rows start.. of `context` are new: its `admit`, or a `begin` over
    the whole batch for a drafter without the hook."""
    if start == 0 or not isinstance(drafter, AdmitsRows):
        drafter.begin(context, target)
    else:
        drafter.admit(context, target, start)


@runtime_checkable
class ReportsLag(Protocol):
    """Optional beside `Drafter`: whether rows it does not draft for fall behind (see the module
    docstring). A drafter that reads the target's own cache says False."""

    @property
    def lags_behind(self) -> bool:
        """True: a row that decoded without drafts is caught up when it next drafts."""


def lags_behind(drafter) -> bool:
    """Whether `drafter` falls behind on the rows it does not draft for: its `lags_behind`, or
    True for a drafter that does not say."""
    return drafter.lags_behind if isinstance(drafter, ReportsLag) else True


def prefills_at_once(drafted_rows: int | None, rows: int) -> bool:
    """Whether a drafter fills new rows' prompts into its cache at admission: only if its
    latest step drafted for at least half the `rows` the batch then has (else the prompts are
    fed when the rows first draft). The draft-length policy assumes the same rule."""
    return drafted_rows is not None and 2 * drafted_rows >= rows


def rows_of(context: DraftContext, start: int | torch.Tensor) -> DraftContext:
    """The rows start.. of `context` alone (what an admission hook prefills), or the rows at
    the indices `start` ([R] long), each keeping its own random stream."""
    sel = torch.arange(start, int(context.tokens.shape[0])) if isinstance(start, int) else start
    streams = context.streams.select(sel)
    sel = sel.to(context.tokens.device)
    params = None if context.row_params is None else tuple(context.row_params[i]
                                                           for i in sel.tolist())
    return DraftContext(context.tokens[sel], context.lengths[sel], context.prompt_lengths[sel],
                        context.params, streams,
                        None if context.hidden is None else context.hidden[sel], params,
                        context.coupled if isinstance(context.coupled, bool)
                        else context.coupled[sel],
                        None if context.grammar is None else context.grammar.subset(sel))


def history(context: DraftContext, extra: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's tokens followed by `extra` ([B, J] long, -1 padded): [B, T'] -1 padded.

    The penalties' token history when drawing after `extra` (exactspec.sampling.history).
    """
    return token_history(context.tokens, context.lengths, extra)


def empty_proposal(
    num_tokens: torch.Tensor, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, K] all -1, [B, K, V] zeros
    """The (drafts, q) pair a drafter fills in for `num_tokens` ([B], K = its max): no token
    drafted yet, q = 0 everywhere."""
    b = num_tokens.shape[0]
    k = int(num_tokens.max()) if b else 0
    drafts = torch.full((b, k), -1, dtype=torch.long, device=device)
    return drafts, torch.zeros(b, k, vocab, dtype=torch.float32, device=device)
