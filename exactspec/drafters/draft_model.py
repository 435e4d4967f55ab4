"""DraftModel: a smaller causal LM sharing the target's vocabulary drafts autoregressively."""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from exactspec.drafters.base import (
    DraftContext,
    TargetInfo,
    empty_proposal,
    prefills_at_once,
    rows_of,
)
from exactspec.drafters.tree_draft import draft_model_tree
from exactspec.drafters.tree_shape import check_tree, tree_of
from exactspec.errors import InvalidValue
from exactspec.kernels import draft_step
from exactspec.models.adapter import TargetAdapter
from exactspec.models.loading import as_model
from exactspec.sampling import DraftTree, RowStreams, SamplingParams
from exactspec.sampling.standardize import law_groups

# how the vocabulary-mismatch errors name the drafter for a model with another tokenizer
CROSS_VOCAB = ("for a draft with another tokenizer use es.CrossVocabDraft(model), on the "
               "command line --cross-vocab-draft MODEL")


# a catch-up wider than this runs in two forwards, the first keeping one position's logits
# (a row admitted unfed catches up its whole context: [B, W, V] logits for W = 1,000 and
# B = 16 would be 3 GB)
LONG_CATCH_UP = 16


@dataclass(frozen=True)
class NativeStep:
    """What the native draft step (kernels/draft_step.py) takes at every position of a
    propose: the final norm, the head's kernel arguments, the one law and the uniforms."""

    norm: tuple[torch.Tensor, float]  # the final RMSNorm's weight [H] and eps
    head: tuple[list[torch.Tensor], torch.Tensor | None]  # the head Matrix's kernel_args
    params: SamplingParams  # every row's law
    u: torch.Tensor | None  # [K, B] float64: draft position j's uniforms (None: greedy)
    head_rows: torch.Tensor | None = None  # a reduced head's token ids (lean.head_rows)
    vocab_size: int = 0  # the vocabulary q spans

    def tail(self, j: int, last: torch.Tensor):  # last [B]: each row's position in the feed
        """The forward's tail at draft position j: the last layer's output [B * W, H] ->
        the drawn tokens [B] and their q [B, V]."""
        def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            b = last.shape[0]
            if x.shape[0] != b:  # several tokens fed per row: each row's last real one
                x = x.view(b, -1, x.shape[-1])[torch.arange(b, device=x.device), last]
            return draft_step.draft_step(x, self.norm, self.head, self.params,
                                         None if self.u is None else self.u[j],
                                         self.head_rows, self.vocab_size)
        return run


class DraftModel:
    """Drafts K tokens by sampling a small model's q, standardized exactly like the target's p.

    q at draft position j comes from `probs_from_logits` with the engine's SamplingParams and the
    same history the target will use for p there (context plus drafts 0..j-1), so q is exactly
    the distribution the token was drawn from. The draft keeps its own KV cache; rejected drafts
    are dropped at the next `propose` by keeping only the cached prefix that agrees with the
    context. `model`: an exactspec Model or a transformers causal LM. `tree=(3, 2, 1)` drafts a
    token tree instead (branching per depth, siblings drawn as `siblings`, default
    "without_replacement"; greedy batches take the top-k), one draft forward per depth;
    `tree=DynamicTree(node_budget=16)` grows a dynamic tree where the draft is confident
    (EAGLE-2's top-k children with siblings="deterministic"; exactspec/drafters/dynamic_tree.py).
    """

    standardized_q = True  # q from DraftContext.standardize, not re-checked (base.trusts_q)

    hidden_layers = None  # needs no target features

    # rows the latest propose drafted for: a begin or an admission leaving more than twice as
    # many rows in the batch (`prefills_at_once`) caches no prompt (plain decoding under load,
    # a one-row probe, load arriving after one stream); a row's context is fed when it first
    # drafts
    _drafted_rows = 1 << 30

    # the target's TargetAdapter when this drafter shares the target's KV cache (a self-draft
    # with the target's layers and cache layout, set by its `begin`): the target's cache holds
    # every row's context but its last token (the engine's invariant), so nothing is prefilled
    # or caught up, and the draft writes only past the target's committed length, slots the
    # target rewrites before it reads them. None: the drafter keeps its own cache.
    _shared = None

    def __init__(self, model, *, tree=None, siblings: str = "without_replacement") -> None:
        self.model = as_model(model)  # the draft LM and its tokenizer (if any)
        # branching per depth (None: chains) and how siblings are drawn (SIBLING_KINDS)
        self.tree, self.siblings = check_tree(tree, siblings)
        self._adapter: TargetAdapter | None = None
        self._fed: torch.Tensor | None = None  # [B, S] long: tokens in the draft cache slots

    def __repr__(self) -> str:
        tree = "" if self.tree is None else f", tree={self.tree}, siblings={self.siblings!r}"
        return f"DraftModel({self.model.name!r}{tree})"

    @property
    def lags_behind(self) -> bool:
        """Whether rows this drafter does not draft for fall behind in its cache (a catch-up
        when they next draft, which the draft-length policy charges); not when it shares the
        target's cache."""
        return self._shared is None

    def begin(self, context: DraftContext, target: TargetInfo) -> None:
        self._check_vocab(target)
        self._start(TargetAdapter(self.model.model, strict=False), context)

    def admit(self, context: DraftContext, target: TargetInfo, start: int) -> None:
        """Rows start.. are new: prefill them alone into the draft cache (running rows keep
        theirs); while the batch decodes plain (the latest propose drafted nothing) nothing
        is prefilled: a row's context is fed when it first drafts."""
        assert self._adapter is not None and self._fed is not None, "begin() first"
        eager = self._shared is None and prefills_at_once(self._drafted_rows,
                                                          int(context.tokens.shape[0]))
        prompts = [row[: int(n) - 1].tolist() if eager else [] for row, n in
                   zip(context.tokens[start:].cpu(), context.lengths[start:].cpu(), strict=True)]
        if self._shared is None:
            self._adapter.admit(prompts, capacity=int(context.tokens.shape[1]))
        else:  # the target's new cache (admission concatenates) is read at the next propose
            self._adapter.cache = None
        fed = torch.full((len(prompts), max(self._fed.shape[1], context.tokens.shape[1])), -1,
                         dtype=torch.long, device=self._fed.device)  # [R, S]
        for i, p in enumerate(prompts):
            fed[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        if fed.shape[1] > self._fed.shape[1]:
            self._fed = torch.cat([self._fed, self._fed.new_full(
                (self._fed.shape[0], fed.shape[1] - self._fed.shape[1]), -1)], 1)
        self._fed = torch.cat([self._fed, fed])

    def _start(self, adapter: TargetAdapter, context: DraftContext) -> None:
        """Prefill `adapter` (the draft's cache) with every row's context but its last token
        (nothing while the batch decodes plain: see `admit`)."""
        self._adapter = adapter
        eager = self._shared is None and prefills_at_once(self._drafted_rows,
                                                          int(context.tokens.shape[0]))
        prompts = [
            row[: int(n) - 1].tolist() if eager else []
            for row, n in zip(context.tokens.cpu(), context.lengths.cpu(), strict=True)
        ]
        if self._shared is None:
            adapter.prefill(prompts, capacity=int(context.tokens.shape[1]))
        width = context.tokens.shape[1]
        self._fed = torch.full((len(prompts), width), -1, dtype=torch.long,
                               device=adapter.device)
        for i, p in enumerate(prompts):
            self._fed[i, : len(p)] = torch.tensor(p, dtype=torch.long)

    def _check_vocab(self, target: TargetInfo) -> None:
        mine = self.model.vocab_size
        if mine != target.vocab_size:
            raise InvalidValue(
                f"vocabulary mismatch: the draft model {self.model.name!r} has {mine} logits, the "
                f"target {target.vocab_size}; a draft model must share the target's vocabulary "
                f"({CROSS_VOCAB})"
            )
        tok_d, tok_t = self.model.tokenizer, target.tokenizer
        if tok_d is None or tok_t is None or tok_d is tok_t:
            return
        vd, vt = tok_d.get_vocab(), tok_t.get_vocab()
        if vd != vt:
            diff = sorted(set(vd.items()) ^ set(vt.items()), key=lambda kv: kv[1])[:3]
            raise InvalidValue(
                f"vocabulary mismatch: the draft tokenizer ({len(vd)} tokens) and the target "
                f"tokenizer ({len(vt)} tokens) differ, e.g. {diff} ({CROSS_VOCAB})"
            )

    def select(self, rows: torch.Tensor) -> None:
        assert self._adapter is not None and self._fed is not None
        if self._shared is None:
            self._adapter.select(rows)
        else:  # the target selected its cache; the draft reads it at the next propose
            self._adapter.cache = None
        self._fed = self._fed.index_select(0, rows.to(self._fed.device))

    @torch.inference_mode()
    def propose(
        self, context: DraftContext, num_tokens: torch.Tensor  # [B]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, K] -1 padded, [B, K, V]
        ad = self._adapter
        assert ad is not None and self._fed is not None, "begin() first"
        dev = ad.device
        b = context.tokens.shape[0]
        k = int(num_tokens.max()) if b else 0
        self._drafted_rows = int((num_tokens > 0).sum())
        if k == 0:
            return empty_proposal(num_tokens, self.model.vocab_size, dev)  # [B, 0], [B, 0, V]
        if self._shared is not None and 2 * self._drafted_rows <= b:
            return self._propose_rows(context, num_tokens)
        drafts = torch.full((b, k), -1, dtype=torch.long, device=dev)  # [B, K]
        # q at each draft position, [B, V] each: every row is drawn at every position, so q is
        # stacked from them (float32, as empty_proposal's), not zero-filled and then copied into
        qs = []
        greedy = context.greedy  # one-hot q: the draw is its hot index, no CDF
        on = num_tokens.to(dev) > 0  # [B] rows that draft; the others are not fed (they
        # catch up when they next draft: a probe of one row does not feed the whole batch)
        feed, last = self._catch_up(context, on)
        few = 2 * int(on.sum()) <= b  # a probe's row(s) in a batch decoding plain
        if feed.shape[1] > LONG_CATCH_UP or (few and feed.shape[1] > 1):
            # rows fed their whole context (admitted unfed), or few rows catching up: all but
            # each row's last token first, keeping one position's logits, not [B, W, V], and
            # over the drafting rows only when they are few (not every row of the batch fed
            # its context padded for one probing row: docs/performance.md)
            self._record(torch.where(on[:, None], feed[:, :-1], -1), ad.lengths)
            if few:
                rows = on.nonzero().flatten()
                ad.feed_rows(rows, feed[rows, :-1], last[rows])
            else:
                ad.extend(feed[:, :-1], logits_to_keep=1)
                ad.commit(last * on)
            feed, last = feed.gather(1, last[:, None]), torch.zeros_like(last)  # [B, 1]
        native = self._native_step(context, k)
        for j in range(k):
            if self._shared is None:
                self._record(torch.where(on[:, None], feed, -1), ad.lengths)
            if native is not None:  # norm, head, q and the draw in one call: the same bits
                x, q_j = ad.extend(feed, tail=native.tail(j, last))  # [B], [B, V]
                ad.commit((last + 1) * on)
            else:
                logits = ad.extend(feed)  # [B, W, V]
                logits = logits[torch.arange(b, device=dev), last]  # [B, V]
                ad.commit((last + 1) * on)
                q_j = context.standardize(logits, drafts[:, :j])  # [B, V], each row's params
                x = context.draw(q_j, j, greedy=greedy)  # [B]
            drafts[:, j] = x
            qs.append(q_j)
            feed = x[:, None]
            if j == 0:
                last = torch.zeros_like(last)  # one token per row from here on
        want = torch.arange(k, device=dev)[None, :] < num_tokens.to(dev)[:, None]
        return torch.where(want, drafts, -1), torch.stack(qs, 1).float()  # [B, K], [B, K, V]

    def _native_step(self, context: DraftContext, k: int) -> NativeStep | None:
        """The native draft step for this propose (kernels/draft_step.py), or None for the
        Python path: it needs a lean forward on our kernels whose head gives the whole
        vocabulary (a reduced head's logits placed in it), one law over the rows that the
        native step standardizes (no penalties, logit bias or grammar), and counter-based
        streams; EXACTSPEC_DRAFT_STEP=0 turns it off."""
        lean = getattr(self._adapter, "lean", None)
        if (os.environ.get("EXACTSPEC_DRAFT_STEP", "1") == "0" or lean is None
                or not lean.kernels or context.grammar is not None
                or not isinstance(context.streams, RowStreams) or not draft_step.available()):
            return None
        groups = law_groups(context.rows_params())
        params = groups[0][0]
        head = lean.head.kernel_args()
        if (len(groups) > 1 or groups[0][1] is not None or not draft_step.supports(params)
                or head is None or lean.vocab_size != self.model.vocab_size):
            return None
        u = None if params.is_greedy else context.draft_uniforms(k).t().contiguous()  # [K, B]
        return NativeStep(lean.norm, head, params, u, lean.head_rows, lean.vocab_size)

    def _propose_rows(self, context: DraftContext, num_tokens: torch.Tensor):  # [B]
        """On the target's cache, few rows drafting (a probe under load): draft over those rows
        alone, on a copy of their cache rows (the draft's writes are scratch), not the whole
        batch fed a token each; the others get no draft."""
        shared, dev = self._shared, self._adapter.device
        rows = (num_tokens.to(dev) > 0).nonzero().flatten()  # [R]
        # the rows' cache and lengths, as the target holds them (all `_catch_up` reads)
        self._shared = SimpleNamespace(cache=shared.cache.rows_copy(rows),
                                       lengths=shared.lengths.index_select(0, rows))
        try:
            drafts, q = self.propose(rows_of(context, rows), num_tokens.index_select(0, rows))
        finally:
            self._shared = shared
            self._adapter.cache = None
        self._drafted_rows = int(rows.numel())
        all_drafts, all_q = empty_proposal(num_tokens, self.model.vocab_size, dev)
        all_drafts[rows], all_q[rows] = drafts, q
        return all_drafts, all_q  # [B, K], [B, K, V]

    def _catch_up(self, context: DraftContext, on: torch.Tensor | None = None,  # [B] bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Roll the draft cache back to the cached prefix that agrees with the context (never
        the last token) and return what it lacks: feed [B, W] (ragged, right-padded) and the
        index of each row's last real token in it [B]. Rows off `on` are left as they are
        and fed one padding token (not to be committed). A drafter sharing the target's cache
        takes it as it is and feeds every row its last token."""
        ad, fed = self._adapter, self._fed
        dev = ad.device
        tokens = context.tokens.to(dev)  # [B, T]
        lengths = context.lengths.to(dev)  # [B]
        if self._shared is not None:
            held = self._shared.lengths.to(dev)  # [B] the target's committed lengths
            if held.shape != lengths.shape or not bool((held == lengths - 1).all()):
                raise RuntimeError(f"the target's cache holds {held.tolist()} tokens per row, "
                                   f"not the context but its last token ({lengths.tolist()})")
            ad.cache, ad.lengths = self._shared.cache, held.clone()
            return tokens.gather(1, (lengths - 1)[:, None]), torch.zeros_like(lengths)
        s = min(fed.shape[1], tokens.shape[1])
        agree = (fed[:, :s] == tokens[:, :s]).long().cumprod(1).sum(1)  # [B]
        keep = torch.minimum(torch.minimum(agree, ad.lengths), lengths - 1)
        if on is not None:
            keep = torch.where(on, keep, ad.lengths)
        ad.rewind(keep)
        pending = lengths - keep  # [B] >= 1
        if on is not None:
            pending = torch.where(on, pending, 1)
        width = int(pending.max())
        idx = keep[:, None] + torch.arange(width, device=dev)  # [B, W]
        feed = tokens.gather(1, idx.clamp(max=tokens.shape[1] - 1))
        feed = torch.where(idx < lengths[:, None], feed, ad.pad_token_id)
        return feed, pending - 1

    @torch.inference_mode()
    def propose_tree(self, context: DraftContext, max_depth: torch.Tensor) -> DraftTree:
        """The tree of `self.tree` (exactspec/drafters/tree_draft.py); max_depth [B]. The
        draft cache keeps only the committed prefix afterwards."""
        self._drafted_rows = int(context.tokens.shape[0])
        ad = self._adapter
        feed, last = self._catch_up(context)  # [B, W], [B]
        self._record(feed, ad.lengths)
        rows = torch.arange(feed.shape[0], device=ad.device)
        root_logits = ad.extend(feed)[rows, last]  # [B, V]
        ad.commit(last + 1)  # the root (the context's last token) is now cached
        start = ad.lengths.clone()  # [B] node i lives at slot start + i, position start - 1 + depth
        tree = draft_model_tree(ad, context, tree_of(self), self.siblings, max_depth,
                                root_logits, start)
        # tree slots hold no chain: the next propose must not keep them as an agreeing prefix
        pos = torch.arange(self._fed.shape[1], device=ad.device)[None, :]
        self._fed = torch.where(pos < start[:, None], self._fed, -1)
        return tree

    def _record(self, feed: torch.Tensor, at: torch.Tensor) -> None:
        """Remember which tokens the next extend writes into which draft cache slots (a
        drafter on the target's cache keeps no record)."""
        assert self._fed is not None
        if self._shared is not None:
            return
        need = int(at.max()) + feed.shape[1]
        if need > self._fed.shape[1]:
            grow = torch.full((self._fed.shape[0], need - self._fed.shape[1] + 64), -1,
                              dtype=torch.long, device=self._fed.device)
            self._fed = torch.cat([self._fed, grow], 1)
        idx = at[:, None] + torch.arange(feed.shape[1], device=feed.device)  # [B, W]
        self._fed.scatter_(1, idx, feed)
