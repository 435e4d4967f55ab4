"""Tree attention: the target scores a whole token tree in one forward, then keeps one path.

Layout per row, with L = the row's committed length: the last committed token (the tree's root,
not yet in the cache) at slot L and position L; node i at slot L + 1 + i and position
L + depth(i). Each query sees the committed prefix, the root, and its own ancestors (and
itself) among the nodes, so the logits at node i are those of the sequence prefix + path(i).
After verification `commit_path` moves the accepted path's K/V entries to the slots right after
the root, so the cache keeps a contiguous committed prefix (slot == position again) and the
next forward is a plain one. Works through the lean forward and through transformers' forward
(a 4D additive mask; sliding-window layers measure the window in positions, not slots).
"""

from __future__ import annotations

import torch

from exactspec.models.adapter import TargetAdapter, governed
from exactspec.sampling.tree import DraftTree, TreeShape


def tree_layout(start: torch.Tensor, shape: TreeShape, view_len: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions [B, N+1], slots [B, N+1] and visibility [B, N+1, S] of the root and the nodes.

    start [B]: committed length per row; view_len = S slots seen by the forward.
    """
    bsz, n = shape.valid.shape
    dev = start.device
    slots = start[:, None] + torch.arange(n + 1, device=dev)  # [B, N+1]
    depth = torch.cat([torch.zeros(bsz, 1, dtype=torch.long, device=dev), shape.depth], 1)
    positions = start[:, None] + depth  # [B, N+1]
    cols = torch.arange(view_len, device=dev)
    visible = (cols[None, None, :] <= start[:, None, None]).expand(bsz, n + 1, view_len).clone()
    if n:
        node_slots = slots[:, None, 1:].expand(bsz, n, n)  # [B, N, N]: slot of node j
        visible[:, 1:].scatter_(2, node_slots, shape.ancestors.to(dev))
    return positions, slots, visible


def slot_positions(start: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   view_len: int) -> torch.Tensor:  # [B, S] position held by each slot
    """Committed slots hold their own index as position; the new slots the given positions."""
    cols = torch.arange(view_len, device=start.device)
    out = cols[None, :].expand(start.shape[0], view_len).clone()
    return out.scatter_(1, slots, positions)


@torch.inference_mode()
def extend_at(adapter: TargetAdapter, tokens: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor, visible: torch.Tensor, *,
              hidden_layers: tuple[int, ...] | None = None):
    """Run tokens [B, T] at the given positions [B, T] into cache slots [B, T], each query
    seeing the slots marked in visible [B, T, S]; nothing is committed.

    Returns logits [B, T, V] (and, with `hidden_layers`, the features as `extend` does).
    """
    ad = adapter
    assert ad.cache is not None, "prefill first"
    view_len = visible.shape[-1]
    assert int(slots.max()) < view_len, "every written slot must be visible to someone"
    if int(positions.max()) >= ad.max_context:
        raise ValueError(f"a tree position reaches {int(positions.max()) + 1} tokens, beyond "
                         f"the model's context of {ad.max_context}")
    cache = ad.cache
    cache.write_start = None
    cache.write_index = slots
    cache.view_len = view_len
    if view_len > cache.capacity:
        cache.capacity = max(view_len, cache.capacity * 3 // 2 + 64)
    ad._last_width = tokens.shape[1]  # commit / rewind bounds, as after `extend`
    held = slot_positions(ad.lengths, positions, slots, view_len)  # [B, S]
    if ad.lean is not None:
        mask = (ad.layout.visibility(visible, positions, held) if ad.lean.sliding
                else visible[:, None])  # [B, 1, T, S] bool, or one per layer kind
        with governed(ad.lean, *tokens.shape):
            return ad.lean.forward(tokens, positions, cache, mask, 0, hidden_layers)
    mask = ad.layout.mask(visible, positions, held, ad.dtype)
    out = ad.model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache,
                   use_cache=True, output_hidden_states=hidden_layers is not None)
    if hidden_layers is not None:
        return out.logits, torch.cat([out.hidden_states[i] for i in hidden_layers], dim=-1)
    return out.logits


def extend_tree(adapter: TargetAdapter, root: torch.Tensor, tree: DraftTree, *,
                hidden_layers: tuple[int, ...] | None = None):
    """Score the root ([B] the last committed token) and every tree node in one forward.

    Returns logits [B, N+1, V]: position 0 after the root, i+1 after node i's path (the layout
    `verify_tree` takes p in). Unused slots (-1 tokens) are fed as padding and ignored.
    """
    ad = adapter
    start = ad.lengths  # [B]
    n = tree.num_nodes
    view_len = int(start.max()) + n + 1 if start.numel() else n + 1
    positions, slots, visible = tree_layout(start, tree.shape, view_len)
    tokens = torch.cat([root[:, None].to(ad.device),
                        torch.where(tree.tokens >= 0, tree.tokens, ad.pad_token_id).to(ad.device)],
                       1)  # [B, N+1]
    return extend_at(ad, tokens, positions, slots, visible, hidden_layers=hidden_layers)


def path_index(path: torch.Tensor) -> torch.Tensor:  # [B, N] node ids -> [B, N+1] input index
    """Where the root and the accepted path sit in `extend_tree`'s outputs: [0, 1 + path...],
    padded with 0 past the path (pair with the row's num_accepted + 1)."""
    lead = torch.zeros_like(path[:, :1])
    return torch.cat([lead, torch.where(path >= 0, path + 1, 0)], 1)


@torch.inference_mode()
def commit_path(adapter: TargetAdapter, path: torch.Tensor) -> None:
    """Keep the root and the accepted path ([B, N] node indices, -1 padded) of the last
    `extend_tree`: their K/V move to slots L .. L + n, the committed length grows by n + 1."""
    ad = adapter
    assert ad.cache is not None
    n = path.shape[1]
    path = path.to(ad.device)
    accepted = (path >= 0).long().sum(1)  # [B]
    if n:
        start = ad.lengths
        k = torch.arange(n, device=ad.device)
        dst = start[:, None] + 1 + k  # [B, N]
        src = torch.where(path >= 0, start[:, None] + 1 + path, dst)  # path node at depth k+1
        for bufs in (ad.cache.keys, ad.cache.values):
            for buf in bufs:
                if buf is None:
                    continue
                b, h, _, d = buf.shape
                moved = buf.gather(2, src[:, None, :, None].expand(b, h, n, d))
                buf.scatter_(2, dst[:, None, :, None].expand(b, h, n, d), moved)
    ad.lengths = ad.lengths + accepted + 1
