"""Token trees from drafters: a draft model growing its tree one depth per forward (children
drawn per node by exactspec.drafters.siblings), prompt lookup's branches. An EAGLE head's trees
are in eagle_tree.py, dynamic trees' growth in dynamic_tree.py.

Randomness: node i is drawn with the row's stream, domain DOMAIN_DRAFT + i, so a chain drafted
as a tree uses the same uniforms as the chain drafter. A node is drawn from the draft's q at its
parent's path, standardized with that path as history, and the DraftTree records exactly that
q (or none for point masses), which is what makes verification lossless.
"""

from __future__ import annotations

import torch

from exactspec.drafters.base import DraftContext
from exactspec.drafters.dynamic_tree import grow
from exactspec.drafters.siblings import choose_children
from exactspec.models.tree_attention import extend_at
from exactspec.sampling import DOMAIN_DRAFT, DraftTree, branching_parents, uniforms
from exactspec.sampling.tree import tree_shape


def draft_model_tree(ad, context: DraftContext, shape, siblings: str, max_depth: torch.Tensor,
                     root_logits: torch.Tensor, start: torch.Tensor) -> DraftTree:
    """A DraftModel's tree of `shape` (a Branching or a DynamicTree): from the draft's logits
    at the root [B, V], one draft forward per further depth over that depth's nodes, by tree
    attention in the draft's cache `ad` (a TargetAdapter holding each row's context, the root
    included), node i at slot start + i ([B]); nodes deeper than max_depth [B] are unused."""

    def expand(tokens, nodes, depth, anc):
        return _level_forward(ad, tokens, nodes, start, depth, anc)

    if shape.fixed:
        return grow_tree(context, shape, siblings, max_depth, root_logits, expand)

    def expand_dynamic(tokens, slots, depth, anc):  # -> [B, M, V]
        out = _level_forward(ad, tokens, slots, start, depth, anc)
        return torch.stack([out[int(i)] for i in slots.tolist()], 1)

    return grow(context, shape, siblings, max_depth, root_logits, expand_dynamic)


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
