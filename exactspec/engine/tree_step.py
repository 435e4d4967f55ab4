"""The decode step for a token-tree drafter: propose a tree -> one tree-attention forward ->
standardize at every node -> verify_tree -> keep the accepted path.

Same contract as `decode_step` (it hands over to the same `finish_step`): the target's cache
keeps every token but the last, rows keep what their stop rule allows, the random stream of a
row advances once per step. The tree's shape comes from the drafter; a row's depth is capped by
its remaining token budget, never by `num_draft_tokens`.
"""

from __future__ import annotations

from functools import partial

import torch

from exactspec.drafters.tree_shape import tree_of
from exactspec.engine.batch import FAULT, BatchState, Row
from exactspec.engine.step import Clock, StepRules, finish_step
from exactspec.errors import InvalidValue
from exactspec.models.tree_attention import commit_path, extend_tree, path_index
from exactspec.sampling import DraftTree, VerifyMethod, parse_method, tree_history
from exactspec.sampling.standardize import probs_from_logits_rows


def tree_drafting(drafter) -> bool:
    """Whether the engine runs tree steps for `drafter` (a TreeDrafter with a tree now)."""
    return tree_of(drafter) is not None


def tree_rule(drafter, verify) -> partial | None:
    """The tree step for `drafter` with verify method `verify`, or None for chain drafters.

    "block" is chain-only (its tree form is "traversal"); callables and lossy rules take
    chains; all of these are refused here, with the fix.
    """
    if not tree_drafting(drafter):
        return None
    method = None if callable(verify) else parse_method(verify)
    if method is None or method.tree_law is None:
        name = verify if method is None else method.name
        hint = "" if method is None else method.tree_hint
        raise InvalidValue(f"verify={name!r} cannot verify token trees{hint}; with a tree "
                           "drafter use 'token', 'traversal' or 'greedy'")
    if (method.fixed_shape_only and not tree_of(drafter).fixed
            and drafter.siblings != "deterministic"):
        raise InvalidValue(f"verify={method.name!r} is proven for trees whose shape is fixed "
                           f"before the draws; a DynamicTree with siblings={drafter.siblings!r} "
                           "sizes its nodes by what was drawn: use verify='token', or "
                           "siblings='deterministic'")
    return partial(tree_step, method=method)


def tree_step(batch: BatchState, rules: StepRules, clock: Clock, room: torch.Tensor, *,
              method: VerifyMethod) -> list[tuple[Row, list[int]]] | None:  # room [B]: tokens a row may add
    """One step of every row with a token tree; see the module docstring. None when the
    drafter raised (under on_fault="plain"): nothing ran, the caller steps plain."""
    dev = batch.target.device
    tree = batch.guard(batch.drafter.propose_tree, batch.context(), room.to(dev))  # [B, N] nodes
    if tree is FAULT:
        return None
    tree = _on(tree, dev)
    draft_s = clock.lap()
    root = batch.tokens.gather(1, (batch.lengths - 1)[:, None])[:, 0]  # [B] last token
    out = extend_tree(batch.target, root, tree, hidden_layers=batch.layers)
    logits, feats = out if batch.layers is not None else (out, None)  # [B, N+1, V], [B, N+1, F]
    target_s = clock.lap()
    p = tree_target_probs(batch, logits, tree)  # [B, N+1, V]
    verdict = method.tree_law(p, tree, check=rules.check_q).draw(batch.streams)
    batch.streams.advance()
    n = verdict.num_accepted.to(dev)  # [B]
    verify_s = clock.lap()
    commit_path(batch.target, verdict.path)  # the root and the path stay in the cache
    width = int(n.max()) + 1 if len(batch) else 1
    idx = path_index(verdict.path.to(dev))[:, :width]  # [B, D+1] where the path was scored
    p_path = p.gather(1, idx[..., None].expand(-1, -1, p.shape[-1]))  # [B, D+1, V]
    f_path = None if feats is None else feats.gather(
        1, idx[..., None].expand(-1, -1, feats.shape[-1]))  # [B, D+1, F]
    nodes = tree.shape.valid.sum(1)  # [B] drafted nodes
    raw = rules.logprobs_mode == "raw" or any(r.logprobs_mode == "raw" for r in batch.rows)
    logits_path = None if not raw else logits.gather(
        1, idx[..., None].expand(-1, -1, logits.shape[-1]))  # [B, D+1, V] raw logprobs only
    return finish_step(batch, rules, clock, p_path, verdict.tokens[:, :width].to(dev), n, nodes,
                       f_path, (draft_s, target_s, verify_s), tree.num_nodes + 1, logits_path)


def tree_target_probs(batch: BatchState, logits: torch.Tensor,  # [B, N+1, V]
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
