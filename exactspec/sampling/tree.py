"""Token trees: a draft proposal with several continuations, and its structure.

A `DraftTree` generalises the K draft tokens of a chain: node i holds a token, the index of its
parent (-1 = the last committed token, the root) and q, the distribution it was drawn from. Nodes
are in topological order (a parent before its children); siblings are ordered as they were
drawn. The target scores the root and every node in one forward, so p comes as [B, N+1, V]:
position 0 = after the committed context, position i+1 = after the path to node i.

How siblings were drawn decides which q the verifier must divide by (the conditional law of a
sibling given the siblings drawn before it):
  "iid"                  each sibling drawn independently from its own q (SpecInfer);
  "without_replacement"  from q with the earlier siblings' tokens removed, renormalised (RSD);
  "deterministic"        chosen, not drawn (top-k, n-gram matches): point masses, no q.
A chain is the tree with one child per node; every kind then reduces to `verify`'s chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from exactspec.errors import InvalidType, InvalidValue

SIBLING_KINDS = ("iid", "without_replacement", "deterministic")


@dataclass
class DraftTree:
    """A batch of draft trees with N node slots per row (-1 = an unused slot)."""

    tokens: torch.Tensor  # [B, N] long: node tokens; -1 = unused slot (its subtree unused too)
    parents: torch.Tensor  # [B, N] long: parent node index, -1 = the root; parent < own index
    draft_probs: torch.Tensor | None  # [B, N, V] q each node was drawn from (before removing
    #                                   earlier siblings); None for deterministic trees
    siblings: str = "iid"  # how siblings were drawn: one of SIBLING_KINDS
    _shape: TreeShape | None = field(default=None, init=False, repr=False,
                                     compare=False)  # derived structure, cached by `shape`

    def __post_init__(self) -> None:
        _check_tree(self)

    @classmethod
    def chain(cls, tokens: torch.Tensor, draft_probs: torch.Tensor | None = None,
              siblings: str | None = None) -> DraftTree:
        """The chain x_1 .. x_K (tokens [B, K], -1 padded) as a tree: node i's parent is i - 1."""
        bsz, k = tokens.shape
        parents = torch.arange(-1, k - 1, device=tokens.device).expand(bsz, k).clone()  # [B, K]
        kind = siblings or ("deterministic" if draft_probs is None else "iid")
        return cls(tokens.long(), parents, draft_probs, kind)

    @property
    def num_nodes(self) -> int:
        """N, the node slots per row."""
        return self.tokens.shape[1]

    @property
    def shape(self) -> TreeShape:
        """Depths, ancestors, siblings and children, computed once."""
        if self._shape is None:
            self._shape = tree_shape(self.tokens, self.parents)
        return self._shape


def branching_parents(branching: Sequence[int]) -> list[int]:
    """Parent list of the full tree with `branching[d]` children per node at depth d.

    Breadth first, children of a node contiguous: (2, 2) -> [-1, -1, 0, 0, 1, 1].
    """
    if not branching or any(not isinstance(b, int) or b < 1 for b in branching):
        raise InvalidValue(f"tree branching {tuple(branching)!r} must be a non-empty sequence of "
                           "positive ints, one per depth, e.g. (3, 2, 1)")
    parents: list[int] = []
    level = [-1]  # the nodes of the previous depth
    for width in branching:
        nxt = []
        for node in level:
            for _ in range(width):
                nxt.append(len(parents))
                parents.append(node)
        level = nxt
    return parents


@dataclass
class TreeShape:
    """The structure of a batch of trees, derived from (tokens, parents)."""

    valid: torch.Tensor  # [B, N] bool: slot holds a node
    parents: torch.Tensor  # [B, N] long: parent index, -1 for the root and for unused slots
    depth: torch.Tensor  # [B, N] long: 1 for children of the root, 0 for unused slots
    ancestors: torch.Tensor  # [B, N, N] bool: [b, i, j] = node j is node i or an ancestor of it
    earlier: torch.Tensor  # [B, N, N] bool: [b, i, j] = j is a sibling drawn before i
    prev: torch.Tensor  # [B, N] long: the sibling drawn just before, -1 for a first child
    children: torch.Tensor  # [B, N+1, N] bool: [b, u+1, i] = i is a child of u (u = -1: root)
    last_child: torch.Tensor  # [B, N+1] long: last child of the root / node u, -1 if none
    order: torch.Tensor  # [B, N] long: scan level, parent and previous sibling come earlier; -1 unused

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.depth.numel() else 0

    def paths(self) -> torch.Tensor:  # [B, N+1, N] long node indices, -1 padded
        """The nodes on the path to each terminal (row 0: the root, an empty path)."""
        bsz, n = self.valid.shape
        out = torch.full((bsz, n + 1, n), -1, dtype=torch.long, device=self.valid.device)
        b, i, j = self.ancestors.nonzero(as_tuple=True)
        out[b, i + 1, self.depth[b, j] - 1] = j
        return out


def tree_shape(tokens: torch.Tensor, parents: torch.Tensor) -> TreeShape:
    """Derive depths, ancestor sets, sibling order and children of every node, batched."""
    bsz, n = tokens.shape
    dev = tokens.device
    valid = tokens >= 0  # [B, N]
    idx = torch.arange(n, device=dev)
    par = torch.where(valid, parents, -1)  # [B, N]
    rows = torch.arange(bsz, device=dev)
    anc = torch.zeros(bsz, n, n, dtype=torch.bool, device=dev)
    order = torch.full((bsz, n), -1, dtype=torch.long, device=dev)
    same = (par[:, :, None] == par[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    earlier = same & (idx[None, None, :] < idx[None, :, None])  # [B, N, N]
    prev = torch.where(earlier, idx[None, None, :], -1).amax(-1) if n else par  # [B, N]
    for i in range(n):  # parents and previous siblings precede i
        p_i = par[:, i].clamp(min=0)
        has_parent = (par[:, i] >= 0)
        anc[:, i] = anc[rows, p_i] & has_parent[:, None]
        anc[:, i, i] = valid[:, i]
        after_parent = torch.where(has_parent, order[rows, p_i], -1)
        after_prev = torch.where(prev[:, i] >= 0, order[rows, prev[:, i].clamp(min=0)], -1)
        order[:, i] = torch.where(valid[:, i], 1 + torch.maximum(after_parent, after_prev), -1)
    depth = anc.sum(-1)  # [B, N]
    owner = torch.arange(-1, n, device=dev)  # [N+1]: the root, then every node
    children = (par[:, None, :] == owner[None, :, None]) & valid[:, None, :]  # [B, N+1, N]
    last_child = torch.where(children, idx[None, None, :], -1).amax(-1) if n else \
        torch.full((bsz, 1), -1, dtype=torch.long, device=dev)
    return TreeShape(valid, par, depth, anc, earlier, prev, children, last_child, order)


def tree_history(tokens: torch.Tensor, lengths: torch.Tensor,
                 tree: DraftTree) -> torch.Tensor:  # [B, N+1, T'] long, -1 padded
    """The penalties' history at the root and after each node: the row's tokens ([B, T], valid
    up to lengths [B]) followed by the path to that node. p (and q) at a tree position are
    standardized with it, as `history` + `prefix_history` do along a chain."""
    bsz, n = tree.tokens.shape
    shape = tree.shape
    depth = shape.max_depth
    dev = tokens.device
    paths = shape.paths()[..., :depth].to(dev)  # [B, N+1, D]
    path_tokens = torch.where(paths >= 0, tree.tokens.to(dev).gather(
        1, paths.clamp(min=0).reshape(bsz, -1)).reshape(paths.shape), -1)
    width = (int(lengths.max()) if bsz else 0) + depth
    t = min(width, tokens.shape[1])
    committed = torch.where(torch.arange(t, device=dev)[None, :] < lengths[:, None],
                            tokens[:, :t], -1)  # [B, t]
    out = torch.full((bsz, n + 1, width), -1, dtype=torch.long, device=dev)
    out[:, :, :t] = committed[:, None, :]
    if depth:
        idx = lengths.to(dev)[:, None, None] + torch.arange(depth, device=dev)  # [B, 1, D]
        out.scatter_(2, idx.expand(bsz, n + 1, depth), path_tokens)
    return out


def _check_tree(tree: DraftTree) -> None:
    """Types, shapes, ids, padding and topological order; every mistake names the fix."""
    x, par, q = tree.tokens, tree.parents, tree.draft_probs
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.dim() != 2:
        raise InvalidType("DraftTree.tokens must be an integer tensor [B, N] (-1 = unused slot)")
    if not isinstance(par, torch.Tensor) or par.is_floating_point() or par.shape != x.shape:
        raise InvalidType(f"DraftTree.parents must be an integer tensor shaped like tokens "
                          f"{tuple(x.shape)}; -1 marks a child of the root")
    if tree.siblings not in SIBLING_KINDS:
        raise InvalidValue(f"DraftTree.siblings={tree.siblings!r}; choose one of "
                           f"{', '.join(SIBLING_KINDS)}")
    if tree.siblings == "deterministic" and q is not None:
        raise InvalidValue("DraftTree.siblings='deterministic' takes draft_probs=None: chosen "
                           "children are point masses; pass 'iid' or 'without_replacement' if "
                           "they were sampled from draft_probs")
    if tree.siblings != "deterministic" and q is None:
        raise InvalidValue(f"DraftTree.siblings={tree.siblings!r} needs draft_probs [B, N, V], "
                           "the distributions the nodes were drawn from; use 'deterministic' "
                           "for chosen (point-mass) children")
    if q is not None and (not isinstance(q, torch.Tensor) or q.dim() != 3
                          or q.shape[:2] != x.shape or not q.is_floating_point()):
        got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise InvalidValue(f"DraftTree.draft_probs has shape {got}, expected {tuple(x.shape)} "
                           "+ (V,)")
    n = x.shape[1]
    if (x < -1).any():
        raise InvalidValue("DraftTree.tokens holds ids below -1; -1 is the only padding value")
    valid = x >= 0
    own = torch.arange(n, device=x.device)[None, :]
    if ((par < -1) | (par >= own))[valid].any():
        raise InvalidValue("DraftTree.parents must satisfy -1 <= parent < own index (parents "
                           "before children; -1 = the root)")
    parent_used = valid.gather(1, par.clamp(min=0, max=max(n - 1, 0))) | (par < 0)
    if (valid & ~parent_used).any():
        raise InvalidValue("DraftTree: a node's parent is an unused slot (-1 token); mark its "
                           "whole subtree unused")
