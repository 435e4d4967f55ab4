"""Token trees from drafters: children drawn per node (i.i.d., without replacement, or the
top-k), a draft model growing its tree one depth per forward, prompt lookup's branches.

Randomness: node i is drawn with the row's stream, domain DOMAIN_DRAFT + i, so a chain drafted
as a tree uses the same uniforms as the chain drafter. A node is drawn from the draft's q at its
parent's path, standardized with that path as history, and the DraftTree records exactly that
q (or none for point masses), which is what makes verification lossless.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from exactspec.drafters.base import DraftContext
from exactspec.drafters.dynamic_tree import DynamicTree, grow
from exactspec.errors import InvalidType, InvalidValue
from exactspec.models.tree_attention import extend_at
from exactspec.sampling import (
    DOMAIN_DRAFT,
    SIBLING_KINDS,
    DraftTree,
    branching_parents,
    sample_from_weights,
    uniforms,
)
from exactspec.sampling.tree import tree_shape


def check_tree(tree, siblings: str) -> tuple[tuple[int, ...] | DynamicTree | None, str]:
    """Validate a drafter's `tree=` (branching per depth, a DynamicTree, or "dynamic" /
    "dynamic:16" for one) and `siblings=` arguments."""
    if siblings not in SIBLING_KINDS:
        raise InvalidValue(f"siblings={siblings!r} must be one of {', '.join(SIBLING_KINDS)}")
    if isinstance(tree, str) and tree.startswith("dynamic"):
        tree = DynamicTree() if tree == "dynamic" else DynamicTree.parse(tree)
    if tree is None or isinstance(tree, DynamicTree):
        return tree, siblings
    if isinstance(tree, int | str) or not isinstance(tree, Sequence):
        raise InvalidType(f"tree={tree!r} must be a sequence of branching factors, one per "
                          "depth, e.g. tree=(3, 2, 1), or DynamicTree(node_budget=16)")
    branching_parents(tree)  # raises InvalidValue on zeros and non-ints
    return tuple(tree), siblings


def choose_children(q: torch.Tensor, logits: torch.Tensor, count: int, kind: str,
                    u: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:  # [B, count], -1
    """`count` children per row from q [B, V] (logits [B, V] rank the top-k of greedy rows).

    iid: inverse CDF of q with each column of u [B, count]; without_replacement: the same from
    q without the children drawn before (a row out of mass leaves the rest -1); deterministic:
    the top-k of q's support (greedy rows [B] bool: q's argmax, then the logits' order).
    """
    bsz, vocab = q.shape
    if kind == "deterministic":
        key = torch.where(q > 0, q.double(), -torch.inf)
        key = torch.where(greedy[:, None], torch.where(q > 0, torch.inf, logits.double()), key)
        top = key.topk(min(count, vocab), dim=-1)
        out = torch.where(top.values > -torch.inf, top.indices, -1)
        return torch.cat([out, out.new_full((bsz, count - out.shape[1]), -1)], 1)
    out = torch.full((bsz, count), -1, dtype=torch.long, device=q.device)
    left = q.clone()
    for j in range(count):
        live = left.sum(-1) > 0
        x = sample_from_weights(left, u[:, j])
        out[:, j] = torch.where(live, x, -1)
        if kind == "without_replacement":
            left.scatter_(1, x[:, None], 0.0)
    return out


@torch.inference_mode()
def draft_model_tree(drafter, context: DraftContext, max_depth: torch.Tensor) -> DraftTree:
    """A DraftModel's tree: one draft forward for the root, one per further depth over that
    depth's nodes (tree attention in the draft's own cache); nodes deeper than max_depth [B]
    are left unused. The draft cache keeps only the committed prefix afterwards."""
    ad = drafter._adapter
    dev = ad.device
    feed, last = drafter._catch_up(context)  # [B, W], [B]
    drafter._record(feed, ad.lengths)
    rows = torch.arange(feed.shape[0], device=dev)
    root_logits = ad.extend(feed)[rows, last]  # [B, V]
    ad.commit(last + 1)  # the root (the context's last token) is now cached
    start = ad.lengths.clone()  # [B] node i lives at slot start + i, position start - 1 + depth

    def expand(tokens, nodes, depth, anc):
        return _level_forward(ad, tokens, nodes, start, depth, anc)

    if isinstance(drafter.tree, DynamicTree):
        def expand_dynamic(tokens, slots, depth, anc):  # -> [B, M, V]
            out = _level_forward(ad, tokens, slots, start, depth, anc)
            return torch.stack([out[int(i)] for i in slots.tolist()], 1)

        tree = grow(context, drafter.tree, drafter.siblings, max_depth, root_logits,
                    expand_dynamic)
    else:
        tree = grow_tree(context, drafter.tree, drafter.siblings, max_depth, root_logits, expand)
    # tree slots hold no chain: the next propose must not keep them as an agreeing prefix
    pos = torch.arange(drafter._fed.shape[1], device=dev)[None, :]
    drafter._fed = torch.where(pos < start[:, None], drafter._fed, -1)
    return tree


def grow_tree(context: DraftContext, branching: tuple[int, ...], siblings: str,
              max_depth: torch.Tensor, root_logits: torch.Tensor, expand) -> DraftTree:
    """Grow the full tree of `branching` depth by depth from the draft's logits at the root
    ([B, V]); expand(tokens [B, N], nodes [M], depth, ancestors [N, N]) -> {node: logits [B, V]}
    runs the draft after the given nodes (all at `depth`). Node i is drawn with the row's
    stream, domain DOMAIN_DRAFT + i; nodes deeper than max_depth [B] stay unused."""
    dev = root_logits.device
    bsz, vocab = root_logits.shape
    parents = branching_parents(branching)
    n = len(parents)
    par = torch.tensor(parents, dtype=torch.long, device=dev)
    shape = tree_shape(torch.zeros(1, n, dtype=torch.long, device=dev), par[None])
    depth, anc = shape.depth[0], shape.ancestors[0]  # [N], [N, N]
    greedy = torch.tensor([p.is_greedy for p in context.rows_params()], device=dev)
    kind = "deterministic" if bool(greedy.all()) else siblings
    tokens = torch.full((bsz, n), -1, dtype=torch.long, device=dev)
    q_nodes = torch.zeros(bsz, n, vocab, dtype=torch.float32, device=dev)
    u = torch.cat([uniforms(context.streams, bsz, 1, DOMAIN_DRAFT + i, dev) for i in range(n)], 1)
    paths = torch.full((bsz, n, len(branching)), -1, dtype=torch.long, device=dev)
    level_logits = {-1: root_logits}  # node (or -1, the root) -> its logits [B, V]
    for d in range(len(branching)):
        for u_node in [-1] if d == 0 else (depth == d).nonzero()[:, 0].tolist():
            kids = (par == u_node).nonzero()[:, 0]
            if not kids.numel():
                continue
            hist = None if u_node < 0 else paths[:, u_node, :d]
            q_u = context.standardize(level_logits[u_node], hist).float()  # [B, V]
            x = choose_children(q_u, level_logits[u_node], kids.numel(), kind, u[:, kids], greedy)
            alive = (max_depth > d) & (torch.ones_like(greedy) if u_node < 0
                                       else tokens[:, u_node] >= 0)
            tokens[:, kids] = torch.where(alive[:, None], x, -1)
            q_nodes[:, kids] = q_u[:, None]
            base = paths[:, u_node].clone() if u_node >= 0 else torch.full_like(paths[:, 0], -1)
            paths[:, kids] = base[:, None]
            paths[:, kids, d] = tokens[:, kids]
        nxt = (depth == d + 1).nonzero()[:, 0]
        if d + 1 < len(branching) and nxt.numel():
            level_logits.update(expand(tokens, nxt, d + 1, anc))
    q = None if kind == "deterministic" else q_nodes
    return DraftTree(tokens, par.expand(bsz, n).clone(), q, kind)


@torch.inference_mode()
def eagle_tree(drafter, context: DraftContext, max_depth: torch.Tensor) -> DraftTree:
    """An EAGLE head's tree: the head's output at the last real position is the root; each
    depth's nodes run the head once (attending to the real cache and their own path's keys,
    as the chain does along its drafts)."""
    from exactspec.drafters.eagle import full_logits
    from exactspec.drafters.eagle_head import attend

    head = drafter.head
    hidden = context.hidden
    if hidden is None:
        raise ValueError("EagleDrafter needs the target's hidden states in DraftContext.hidden")
    dev = drafter._committed.device
    tok, lengths = context.tokens.to(dev), context.lengths.to(dev)
    real = drafter._catch_up(hidden.to(dev), tok, lengths)  # [B]
    s = real - 1  # last real position (-1: a one-token row, nothing to draft)
    slots = torch.arange(drafter._k.shape[2], device=dev)
    seen = slots[None, :] < real[:, None]  # [B, S]
    cap = torch.where(s >= 0, max_depth, 0)
    if isinstance(drafter.tree, DynamicTree):
        root = full_logits(head, head.logits(drafter._o_last))  # [B, V]
        return grow(context, drafter.tree, drafter.siblings, cap, root,
                    partial(_eagle_frontier, drafter, s, seen, {}))
    n = len(branching_parents(drafter.tree))
    g_node: dict[int, torch.Tensor] = {}  # node -> head output after it [B, H]
    keys: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # node -> (k, v) [B, h, d]
    par = branching_parents(drafter.tree)

    def expand(tokens, nodes, depth, anc):
        m = nodes.numel()
        g_par = torch.stack([drafter._o_last if par[i] < 0 else g_node[par[i]]
                             for i in nodes.tolist()], 1)  # [B, M, H]
        pos = (s + depth)[:, None].expand(-1, m)
        x, qh, kh, vh = head.qkv(g_par, tokens[:, nodes].clamp(min=0), pos)  # [B, h, M, d]
        for j, i in enumerate(nodes.tolist()):
            keys[i] = (kh[:, :, j], vh[:, :, j])
        chains = [[a for a in range(n) if anc[i, a]] for i in nodes.tolist()]  # depth order
        k_extra = torch.stack([torch.stack([keys[a][0] for a in c], 2) for c in chains], 2)
        v_extra = torch.stack([torch.stack([keys[a][1] for a in c], 2) for c in chains], 2)
        a = attend(qh, drafter._k, drafter._v, seen[:, None, :].expand(-1, m, -1),
                   k_extra, v_extra)  # [B, h, M, d]
        o = head.finish(x, a)  # [B, M, H]
        bsz = o.shape[0]
        logits = full_logits(head, head.logits(o.reshape(bsz * m, -1))).reshape(bsz, m, -1)
        out = {}
        for j, i in enumerate(nodes.tolist()):
            g_node[i] = o[:, j]
            out[i] = logits[:, j]  # [B, V]
        return out

    root = full_logits(head, head.logits(drafter._o_last))  # [B, V]
    return grow_tree(context, drafter.tree, drafter.siblings, cap, root, expand)


def _eagle_frontier(drafter, s: torch.Tensor, seen: torch.Tensor, state: dict,
                    tokens: torch.Tensor, slots: torch.Tensor, depth: int,
                    anc: torch.Tensor) -> torch.Tensor:  # [B, M, V]
    """The head after a dynamic tree's frontier `slots` (all at `depth`): s [B] last real
    position, seen [B, S] real slots, state the frontier's head outputs and keys so far,
    tokens [B, F], anc [B, F, F] (dynamic_tree.Expand)."""
    from exactspec.drafters.eagle import full_logits
    from exactspec.drafters.eagle_head import attend

    head = drafter.head
    bsz, f = tokens.shape
    m = slots.numel()
    k = m  # frontier width: slots (depth - 1) * k .. depth * k - 1
    if not state:
        hid, c = drafter._o_last.shape[-1], head.config
        state["g"] = drafter._o_last.new_zeros(bsz, f, hid)  # [B, F, H] output after a slot
        state["k"] = drafter._k.new_zeros(bsz, c.num_heads, f, c.head_dim)  # [B, h, F, d]
        state["v"] = torch.zeros_like(state["k"])
    # path[b, j, e] = the frontier slot at depth e + 1 on slot j's path (the slot itself last)
    blocks = anc[:, slots].reshape(bsz, m, f // k, k)[:, :, :depth]  # [B, M, depth, k]
    path = blocks.float().argmax(-1) + torch.arange(depth, device=s.device) * k  # [B, M, depth]
    rows = torch.arange(bsz, device=s.device)[:, None]
    g_par = drafter._o_last[:, None].expand(-1, m, -1) if depth == 1 else \
        state["g"][rows, path[:, :, depth - 2]]  # [B, M, H]
    pos = (s + depth)[:, None].expand(-1, m)
    x, qh, kh, vh = head.qkv(g_par, tokens[:, slots].clamp(min=0), pos)  # [B, h, M, d]
    state["k"][:, :, slots], state["v"][:, :, slots] = kh, vh
    idx = path[:, None, :, :, None].expand(-1, kh.shape[1], -1, -1, kh.shape[-1])
    k_extra = state["k"][:, :, None].expand(-1, -1, m, -1, -1).gather(3, idx)  # [B, h, M, D, d]
    v_extra = state["v"][:, :, None].expand(-1, -1, m, -1, -1).gather(3, idx)
    a = attend(qh, drafter._k, drafter._v, seen[:, None, :].expand(-1, m, -1), k_extra, v_extra)
    o = head.finish(x, a)  # [B, M, H]
    state["g"][:, slots] = o
    return full_logits(head, head.logits(o.reshape(bsz * m, -1))).reshape(bsz, m, -1)


def _level_forward(ad, tokens: torch.Tensor, nodes: torch.Tensor, start: torch.Tensor,
                   depth: int, anc: torch.Tensor) -> dict[int, torch.Tensor]:
    """The draft's logits after each of `nodes` (all at `depth`): {node: [B, V]}. anc [N, N]
    (one shape for every row) or [B, N, N] (a dynamic tree's frontier, per row)."""
    bsz = tokens.shape[0]
    dev = tokens.device
    n = tokens.shape[1]
    feed = torch.where(tokens[:, nodes] >= 0, tokens[:, nodes], ad.pad_token_id)  # [B, M]
    slots = start[:, None] + nodes[None, :]  # [B, M]
    positions = (start - 1 + depth)[:, None].expand_as(slots)
    view_len = int(start.max()) + n
    cols = torch.arange(view_len, device=dev)
    visible = (cols[None, None, :] < start[:, None, None]).expand(bsz, nodes.numel(), view_len)
    visible = visible.clone()
    node_slots = start[:, None, None] + torch.arange(n, device=dev)[None, None, :]  # [B, 1, N]
    seen = anc[nodes][None].expand(bsz, -1, -1) if anc.dim() == 2 else anc[:, nodes]
    visible.scatter_(2, node_slots.expand(bsz, nodes.numel(), n), seen)
    logits = extend_at(ad, feed, positions, slots, visible)  # [B, M, V]
    return {int(i): logits[:, m] for m, i in enumerate(nodes.tolist())}


def lookup_tree(context: DraftContext, min_ngram: int, max_ngram: int, branches: int,
                depth: int, max_depth: torch.Tensor) -> DraftTree:
    """Prompt lookup's tree: the continuations of up to `branches` earlier matches of the
    context's last n-gram (longest n first, latest match first), merged into a trie of point
    masses (a shared prefix is one node), each cut at `depth` and at max_depth [B]."""
    tokens, lengths = context.tokens.cpu(), context.lengths.cpu()
    bsz = tokens.shape[0]
    n_slots = branches * depth
    out_tok = torch.full((bsz, n_slots), -1, dtype=torch.long)
    out_par = torch.full((bsz, n_slots), -1, dtype=torch.long)
    for b in range(bsz):
        row = tokens[b, : int(lengths[b])].tolist()
        cap = min(depth, int(max_depth[b]))
        trie: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for cont in _continuations(row, min_ngram, max_ngram, branches, cap):
            node = -1
            for tok in cont:
                key = (node, tok)
                if key not in trie:
                    trie[key] = len(trie)
                    out_tok[b, trie[key]], out_par[b, trie[key]] = tok, node
                node = trie[key]
    dev = context.tokens.device
    return DraftTree(out_tok.to(dev), out_par.to(dev), None, "deterministic")


def _continuations(row: list[int], min_ngram: int, max_ngram: int, count: int,
                   depth: int) -> list[list[int]]:
    """Up to `count` distinct continuations (<= depth tokens) of earlier matches of row's
    suffix: longest n-gram first, then the latest match first."""
    found: list[list[int]] = []
    if depth <= 0:
        return found
    t = len(row)
    for n in range(max_ngram, min_ngram - 1, -1):
        if t < n + 1:
            continue
        suffix = row[t - n:]
        for start in range(t - n - 1, -1, -1):  # an earlier occurrence, followed by a token
            if row[start:start + n] == suffix:
                cont = row[start + n: start + n + depth]
                if cont and cont not in found:
                    found.append(cont)
                    if len(found) == count:
                        return found
    return found
