"""An EAGLE head's token trees, fixed (a Branching) or dynamic (a DynamicTree): each depth's
nodes run the head once, attending to the real cache and their own path's keys."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from exactspec.drafters.base import DraftContext
from exactspec.drafters.dynamic_tree import grow
from exactspec.drafters.eagle_head import EagleHead, attend, full_logits
from exactspec.drafters.tree_draft import grow_tree
from exactspec.sampling import DraftTree, branching_parents


@dataclass(frozen=True)
class HeadCache:
    """What a tree reads of an EagleDrafter caught up with the context (read only)."""

    k: torch.Tensor  # [B, h, S, d] the head's keys at the real positions
    v: torch.Tensor  # [B, h, S, d] its values
    o_last: torch.Tensor  # [B, H] the head's output at the last real position
    real: torch.Tensor  # [B] long: the real positions cached per row


@torch.inference_mode()
def eagle_tree(head: EagleHead, cache: HeadCache, context: DraftContext, shape, siblings: str,
               max_depth: torch.Tensor) -> DraftTree:
    """An EAGLE head's tree of `shape` (a Branching or a DynamicTree): the head's output at the
    last real position is the root; each depth's nodes run the head once (attending to the real
    cache and their own path's keys, as the chain does along its drafts)."""
    dev = cache.real.device
    s = cache.real - 1  # last real position (-1: a one-token row, nothing to draft)
    slots = torch.arange(cache.k.shape[2], device=dev)
    seen = slots[None, :] < cache.real[:, None]  # [B, S]
    cap = torch.where(s >= 0, max_depth, 0)
    if not shape.fixed:
        root = full_logits(head, head.logits(cache.o_last))  # [B, V]
        return grow(context, shape, siblings, cap, root,
                    partial(_eagle_frontier, head, cache, s, seen, {}))
    n = len(branching_parents(shape))
    g_node: dict[int, torch.Tensor] = {}  # node -> head output after it [B, H]
    keys: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # node -> (k, v) [B, h, d]
    par = branching_parents(shape)

    def expand(tokens, nodes, depth, anc):
        m = nodes.numel()
        g_par = torch.stack([cache.o_last if par[i] < 0 else g_node[par[i]]
                             for i in nodes.tolist()], 1)  # [B, M, H]
        pos = (s + depth)[:, None].expand(-1, m)
        x, qh, kh, vh = head.qkv(g_par, tokens[:, nodes].clamp(min=0), pos)  # [B, h, M, d]
        for j, i in enumerate(nodes.tolist()):
            keys[i] = (kh[:, :, j], vh[:, :, j])
        chains = [[a for a in range(n) if anc[i, a]] for i in nodes.tolist()]  # depth order
        k_extra = torch.stack([torch.stack([keys[a][0] for a in c], 2) for c in chains], 2)
        v_extra = torch.stack([torch.stack([keys[a][1] for a in c], 2) for c in chains], 2)
        a = attend(qh, cache.k, cache.v, seen[:, None, :].expand(-1, m, -1),
                   k_extra, v_extra)  # [B, h, M, d]
        o = head.finish(x, a)  # [B, M, H]
        bsz = o.shape[0]
        logits = full_logits(head, head.logits(o.reshape(bsz * m, -1))).reshape(bsz, m, -1)
        out = {}
        for j, i in enumerate(nodes.tolist()):
            g_node[i] = o[:, j]
            out[i] = logits[:, j]  # [B, V]
        return out

    root = full_logits(head, head.logits(cache.o_last))  # [B, V]
    return grow_tree(context, shape, siblings, cap, root, expand)


def _eagle_frontier(head: EagleHead, cache: HeadCache, s: torch.Tensor, seen: torch.Tensor,
                    state: dict, tokens: torch.Tensor, slots: torch.Tensor, depth: int,
                    anc: torch.Tensor) -> torch.Tensor:  # [B, M, V]
    """The head after a dynamic tree's frontier `slots` (all at `depth`): s [B] last real
    position, seen [B, S] real slots, state the frontier's head outputs and keys so far,
    tokens [B, F], anc [B, F, F] (dynamic_tree.Expand)."""
    bsz, f = tokens.shape
    m = slots.numel()
    k = m  # frontier width: slots (depth - 1) * k .. depth * k - 1
    if not state:
        hid, c = cache.o_last.shape[-1], head.config
        state["g"] = cache.o_last.new_zeros(bsz, f, hid)  # [B, F, H] output after a slot
        state["k"] = cache.k.new_zeros(bsz, c.num_heads, f, c.head_dim)  # [B, h, F, d]
        state["v"] = torch.zeros_like(state["k"])
    # path[b, j, e] = the frontier slot at depth e + 1 on slot j's path (the slot itself last)
    blocks = anc[:, slots].reshape(bsz, m, f // k, k)[:, :, :depth]  # [B, M, depth, k]
    path = blocks.float().argmax(-1) + torch.arange(depth, device=s.device) * k  # [B, M, depth]
    rows = torch.arange(bsz, device=s.device)[:, None]
    g_par = cache.o_last[:, None].expand(-1, m, -1) if depth == 1 else \
        state["g"][rows, path[:, :, depth - 2]]  # [B, M, H]
    pos = (s + depth)[:, None].expand(-1, m)
    x, qh, kh, vh = head.qkv(g_par, tokens[:, slots].clamp(min=0), pos)  # [B, h, M, d]
    state["k"][:, :, slots], state["v"][:, :, slots] = kh, vh
    idx = path[:, None, :, :, None].expand(-1, kh.shape[1], -1, -1, kh.shape[-1])
    k_extra = state["k"][:, :, None].expand(-1, -1, m, -1, -1).gather(3, idx)  # [B, h, M, D, d]
    v_extra = state["v"][:, :, None].expand(-1, -1, m, -1, -1).gather(3, idx)
    a = attend(qh, cache.k, cache.v, seen[:, None, :].expand(-1, m, -1), k_extra, v_extra)
    o = head.finish(x, a)  # [B, M, H]
    state["g"][:, slots] = o
    return full_logits(head, head.logits(o.reshape(bsz * m, -1))).reshape(bsz, m, -1)
