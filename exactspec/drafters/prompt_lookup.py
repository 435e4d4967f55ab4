"""Prompt lookup: copy the continuation of the latest earlier occurrence of the last n-gram."""

from __future__ import annotations

import torch

from exactspec.drafters.base import DraftContext, TargetInfo
from exactspec.drafters.tree_draft import lookup_tree
from exactspec.drafters.tree_shape import Branching
from exactspec.errors import InvalidValue
from exactspec.sampling import DraftTree


class PromptLookup:
    """Point-mass drafts from the context itself (prompt and output), no model needed.

    For each row, the last n tokens (n from `max_ngram` down to `min_ngram`, longest first)
    are searched for earlier in the row; the tokens that followed the latest earlier match are
    proposed, up to the requested number. q is a point mass, so `propose` returns None for
    draft_probs and the verifier accepts x with probability p(x). `branches=M` (M > 1) proposes
    a token tree instead: the continuations of the M latest distinct matches as branches (a
    shared prefix is one node), each up to `depth` tokens.
    """

    standardized_q = True  # point masses, not re-checked (base.trusts_q)
    siblings = "deterministic"  # tree nodes are point masses (copied continuations)

    hidden_layers = None  # needs no target features

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3, *, branches: int = 1,
                 depth: int = 4) -> None:
        for name, v in (("min_ngram", min_ngram), ("max_ngram", max_ngram)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidValue(f"{name}={v!r} must be an int >= 1")
        if min_ngram > max_ngram:
            raise InvalidValue(f"min_ngram={min_ngram} must be <= max_ngram={max_ngram}")
        self.min_ngram = min_ngram  # shortest suffix searched for
        self.max_ngram = max_ngram  # longest suffix searched for (tried first)
        for name, v in (("branches", branches), ("depth", depth)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidValue(f"{name}={v!r} must be an int >= 1")
        self.branches = branches  # matches proposed as branches of a tree (1: a chain)
        self.depth = depth  # tokens per branch in tree mode
        # the tree's widest shape, or None: chains (the engine runs tree steps when set)
        self.tree = Branching((branches,) + (1,) * (depth - 1)) if branches > 1 else None

    def __repr__(self) -> str:
        return f"PromptLookup(min_ngram={self.min_ngram}, max_ngram={self.max_ngram})"

    def begin(self, context: DraftContext, target: TargetInfo) -> None:
        pass

    def admit(self, context: DraftContext, target: TargetInfo, start: int) -> None:
        pass  # no state: it reads the context at every propose

    def propose_tree(self, context: DraftContext, max_depth: torch.Tensor) -> DraftTree:
        """Several earlier matches as branches (exactspec/drafters/tree_draft.py)."""
        return lookup_tree(context, self.min_ngram, self.max_ngram, self.branches, self.depth,
                           max_depth)

    def select(self, rows: torch.Tensor) -> None:
        pass

    def propose(
        self, context: DraftContext, num_tokens: torch.Tensor  # [B]
    ) -> tuple[torch.Tensor, None]:  # [B, K] -1 padded, None (point mass)
        tokens, lengths = context.tokens, context.lengths  # [B, T], [B]
        b, t = tokens.shape
        dev = tokens.device
        k = int(num_tokens.max()) if b else 0
        start = torch.full((b,), -1, dtype=torch.long, device=dev)  # continuation start per row
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if t < n + 1:
                continue
            suffix_at = (lengths - n).clamp(min=0)  # [B]
            suffix = tokens.gather(1, suffix_at[:, None] + torch.arange(n, device=dev))  # [B, n]
            windows = tokens.unfold(1, n, 1)  # [B, t-n+1, n]
            match = (windows == suffix[:, None, :]).all(-1)  # [B, t-n+1]
            pos = torch.arange(windows.shape[1], device=dev)
            # an earlier occurrence: followed by at least one token, not the suffix itself
            match &= pos[None, :] + n < lengths[:, None]
            match &= (lengths >= n + 1)[:, None]
            latest = torch.where(match, pos[None, :], -1).max(1).values  # [B]
            found = (start < 0) & (latest >= 0)
            start = torch.where(found, latest + n, start)
        offs = torch.arange(k, device=dev)  # [K]
        idx = start[:, None] + offs  # [B, K]
        ok = (start[:, None] >= 0) & (idx < lengths[:, None]) & (offs[None, :] < num_tokens[:, None])
        drafts = tokens.gather(1, idx.clamp(0, max(t - 1, 0))) if t else idx
        drafts = torch.where(ok, drafts, -1)
        # a copied run stops at its first gap, so -1 stays padding at the end of the row
        ok = ok.long().cumprod(1).bool()
        return torch.where(ok, drafts, -1), None
