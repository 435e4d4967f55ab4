"""The decode step for a token-tree drafter: propose a tree -> one tree-attention forward ->
standardize at every node -> verify_tree -> keep the accepted path.

Same contract as `decode_step` (it hands over to the same `commit`): the target's cache
keeps every token but the last, rows keep what their stop rule allows, the random stream of a
row advances once per step. The tree's shape comes from the drafter; a row's depth is capped by
its remaining token budget, never by `num_draft_tokens`.
"""

from __future__ import annotations

import torch

from exactspec.engine.arguments import parse_verify
from exactspec.engine.commit import Clock, Report, Verified, commit
from exactspec.engine.drafting import DraftSide
from exactspec.engine.policy import DraftLengthPolicy
from exactspec.engine.rows import Row, RowBatch
from exactspec.engine.verifier import Verifier, tree_method
from exactspec.models.adapter import TargetAdapter
from exactspec.models.tree_attention import commit_path, extend_tree, path_index
from exactspec.sampling import DraftTree, VerifyMethod, tree_history
from exactspec.sampling.standardize import probs_from_logits_rows


def tree_rule(drafter, verify) -> VerifyMethod | None:
    """The method that verifies `drafter`'s trees (None for a chain drafter), `verify` parsed
    as `generate` parses it: a method a tree drafter cannot use is refused here, with the fix,
    so that a server refuses it before serving."""
    return tree_method(drafter, parse_verify(verify))


def tree_step(batch: RowBatch, target: TargetAdapter, draft: DraftSide, verifier: Verifier,
              policy: DraftLengthPolicy, clock: Clock, report: Report,
              room: torch.Tensor) -> list[tuple[Row, list[int]]] | None:  # room [B] >= 0
    """One step of every row with a token tree; see the module docstring. None when the
    drafter raised (under on_fault="plain"): nothing ran, the caller steps plain."""
    dev = target.device
    tree = draft.propose_tree(batch, room.to(dev))  # [B, N] nodes
    if tree is None:
        return None
    tree = _on(tree, dev)
    draft_s = clock.lap()
    root = batch.last_tokens()[:, 0]  # [B] last token
    out = extend_tree(target, root, tree, hidden_layers=draft.layers)
    logits, feats = out if draft.layers is not None else (out, None)  # [B, N+1, V], [B, N+1, F]
    target_s = clock.lap()
    p = tree_target_probs(batch, logits, tree)  # [B, N+1, V]
    verdict = verifier.tree_verdict(p, tree, batch.streams, check=draft.checks_q)
    batch.streams.advance()
    n = verdict.num_accepted.to(dev)  # [B]
    verify_s = clock.lap()
    commit_path(target, verdict.path)  # the root and the path stay in the cache
    width = int(n.max()) + 1 if len(batch) else 1
    idx = path_index(verdict.path.to(dev))[:, :width]  # [B, D+1] where the path was scored
    p_path = p.gather(1, idx[..., None].expand(-1, -1, p.shape[-1]))  # [B, D+1, V]
    f_path = None if feats is None else feats.gather(
        1, idx[..., None].expand(-1, -1, feats.shape[-1]))  # [B, D+1, F]
    nodes = tree.shape.valid.sum(1)  # [B] drafted nodes
    raw = report.logprobs_mode == "raw" or any(r.logprobs_mode == "raw" for r in batch.rows)
    logits_path = None if not raw else logits.gather(
        1, idx[..., None].expand(-1, -1, logits.shape[-1]))  # [B, D+1, V] raw logprobs only
    return commit(batch, policy, clock, report, Verified(
        p=p_path, emitted=verdict.tokens[:, :width].to(dev), accepted=n, drafted=nodes,
        feats=f_path, logits=logits_path, seconds=(draft_s, target_s, verify_s),
        width=tree.num_nodes + 1))


def tree_target_probs(batch: RowBatch, logits: torch.Tensor,  # [B, N+1, V]
                      tree: DraftTree) -> torch.Tensor:  # [B, N+1, V]
    """p at the root and after each node: each row's own params, with the history of that
    node's path (its own branch, not the nodes drawn before it in the layout)."""
    prev = None
    if any(law.uses_history for law, _ in batch.groups):
        prev = tree_history(batch.tokens, batch.lengths, tree)  # [B, N+1, T']
    plen = batch.prompt_lengths[:, None].expand(-1, tree.num_nodes + 1)  # [B, N+1]
    return probs_from_logits_rows(logits, batch.params, prev, plen, groups=batch.groups)


def _on(tree: DraftTree, dev: torch.device) -> DraftTree:
    """The tree with its tensors on the target's device."""
    if tree.tokens.device == dev:
        return tree
    q = None if tree.draft_probs is None else tree.draft_probs.to(dev)
    return DraftTree(tree.tokens.to(dev), tree.parents.to(dev), q, tree.siblings)
