"""Verification of a token tree: which path to keep, and which token to emit after it.

Glossary as in verify.py: p = target, q = draft. The **accepted** tokens are the path from the
root to the **terminal** node t (the last accepted node; the root itself when none is); then one
extra token is emitted, drawn from t's residual: a **recovered** token when some child of t was
rejected, the **bonus** token p(. | t) at a leaf. Each row emits depth(t) + 1 tokens.

Two stages, as for chains: a law function (`rule_law`, `greedy_tree_law`) computes exactly the
law of t and, for every possible t, the weights of the extra token; `TreeLaw.draw` draws from it
with float64 uniforms. Which rule a method name means is `exactspec.sampling.methods`; the entry
points `tree_acceptance_law` / `verify_tree` are in `exactspec.sampling.verify`.
The audit enumerates the law; the statistical tests check the draws.

The scan. Every node i is tried against its parent's current state (w, P): P is what the next
child must reproduce (p at the parent before any child was tried), w a sequence-level weight
(always 1 for "token"). q_i is node i's law given the siblings drawn before it: its draft_probs
for "iid", the same with the earlier siblings' tokens removed and renormalised for
"without_replacement", one-hot at x_i for "deterministic" (point masses).

token (SpecInfer's multi-step speculative sampling; RSD's recursive rejection sampling; the
  point-mass rule): children are tried in order, child i accepted with a_i = min(1, P(x_i)/q_i(x_i));
  after a rejection P <- norm(max(P - q_i, 0)) (for a point mass: P without x_i, renormalised).
  An accepted child becomes the current node; when all its children are rejected the extra token
  comes from P. P(t = u) = reach(u) prod_{children c of u} (1 - a_c), with
  reach(c_k) = reach(u) prod_{j < k} (1 - a_{c_j}) a_{c_k} and reach(root) = 1.
traversal (Weng et al. 2025, arXiv 2505.12398): node i starts with w_i = min(1, w P(x_i)/q_i(x_i));
  nodes are tested leaf to root in post-order, a node only after all its children failed, and is
  accepted with its current weight f. When child i fails, its parent's state becomes
  S = sum_x max(w P - q_i, 0), P <- max(w P - q_i, 0) / S, w <- S / (S + 1 - w) (0/0 read as 0).
  The root always accepts. P(t = u) = f_u prod_{v before u in post-order} (1 - f_v); the extra
  token comes from t's P. On a chain this is block verification (Sun et al. 2024).
greedy: follow argmax p from the root (the first sibling holding it), emit argmax p after t.

Why both are lossless, for every sibling kind: the state after a failed child depends on q_i
only, not on which token the child held, and min(w P, q_i) + max(w P - q_i, 0) = w P, so "accept
a path through child i" plus "carry on after it failed" reproduces w P(.) followed by the target;
at the root w = 1. The audit (exactspec.audit.trees) checks this by exact enumeration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from exactspec.errors import InvalidType, InvalidValue
from exactspec.sampling.checks import check_distribution
from exactspec.sampling.streams import (
    DOMAIN_ACCEPT,
    DOMAIN_RESAMPLE,
    Randomness,
    sample_from_weights,
    uniforms,
)
from exactspec.sampling.tree import DraftTree

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# step(w [R] f64, P [R, V], q [R, V], x [R]) -> (a [R] f64: acceptance / initial weight of the
#   node, residual [R, V] unnormalised: the parent's extra-token weights once the node failed,
#   w_after [R] f64: the parent's weight for its next child)


def renormalise(res: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R, V]
    """The parent's P for its next child: norm(residual); a row without mass stays zero (it is
    reached only through rounding: then no later sibling is accepted and the extra token is p)."""
    return res / res.sum(-1, keepdim=True).clamp(min=1e-30)


@dataclass(frozen=True)
class SiblingRule:
    """One acceptance rule for trees: how a node is tried, and how its parent moves on."""

    name: str  # "token" | "traversal" | a deliberately wrong variant's label
    step: Step  # the per-node update, see `Step`
    post_order: bool  # True: traversal's leaf-to-root law; False: the top-down token law
    carry: Callable[[torch.Tensor], torch.Tensor] = renormalise  # residual -> next child's P


@dataclass
class TreeVerdict:
    """What tree verification kept. Each row emits num_accepted + 1 tokens."""

    tokens: torch.Tensor  # [B, N+1] long: accepted path tokens, the extra token, then -1
    path: torch.Tensor  # [B, N] long: node indices of the accepted path (root's child first), -1
    num_accepted: torch.Tensor  # [B] long: depth of the terminal node

    @property
    def num_emitted(self) -> torch.Tensor:  # [B]
        return self.num_accepted + 1


@dataclass
class TreeLaw:
    """The exact law of one tree verification step, given the tree.

    terminal_probs[b, 0] = P(nothing accepted), terminal_probs[b, i+1] = P(node i is the last
    accepted node); given the terminal t the extra token is drawn from `residual(t)` normalised.
    """

    method: str  # "token" | "traversal" | "greedy" (or a wrong variant's label)
    terminal_probs: torch.Tensor  # [B, N+1] float64, rows sum to 1
    target_probs: torch.Tensor  # [B, N+1, V]
    tree: DraftTree  # the verified tree
    failed: torch.Tensor | None  # [B, N, V]: node i's parent's residual once i failed (greedy: None)

    def residual(self, t: torch.Tensor) -> torch.Tensor:  # t [B] in 0..N (0 = root) -> [B, V]
        """Unnormalised weights of the extra token after terminal t: the residual left by t's
        last child, or p after t (the bonus) when t has no children; p if no mass is left."""
        rows = torch.arange(t.shape[0], device=t.device)
        p_t = self.target_probs[rows, t]  # [B, V] a copy
        if self.failed is None or not self.failed.shape[1]:
            return p_t
        last = self.tree.shape.last_child[rows, t]  # [B]
        out = torch.where((last >= 0)[:, None], self.failed[rows, last.clamp(min=0)], p_t)
        return torch.where((out.sum(-1) > 0)[:, None], out, p_t)

    def residuals(self) -> torch.Tensor:  # [B, N+1, V]
        """`residual` for every terminal at once (the audit enumerates them all)."""
        bsz, n1 = self.terminal_probs.shape
        dev = self.terminal_probs.device
        return torch.stack([self.residual(torch.full((bsz,), t, dtype=torch.long, device=dev))
                            for t in range(n1)], 1)

    def choose(self, generator: Randomness) -> tuple[torch.Tensor, torch.Tensor]:  # [B], [B]
        """One float64 uniform picks t from its law, one more the extra token (inverse CDF)."""
        bsz = self.terminal_probs.shape[0]
        dev = self.terminal_probs.device
        u = uniforms(generator, bsz, 2, DOMAIN_ACCEPT, dev)  # [B, 2], as verify draws
        t = sample_from_weights(self.terminal_probs, u[:, 0])
        v = uniforms(generator, bsz, 1, DOMAIN_RESAMPLE, dev)[:, 0]
        return t, sample_from_weights(self.residual(t), v)

    def draw(self, generator: Randomness = None) -> TreeVerdict:
        """The accepted path and the extra token, as a TreeVerdict."""
        t, extra = self.choose(generator)
        bsz = self.terminal_probs.shape[0]
        dev = self.terminal_probs.device
        rows = torch.arange(bsz, device=dev)
        path = self.tree.shape.paths()[rows, t]  # [B, N]
        n = (path >= 0).long().sum(1)
        k = self.tree.num_nodes
        tokens = torch.full((bsz, k + 1), -1, dtype=torch.long, device=dev)
        tokens[:, :k] = torch.where(path >= 0, self.tree.tokens.gather(1, path.clamp(min=0)), -1)
        tokens[rows, n] = extra
        return TreeVerdict(tokens=tokens, path=path, num_accepted=n)


class GreedyTreeLaw(TreeLaw):
    """Greedy tree verification: t and the extra token are certain (no uniform is drawn)."""

    def residual(self, t: torch.Tensor) -> torch.Tensor:  # t [B] -> [B, V] one-hot at argmax
        p_t = self.target_probs[torch.arange(t.shape[0], device=t.device), t]  # [B, V]
        return torch.nn.functional.one_hot(p_t.argmax(-1), p_t.shape[-1]).to(p_t.dtype)

    def choose(self, generator: Randomness) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.terminal_probs.argmax(-1)
        rows = torch.arange(t.shape[0], device=t.device)
        return t, self.target_probs[rows, t].argmax(-1)


def _ratio(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """P(x) and q(x) in float64 ([R] each)."""
    return (p.gather(1, x[:, None])[:, 0].to(torch.float64),
            q.gather(1, x[:, None])[:, 0].to(torch.float64))


def token_step(w: torch.Tensor, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor):
    """a = min(1, P(x)/q(x)); after a rejection the residual max(P - q, 0)."""
    px, qx = _ratio(p, q, x)
    return torch.clamp(px / qx, max=1.0), (p - q).clamp(min=0.0), torch.ones_like(w)


def traversal_step(w: torch.Tensor, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor):
    """w_i = min(1, w P(x)/q(x)); after a failure the residual max(w P - q, 0), w <- S/(S+1-w)."""
    px, qx = _ratio(p, q, x)
    res = (w.to(p.dtype)[:, None] * p - q).clamp(min=0.0)
    s = res.sum(-1).to(torch.float64)
    den = s + (1.0 - w)
    w_after = torch.where(den > 0, s / den.clamp(min=1e-300), torch.zeros_like(s))
    return torch.clamp(w * px / qx, max=1.0), res, w_after


RULES = {"token": SiblingRule("token", token_step, False),
         "traversal": SiblingRule("traversal", traversal_step, True)}


def conditional_q(tree: DraftTree, b: torch.Tensor, i: torch.Tensor, dtype: torch.dtype,
                  vocab: int) -> torch.Tensor:  # [R, V]
    """Node (b, i)'s law given the siblings drawn before it (see the module docstring)."""
    x = tree.tokens[b, i]
    if tree.siblings == "deterministic":
        return torch.nn.functional.one_hot(x, vocab).to(dtype)
    q = tree.draft_probs[b, i].to(dtype)  # [R, V] a copy
    if tree.siblings == "iid":
        return q
    earlier = tree.shape.earlier[b, i]  # [R, N]
    rows = earlier.any(-1)
    if not rows.any():
        return q
    removed = torch.zeros_like(q).scatter_add_(1, tree.tokens[b].clamp(min=0),
                                               earlier.to(dtype))  # [R, V]
    kept = q.masked_fill(removed > 0, 0.0)
    return torch.where(rows[:, None], renormalise(kept), q)


def rule_law(rule: SiblingRule, target_probs: torch.Tensor, tree: DraftTree, *,
             check: bool = True) -> TreeLaw:
    """The exact law of `rule` on `tree`: one batched scan over the nodes, level by level.

    Level = 1 + the later of the parent's and the previous sibling's levels, so each level's
    nodes find their parent's weight and their previous sibling's residual computed. Exposed so
    the audit can run deliberately wrong rules through the same machinery.
    """
    p = target_probs
    _check_inputs(p, tree, values=check)
    shape = tree.shape
    bsz, n = tree.tokens.shape
    vocab = p.shape[-1]
    dev = p.device
    accept = torch.zeros(bsz, n, dtype=torch.float64, device=dev)  # a_i or w_i
    w_after = torch.zeros(bsz, n, dtype=torch.float64, device=dev)
    failed = torch.zeros(bsz, n, vocab, dtype=p.dtype, device=dev)
    zero_q = False
    for level in range(int(shape.order.max()) + 1 if n else 0):
        b, i = (shape.order == level).nonzero(as_tuple=True)
        par, prv = shape.parents[b, i], shape.prev[b, i]
        later = prv >= 0
        p_before = p[b, par + 1]  # [R, V]: a first child is tried against p after its parent
        if later.any():  # later siblings against the carried residual of the previous one
            p_before[later] = rule.carry(failed[b[later], prv[later]])
        w_root = torch.where(par >= 0, accept[b, par.clamp(min=0)], 1.0)
        w_before = torch.where(later, w_after[b, prv.clamp(min=0)], w_root)  # [R]
        q = conditional_q(tree, b, i, p.dtype, vocab)  # [R, V]
        x = tree.tokens[b, i]
        zero_q |= bool((q.gather(1, x[:, None]) <= 0).any())
        accept[b, i], failed[b, i], w_after[b, i] = rule.step(w_before, p_before, q, x)
    if zero_q:
        raise InvalidValue(_zero_q_message(tree.siblings))
    if rule.post_order:
        last = shape.last_child[:, 1:]  # [B, N]
        rows = torch.arange(bsz, device=dev)[:, None]
        final = torch.where(last >= 0, w_after[rows, last.clamp(min=0)], accept)  # [B, N]
        probs = _post_order_law(final, shape)
    else:
        probs = _top_down_law(accept, tree)
    return TreeLaw(rule.name, probs, p, tree, failed)


def _top_down_law(accept: torch.Tensor, tree: DraftTree) -> torch.Tensor:  # [B, N+1] float64
    """P(t = u) = reach(u) prod_{children c}(1 - a_c), reach(c_k) = reach(u) prod_{j<k}(1 - a_j) a_k."""
    shape = tree.shape
    bsz, n = accept.shape
    fail = torch.where(shape.valid, 1.0 - accept, torch.ones_like(accept))  # [B, N]
    ones = torch.ones_like(fail)[:, None, :]
    siblings = torch.where(shape.earlier, fail[:, None, :], ones).prod(-1)  # [B, N]
    reach = torch.ones(bsz, n + 1, dtype=torch.float64, device=accept.device)  # root first
    rows = torch.arange(bsz, device=accept.device)
    for i in range(n):
        reach[:, i + 1] = reach[rows, shape.parents[:, i] + 1] * siblings[:, i] \
            * accept[:, i] * shape.valid[:, i]
    stop = torch.where(shape.children, fail[:, None, :], ones).prod(-1)  # [B, N+1]
    return reach * stop


def _post_order_law(final: torch.Tensor, shape) -> torch.Tensor:  # [B, N+1] float64
    """P(t = u) = f_u prod_{v tested before u} (1 - f_v); the root, tested last, always accepts."""
    anc = shape.ancestors.to(torch.float64)  # [B, N, N]: [i, j] = j ancestor-or-self of i
    desc = shape.ancestors.transpose(1, 2) & ~torch.eye(final.shape[1], dtype=torch.bool,
                                                        device=final.device)  # [i, j]: j below i
    left = (anc @ shape.earlier.to(torch.float64)) > 0  # [i, s]: s earlier sibling of i's line
    before = desc | ((left.to(torch.float64) @ anc.transpose(1, 2)) > 0)  # [i, j] j tested first
    f = torch.where(shape.valid, final, torch.zeros_like(final))
    fail = (1.0 - f)[:, None, :]
    nodes = f * torch.where(before, fail, torch.ones_like(fail)).prod(-1)  # [B, N]
    return torch.cat([(1.0 - f).prod(-1, keepdim=True), nodes], 1)


def greedy_tree_law(p: torch.Tensor, tree: DraftTree, *, check: bool = True) -> TreeLaw:
    """Follow argmax p through the tree (ties to the lowest id, the first matching sibling)."""
    _check_inputs(p, tree, values=check)
    shape = tree.shape
    bsz, n = tree.tokens.shape
    top = p.argmax(-1)  # [B, N+1]
    hit = shape.valid & (tree.tokens == top.gather(1, shape.parents + 1))
    first = hit & ~(shape.earlier & hit[:, None, :]).any(-1)  # [B, N]
    on = shape.valid & ~(shape.ancestors & ~first[:, None, :]).any(-1)  # the path nodes
    deepest = torch.where(on, shape.depth, 0)
    t = torch.where(on.any(-1), deepest.argmax(-1) + 1, 0) if n else \
        torch.zeros(bsz, dtype=torch.long, device=p.device)
    probs = torch.nn.functional.one_hot(t, n + 1).to(torch.float64)
    return GreedyTreeLaw("greedy", probs, p, tree, None)


def _zero_q_message(kind: str) -> str:
    if kind == "without_replacement":
        return ("a tree node has q(x) = 0 given its earlier siblings: siblings drawn without "
                "replacement hold distinct tokens of positive q; pass the distribution each "
                "node was drawn from, or siblings='iid' if they were drawn independently")
    return ("a tree node has q(x) = 0 under draft_probs: it cannot have been sampled from q; "
            "pass the exact distribution each node was drawn from")


def _check_inputs(p: torch.Tensor, tree: DraftTree, *, values: bool) -> None:
    """Shapes, ids and (optionally) the probabilities of every used position."""
    if not isinstance(tree, DraftTree):
        raise InvalidType(f"tree must be a DraftTree, got {type(tree).__name__}")
    if not isinstance(p, torch.Tensor) or not p.is_floating_point() or p.dim() != 3:
        raise InvalidType("target_probs must be a float tensor [B, N+1, V]")
    bsz, n = tree.tokens.shape
    if p.shape[:2] != (bsz, n + 1):
        raise InvalidValue(f"target_probs has shape {tuple(p.shape)}, expected {(bsz, n + 1)} "
                           "+ (V,): p after the root, then after each of the N nodes")
    vocab = p.shape[-1]
    q = tree.draft_probs
    if q is not None and q.shape[-1] != vocab:
        raise InvalidValue(f"draft_probs has vocabulary {q.shape[-1]}, target_probs {vocab}; "
                           "draft and target must share one vocabulary")
    if (tree.tokens >= vocab).any():
        raise InvalidValue(f"tree token id out of range: ids must be in [0, {vocab}) "
                           "(-1 = unused slot)")
    if not values:
        return
    valid = tree.shape.valid
    used = torch.cat([torch.ones(bsz, 1, dtype=torch.bool, device=p.device), valid], 1)
    check_distribution(p, used, "target_probs")
    if q is not None:
        check_distribution(q, valid, "draft_probs")

