"""Dynamic token trees (EAGLE-2, arXiv 2406.16858): grown where the draft is confident.
The shape's parameters are `DynamicTree` (exactspec.drafters.tree_shape); this is its growth.

Growth. The root's children are the draft's top `top_k` tokens; at each further depth the
`top_k` nodes of the previous depth with the highest **path score** (the product of the draft's
probabilities along the path) run the draft once, together, and each proposes its own top
`top_k` tokens as candidates. Every candidate stays a candidate; at the end the `node_budget`
candidates with the highest path score make the tree. A child's score is at most its parent's
(and ties keep the shallower node first), so the kept set is closed under ancestors.

Exactness, deterministic children (siblings "deterministic", EAGLE-2's; also every all-greedy
batch): every node is a point mass and the point-mass rule (accept x with P(x), else remove x) is exact
for any tree whose shape is a function of draft-side information only (the draft's logits;
never p, never the verifier's uniforms). The ranking distribution is the standardized q of the
row (the engine's parameters and the path's history); for greedy rows, whose q is one-hot, the
softmax of the draft's raw logits.

Sampled children (`siblings="without_replacement"`, the drafters' default, or "iid";
`grow_sampled`): EAGLE-2's final
cut is not allowed there (keeping a drawn node because its own q was high biases it towards
high-q tokens). Instead every drawn node is kept, and the shape is fixed before the draws it
governs: depth d + 1 gets min(top_k, budget left) slots, shared among the depth-d nodes by
path score (D'Hondt: the j-th child of u has priority score(u) / j) before any of them is
drawn; a node's children are then a prefix, of that length, of top_k draws from its q. For the
token rule this is exact: a node's acceptance is decided at its parent with its own q, and its
subtree, whatever its size, reproduces p after it, because the size was fixed before its
children were drawn. Traversal verification is refused on such trees (its proof assumes a
fixed shape; see engine/tree_step.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from exactspec.drafters.base import DraftContext
from exactspec.drafters.siblings import choose_children
from exactspec.drafters.tree_shape import DynamicTree
from exactspec.sampling import DOMAIN_DRAFT, DraftTree, uniforms

__all__ = ["DynamicTree", "Expand", "grow", "grow_dynamic", "grow_sampled"]

Expand = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]
# expand(tokens [B, S] frontier tokens (-1 = dead slot), slots [M] frontier slots to run (all
#   at `depth`), depth (1 = children of the root), ancestors [B, S, S] bool over frontier slots)
#   -> the draft's logits after each of those slots [B, M, V]. Frontier slot (d - 1) * top_k + j
#   is the j-th expanded node of depth d.


def grow(context: DraftContext, spec: DynamicTree, siblings: str, max_depth: torch.Tensor,
         root_logits: torch.Tensor, expand: Expand) -> DraftTree:
    """The dynamic tree of `spec` (root logits [B, V], max_depth [B]): EAGLE-2's growth for
    deterministic children or an all-greedy batch, else `grow_sampled`."""
    greedy = all(p.is_greedy for p in context.rows_params())
    if siblings == "deterministic" or greedy:
        return grow_dynamic(context, spec, max_depth, root_logits, expand)
    return grow_sampled(context, spec, siblings, max_depth, root_logits, expand)


def grow_dynamic(context: DraftContext, spec: DynamicTree, max_depth: torch.Tensor,
                 root_logits: torch.Tensor, expand: Expand) -> DraftTree:
    """The dynamic tree of `spec` from the draft's logits at the root [B, V]; no node deeper
    than max_depth [B]. Rows get node_budget slots (fewer nodes: -1 padded at the end)."""
    dev = root_logits.device
    bsz, _ = root_logits.shape
    k = spec.top_k
    depth_cap = min(spec.max_depth, int(max_depth.max()) if bsz else 0)
    greedy = torch.tensor([p.is_greedy for p in context.rows_params()], device=dev)
    rows = torch.arange(bsz, device=dev)
    n_front = max(depth_cap, 1) * k
    f_tok = torch.full((bsz, n_front), -1, dtype=torch.long, device=dev)  # frontier tokens
    f_anc = torch.zeros(bsz, n_front, n_front, dtype=torch.bool, device=dev)
    f_cand = torch.full((bsz, n_front), -1, dtype=torch.long, device=dev)  # its candidate
    f_score = torch.zeros(bsz, n_front, dtype=torch.float64, device=dev)
    c_tok, c_par, c_score, c_depth = [], [], [], []  # per depth: [B, C_d] each
    n_cand = 0
    # the root's "frontier": one node with score 1, its logits and (empty) path
    p_score = torch.ones(bsz, 1, dtype=torch.float64, device=dev)  # [B, F]
    p_cand = torch.full((bsz, 1), -1, dtype=torch.long, device=dev)  # [B, F] candidate ids
    p_tok = torch.ones(bsz, 1, dtype=torch.long, device=dev)  # [B, F] alive (>= 0) or -1
    logits = root_logits[:, None]  # [B, F, V]
    paths = torch.full((bsz, 1, 0), -1, dtype=torch.long, device=dev)  # [B, F, d-1] tokens
    for d in range(1, depth_cap + 1):
        tok, rank = _top_children(context, logits, paths, k, greedy)  # [B, F, k] each
        alive = (tok >= 0) & (p_tok >= 0)[:, :, None] & (max_depth >= d)[:, None, None]
        score = torch.where(alive, p_score[:, :, None] * rank, -1.0).flatten(1)  # [B, F*k]
        tok = torch.where(alive, tok, -1).flatten(1)
        c_tok.append(tok)
        c_par.append(p_cand.repeat_interleave(k, 1))
        c_score.append(score)
        c_depth.append(torch.full_like(tok, d))
        if d == depth_cap:
            break
        # the next frontier: the k best candidates of this depth (ties: the earlier one)
        best = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :k]  # [B, k]
        slots = torch.arange((d - 1) * k, d * k, device=dev)  # [k]
        f_tok[:, slots] = tok.gather(1, best)
        f_cand[:, slots] = n_cand + best
        f_score[:, slots] = score.gather(1, best)
        f_anc[:, slots, slots] = f_tok[:, slots] >= 0
        if d > 1:
            par_slot = (d - 2) * k + best // k  # [B, k] the frontier slot it grew from
            f_anc[:, slots] |= f_anc[rows[:, None], par_slot]
        n_cand += score.shape[1]
        logits = expand(f_tok, slots, d, f_anc)  # [B, k, V]
        p_score, p_cand, p_tok = f_score[:, slots], f_cand[:, slots], f_tok[:, slots]
        from_par = paths.gather(1, (best // k)[..., None].expand(-1, -1, d - 1))
        paths = torch.cat([from_par, f_tok[:, slots, None]], 2)  # [B, k, d] path tokens
    if not c_tok:  # no row may draft: one unused slot each
        empty = torch.full((bsz, 1), -1, dtype=torch.long, device=dev)
        return DraftTree(empty, empty.clone(), None, "deterministic")
    return _keep_best(torch.cat(c_tok, 1), torch.cat(c_par, 1), torch.cat(c_score, 1),
                      torch.cat(c_depth, 1), spec.node_budget)


def _top_children(context: DraftContext, logits: torch.Tensor, paths: torch.Tensor, k: int,
                  greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k children of each of F nodes (logits [B, F, V] after the paths [B, F, d-1]):
    tokens [B, F, k] (-1 beyond q's support) and their ranking probabilities [B, F, k] float64.
    Greedy rows: q's argmax first, then the logits' order, ranked by the softmax of the
    logits; other rows: q's top-k, ranked by q."""

    bsz, f, vocab = logits.shape
    flat = logits.reshape(bsz * f, vocab)
    hist = paths.reshape(bsz * f, -1)
    ctx = _repeat_rows(context, f)
    q = ctx.standardize(flat, hist if hist.shape[1] else None).float()  # [B*F, V]
    g = greedy.repeat_interleave(f)
    kids = choose_children(q, flat, k, "deterministic", None, g)  # [B*F, k]
    conf = torch.where(g[:, None], torch.softmax(flat.double(), -1), q.double())  # [B*F, V]
    rank = torch.where(kids >= 0, conf.gather(1, kids.clamp(min=0)), 0.0)
    return kids.reshape(bsz, f, k), rank.reshape(bsz, f, k)


def _repeat_rows(context: DraftContext, f: int) -> DraftContext:
    """The context with each row repeated f times (to standardize F nodes' logits at once)."""
    if f == 1:
        return context
    return DraftContext(context.tokens.repeat_interleave(f, 0),
                        context.lengths.repeat_interleave(f, 0),
                        context.prompt_lengths.repeat_interleave(f, 0), None, context.streams,
                        row_params=tuple(p for p in context.rows_params() for _ in range(f)))


def _keep_best(tok: torch.Tensor, par: torch.Tensor, score: torch.Tensor,
               depth: torch.Tensor, budget: int) -> DraftTree:
    """The `budget` best candidates (tok, par, score, depth [B, C]; par = candidate index or
    -1) as a DraftTree: breadth first, siblings by score, -1 padded."""
    bsz, c = tok.shape
    dev = tok.device
    n = min(budget, c)
    order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :n]  # [B, n]
    keep_depth = torch.where(tok.gather(1, order) >= 0, depth.gather(1, order), c + 1)
    order = order.gather(1, torch.sort(keep_depth, dim=1, stable=True).indices)  # breadth first
    new_tok = tok.gather(1, order)  # [B, n]
    new_index = torch.full((bsz, c), -1, dtype=torch.long, device=dev)
    new_index.scatter_(1, order, torch.arange(n, device=dev).expand(bsz, n))
    old_par = par.gather(1, order)
    new_par = torch.where(old_par >= 0, new_index.gather(1, old_par.clamp(min=0)), -1)
    assert not ((new_tok >= 0) & (old_par >= 0) & (new_par < 0)).any(), "ancestors kept"
    new_par = torch.where(new_tok >= 0, new_par, -1)
    return DraftTree(new_tok, new_par, None, "deterministic")


def grow_sampled(context: DraftContext, spec: DynamicTree, siblings: str,
                 max_depth: torch.Tensor, root_logits: torch.Tensor,
                 expand: Expand) -> DraftTree:
    """A dynamic tree of sampled children (see the module docstring): at most top_k nodes per
    depth, node_budget in all; slots laid out depth by depth, so slot = frontier slot."""

    dev = root_logits.device
    bsz, vocab = root_logits.shape
    k = spec.top_k
    depth_cap = min(spec.max_depth, int(max_depth.max()) if bsz else 0)
    greedy = torch.tensor([p.is_greedy for p in context.rows_params()], device=dev)
    nodes = _Nodes.empty(bsz, max(depth_cap, 1) * k, vocab, dev)
    used = 0
    # the parents of depth d: (their slots [F] or the root, scores [B, F], logits [B, F, V])
    p_slots, p_score, logits = None, torch.ones(bsz, 1, dtype=torch.float64, device=dev), \
        root_logits[:, None]
    paths = torch.full((bsz, 1, 0), -1, dtype=torch.long, device=dev)  # [B, F, d-1]
    for d in range(1, depth_cap + 1):
        m = min(k, spec.node_budget - used)  # slots of this depth
        if m <= 0:
            break
        count = _shares(p_score, m, max_depth >= d)  # [B, F] children of each parent
        base = 0 if p_slots is None else int(p_slots[0]) + 1
        kids, q = _draw(context, logits, paths, k, siblings, greedy, base)
        which = nodes.place(used, m, count, kids, q, p_slots, p_score)  # [B, m]
        new = slice(used, used + m)
        paths = torch.cat([paths.gather(1, which[..., None].expand(-1, -1, d - 1)),
                           nodes.tok[:, new, None]], 2)  # [B, m, d]
        slots = torch.arange(used, used + m, device=dev)
        used += m
        if d == depth_cap or used >= spec.node_budget:
            break
        logits = expand(nodes.tok, slots, d, nodes.anc)  # [B, m, V]
        p_slots, p_score = slots, nodes.score[:, new]
    used = max(used, 1)  # no row may draft: one unused slot each
    tok, par, q_nodes = nodes.tok[:, :used], nodes.par[:, :used], nodes.q[:, :used]
    return DraftTree(tok, torch.where(tok >= 0, par, -1), q_nodes, siblings)


def _shares(p_score: torch.Tensor, m: int, live_rows: torch.Tensor) -> torch.Tensor:
    """How many of a depth's m slots each parent gets, fixed before any child is drawn:
    D'Hondt on the parents' path scores p_score [B, F] (the j-th child of u has priority
    score(u) / j); none for a dead parent (score -1) or a row past its max depth (live_rows
    [B] bool). -> [B, F] long."""
    bsz, f = p_score.shape
    dev = p_score.device
    prio = p_score[:, :, None] / torch.arange(1, m + 1, device=dev)[None, None]  # [B, F, m]
    prio = torch.where(p_score[:, :, None] >= 0, prio, -1.0).flatten(1)
    pick = torch.sort(prio, dim=1, descending=True, stable=True).indices[:, :m]  # [B, m]
    live = (prio.gather(1, pick) >= 0) & live_rows[:, None]  # [B, m]
    count = torch.zeros(bsz, f, dtype=torch.long, device=dev)
    count.scatter_add_(1, pick // m, live.long())  # [B, F]
    return count


def _draw(context: DraftContext, logits: torch.Tensor, paths: torch.Tensor, k: int,
          siblings: str, greedy: torch.Tensor, base: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k children of each of F parents (logits [B, F, V] after the paths [B, F, d-1]),
    drawn from the standardized q with the draft uniforms of positions base.. (one per
    parent): kids [B, F, k] (-1 beyond q's support) and q [B, F, V]."""
    bsz, f, vocab = logits.shape
    flat = logits.reshape(bsz * f, vocab)
    hist = paths.reshape(bsz * f, -1)
    ctx = _repeat_rows(context, f)
    q = ctx.standardize(flat, hist if hist.shape[1] else None).float()  # [B*F, V]
    u = torch.cat([uniforms(context.streams, bsz, k, DOMAIN_DRAFT + base + j, logits.device)
                   for j in range(f)], 1).reshape(bsz * f, k)  # [B*F, k]
    kids = choose_children(q, flat, k, siblings, u, greedy.repeat_interleave(f))
    return kids.reshape(bsz, f, k), q.reshape(bsz, f, vocab)  # [B, F, k], [B, F, V]


@dataclass
class _Nodes:
    """A sampled tree's nodes, slot = node, laid out depth by depth."""

    tok: torch.Tensor  # [B, N] long: the node's token, -1 an empty slot
    par: torch.Tensor  # [B, N] long: the parent's slot, -1 the root
    q: torch.Tensor  # [B, N, V] float32: the law the node was drawn from
    anc: torch.Tensor  # [B, N, N] bool: a node's ancestors and itself
    score: torch.Tensor  # [B, N] float64: path score, -1 dead

    @classmethod
    def empty(cls, bsz: int, n: int, vocab: int, dev) -> _Nodes:
        return cls(torch.full((bsz, n), -1, dtype=torch.long, device=dev),
                   torch.full((bsz, n), -1, dtype=torch.long, device=dev),
                   torch.zeros(bsz, n, vocab, dtype=torch.float32, device=dev),
                   torch.zeros(bsz, n, n, dtype=torch.bool, device=dev),
                   torch.full((bsz, n), -1.0, dtype=torch.float64, device=dev))

    def place(self, used: int, m: int, count: torch.Tensor, kids: torch.Tensor,
              q: torch.Tensor, p_slots: torch.Tensor | None, p_score: torch.Tensor
              ) -> torch.Tensor:
        """Put a depth's children in slots used..used+m: the first count [B, F] of each
        parent's draws kids [B, F, k] (q [B, F, V]), parents in order, a parent's children
        contiguous (p_slots [F]: the parents' slots, None: the root; p_score [B, F]). Returns
        each slot's parent among the F [B, m] (0 for unused slots)."""
        bsz, f, k = kids.shape
        n, vocab, dev = self.tok.shape[1], q.shape[2], kids.device
        first = count.cumsum(1) - count  # [B, F]
        j = torch.arange(k, device=dev)
        slot = used + first[:, :, None] + j  # [B, F, k]
        keep = (j[None, None] < count[:, :, None]) & (kids >= 0)  # [B, F, k]
        slot = torch.where(keep, slot, n)  # n: a scratch column, dropped below
        new = slice(used, used + m)
        grid = torch.full((bsz, n + 1), -1, dtype=torch.long, device=dev)  # [B, N + scratch]
        self.tok[:, new] = grid.scatter(1, slot.flatten(1), kids.flatten(1))[:, new]
        parent_index = torch.arange(f, device=dev)[None, :, None].expand(bsz, f, k)
        which = grid.scatter(1, slot.flatten(1), parent_index.flatten(1))[:, new]  # [B, m]
        which = which.clamp(min=0)  # index into this depth's parents (0 for unused slots)
        if p_slots is not None:
            self.par[:, new] = p_slots[which]
        alive = self.tok[:, new] >= 0
        self.q[:, new] = q.gather(1, which[..., None].expand(-1, -1, vocab))
        own = self.q[:, new].gather(2, self.tok[:, new].clamp(min=0)[..., None])[..., 0].double()
        self.score[:, new] = torch.where(alive, p_score.gather(1, which) * own, -1.0)
        slots = torch.arange(used, used + m, device=dev)
        self.anc[:, slots, slots] = alive
        if p_slots is not None:
            rows = torch.arange(bsz, device=dev)[:, None]
            self.anc[:, slots] |= self.anc[rows, self.par[:, new].clamp(min=0)] & alive[..., None]
        return which
