"""The tree rules as audit schemes: exact enumeration of their output law, batched simulation,
and the tree pitfalls as deliberately wrong variants.

One tree step after a context: draw every node of a fixed topology (parents) the way a drafter
would (i.i.d., without replacement, or deterministic top-k of q), verify with the library's own
`tree_acceptance_law` / `verify_tree`, emit the accepted path and one extra token. `step_law`
enumerates all V**N token assignments of the tree (those the drafter can produce) and folds the
(tree, terminal node) outcomes into the chain format of `exact.StepLaw`: a "block" is the accepted
path padded with token 0 to the tree's depth D, n its length, so `output_law` chains tree steps
into whole generations unchanged. The world must tabulate contexts up to length L + D.

Pitfalls (each changes one thing, otherwise the library's code):
1. siblings drawn without replacement, verified as if i.i.d. (q not conditioned on the earlier
   siblings);
2. the residual not renormalised after a rejected sibling (the next sibling's ratio is taken
   against max(P - q, 0) instead of norm(max(P - q, 0)));
3. a node's q taken from its parent's slot of draft_probs (the distribution the parent was drawn
   from, one position too early);
4. deterministic top-k children verified as if sampled from q.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from exactspec.audit.exact import StepLaw, normalise
from exactspec.audit.world import World, offset, random_world
from exactspec.sampling import DOMAIN_DRAFT, sample_from_weights, uniforms
from exactspec.sampling.tree import SIBLING_KINDS, DraftTree, branching_parents, tree_shape
from exactspec.sampling.tree_verify import (
    SiblingRule,
    TreeLaw,
    rule_law,
    token_step,
)
from exactspec.sampling.verify import tree_acceptance_law


@dataclass
class TreeScheme:
    """The library's tree verifier `method` on trees of one topology, drawn as `drawn`.

    claimed: the sibling kind verify is told (None: the truth); rule: a deliberately wrong rule
    run through the same scan instead of the method's; q_from_parent: each node is handed its
    parent's q (pitfall 3). The default is the correct sampler.
    """

    method: str  # "token" | "traversal" | "greedy"
    parents: tuple[int, ...]  # the topology: parent of each node, -1 = root, topological order
    drawn: str  # how the siblings are really drawn: one of SIBLING_KINDS
    claimed: str | None = field(default=None, kw_only=True)  # kind told to verify; None = drawn
    rule: SiblingRule | None = field(default=None, kw_only=True)  # a wrong rule, else the method's
    q_from_parent: bool = field(default=False, kw_only=True)  # pitfall 3: q one slot too early
    label: str | None = field(default=None, kw_only=True)  # name in reports

    def __post_init__(self) -> None:
        assert self.drawn in SIBLING_KINDS and (self.claimed or self.drawn) in SIBLING_KINDS
        self.parents = tuple(self.parents)
        shape = tree_shape(torch.zeros(1, len(self.parents), dtype=torch.long),
                           torch.tensor([self.parents]))
        self._depth = shape.depth[0]  # [N] depth of each node
        self._rank = shape.earlier[0].sum(-1)  # [N] siblings drawn before each node

    @property
    def name(self) -> str:
        return self.label or f"{self.method} ({self.drawn})"

    @property
    def num_draft(self) -> int:
        """D, the tree's depth: the longest path a step can accept (output_law's K)."""
        return int(self._depth.max())

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    def verified_kind(self) -> str:
        return self.claimed or self.drawn

    def law(self, target: torch.Tensor, tree: DraftTree) -> TreeLaw:
        """The exact law: the wrong rule if one is set, else the library's method."""
        if self.rule is not None:
            return rule_law(self.rule, target, tree)
        return tree_acceptance_law(target, tree, method=self.method)

    def make_tree(self, tokens: torch.Tensor, claimed_q: torch.Tensor | None) -> DraftTree:
        """The DraftTree handed to verify: tokens [R, N], claimed_q [R, N, V] (q per node)."""
        kind = self.verified_kind()
        parents = torch.tensor(self.parents, dtype=torch.long).expand(len(tokens), -1)
        q = None if kind == "deterministic" else claimed_q
        if q is not None and self.q_from_parent:
            src = torch.tensor([par if par >= 0 else i
                                for i, par in enumerate(self.parents)])
            q = q[:, src]
        return DraftTree(tokens, parents.clone(), q, kind)

    def tree_prob(self, tokens: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:  # [R] float64
        """P(tree | context) under the drawing process: tokens [R, N], draft [R, N, V] (q of
        each node's parent context)."""
        x = tokens[..., None]
        q_x = draft.gather(-1, x)[..., 0]  # [R, N]
        if self.drawn == "iid":
            return q_x.prod(-1)
        earlier = self._earlier_matrix()  # [N, N]
        same = tokens[:, :, None] == tokens[:, None, :]  # [R, N, N]
        if self.drawn == "without_replacement":
            taken = (draft.gather(-1, tokens[:, None, :].expand(-1, self.num_nodes, -1))
                     * earlier).sum(-1)  # [R, N] q mass of the earlier siblings
            repeat = (same & earlier.bool()).any(-1)
            cond = torch.where(repeat, 0.0, q_x / (1.0 - taken).clamp(min=1e-300))
            return cond.prod(-1)
        ranked = torch.sort(draft, dim=-1, descending=True, stable=True).indices  # [R, N, V]
        top = ranked.gather(-1, self._rank.expand(len(tokens), -1)[..., None])[..., 0]
        return (top == tokens).all(-1).to(torch.float64)

    def _earlier_matrix(self) -> torch.Tensor:  # [N, N] float64
        par = torch.tensor(self.parents)
        idx = torch.arange(len(par))
        return ((par[:, None] == par[None, :]) & (idx[None, :] < idx[:, None])).double()

    def step_law(self, world: World, length: int) -> StepLaw:
        """Exact law of one tree step after every context of `length` tokens."""
        v, n, d = world.vocab, self.num_nodes, self.num_draft
        assert length + d < world.depth, f"world depth {world.depth} too small for {length}+{d}"
        trees = torch.arange(v**n)[:, None] // (v ** torch.arange(n - 1, -1, -1))[None, :] % v
        rows, par_rows = self._rows(world, length, torch.arange(v**length), trees)
        n_ctx, n_trees = v**length, len(trees)
        draft = world.draft[par_rows].reshape(-1, n, v)  # [C*T, N, V]
        tokens = trees.repeat(n_ctx, 1)  # [C*T, N]
        prob = self.tree_prob(tokens, draft)
        live = (prob > 0).nonzero()[:, 0]
        claimed = None if world.claimed is None else world.claimed[par_rows].reshape(-1, n, v)
        tree = self.make_tree(tokens[live], None if claimed is None else claimed[live])
        law = self.law(world.target[rows].reshape(-1, n + 1, v)[live], tree)
        paths = tree.shape.paths()  # [R, N+1, N]
        depth = (paths >= 0).sum(-1)  # [R, N+1]
        path_tokens = torch.where(paths >= 0, tree.tokens.gather(
            1, paths.clamp(min=0).reshape(len(live), -1)).reshape(paths.shape), 0)[..., :d]
        block = (path_tokens * v ** torch.arange(d - 1, -1, -1)).sum(-1)  # [R, N+1]
        ctx = live // n_trees
        weight = prob[live, None] * law.terminal_probs  # [R, N+1]
        extra = normalise(law.residuals().to(torch.float64))  # [R, N+1, V]
        out = torch.zeros(n_ctx * v**d, d + 1, v, dtype=torch.float64)
        out.index_put_(((ctx[:, None] * v**d + block).reshape(-1), depth.reshape(-1)),
                       (weight[..., None] * extra).reshape(-1, v), accumulate=True)
        out = out.reshape(n_ctx, v**d, d + 1, v)
        blocks = torch.arange(v**d)[:, None] // (v ** torch.arange(d - 1, -1, -1))[None, :] % v
        return StepLaw(blocks, out.sum(-1), normalise(out))

    def _rows(self, world: World, length: int, ctx: torch.Tensor, trees: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:  # [C, T, N+1], [C, T, N] table rows
        """World rows of the root and every node (target), and of each node's parent (draft)."""
        v = world.vocab
        ids = [torch.zeros(len(trees), dtype=torch.long)]  # path id of the root, then each node
        for i, par in enumerate(self.parents):
            ids.append(ids[par + 1] * v + trees[:, i])
        depth = torch.cat([torch.zeros(1, dtype=torch.long), self._depth])  # [N+1]
        path = torch.stack(ids, 1)  # [T, N+1]
        starts = torch.tensor([offset(v, length + int(k)) for k in depth])  # [N+1]
        rows = starts + ctx[:, None, None] * v**depth + path[None]  # [C, T, N+1]
        par_rows = rows[..., torch.tensor(self.parents) + 1]  # [C, T, N]
        return rows, par_rows

    def draw(self, world: World, lengths: torch.Tensor, ids: torch.Tensor,
             generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw a tree after each context (lengths [B], ids [B]) and verify it, batched:
        tokens [B, N+1] -1 padded, num_accepted [B]."""
        v, n, bsz = world.vocab, self.num_nodes, len(ids)
        u = uniforms(generator, bsz, n, DOMAIN_DRAFT)  # [B, N]
        node_ids, node_len, tokens, par_rows = [], [], [], []
        root = world.row(lengths, ids)
        for i, par in enumerate(self.parents):
            pid, plen = (ids, lengths) if par < 0 else (node_ids[par], node_len[par])
            prow = root if par < 0 else world.row(plen, pid)
            q = world.draft[prow]  # [B, V]
            earlier = [j for j in range(i) if self.parents[j] == par]
            if self.drawn == "deterministic":
                ranked = torch.sort(q, dim=-1, descending=True, stable=True).indices
                x = ranked[:, len(earlier)]
            else:
                if self.drawn == "without_replacement" and earlier:
                    q = q.scatter(1, torch.stack([tokens[j] for j in earlier], 1), 0.0)
                x = sample_from_weights(q, u[:, i])
            tokens.append(x)
            par_rows.append(prow)
            node_ids.append(pid * v + x)
            node_len.append(plen + 1)
        tok = torch.stack(tokens, 1)  # [B, N]
        target_rows = torch.stack([root] + [world.row(node_len[i], node_ids[i])
                                            for i in range(n)], 1)  # [B, N+1]
        prows = torch.stack(par_rows, 1)  # [B, N]
        claimed = None if world.claimed is None else world.claimed[prows]
        verdict = self.law(world.target[target_rows], self.make_tree(tok, claimed)).draw(generator)
        return verdict.tokens, verdict.num_accepted


# wrong: after a rejected sibling the next one is compared against max(P - q, 0) itself
UNNORMALISED = SiblingRule("residual not renormalised", token_step, False, carry=lambda res: res)


@dataclass
class TreePitfall:
    """A deliberately wrong tree sampler on the world where it is run."""

    name: str  # short label
    why: str  # one line: what is wrong
    world: World  # the world it runs on
    scheme: TreeScheme  # the sampler


def tree_pitfalls(vocab: int, depth: int, branching: tuple[int, ...] = (2, 2),
                  seed: int = 0) -> list[TreePitfall]:
    """The tree pitfalls, each on a random world (q > 0 everywhere) with `branching`."""
    world = random_world(vocab, depth, seed + 201)
    par = tuple(branching_parents(branching))
    return [
        TreePitfall("w/o replacement as iid", "siblings drawn without replacement, verify told "
                    "they were i.i.d. (q not conditioned on the earlier siblings)", world,
                    TreeScheme("token", par, "without_replacement", claimed="iid",
                               label="w/o replacement as iid")),
        TreePitfall("residual not renormalised", "after a rejected sibling the next one is "
                    "compared against max(P - q, 0) unnormalised", world,
                    TreeScheme("token", par, "iid", rule=UNNORMALISED,
                               label="residual not renormalised")),
        TreePitfall("q from the parent's slot", "each node handed the q its parent was drawn "
                    "from (one position too early)", world,
                    TreeScheme("token", par, "iid", q_from_parent=True,
                               label="q from the parent's slot")),
        TreePitfall("top-k verified as sampled", "deterministic top-k children verified with "
                    "q as if they had been sampled from it", world,
                    TreeScheme("token", par, "deterministic", claimed="iid",
                               label="top-k verified as sampled")),
    ]


def tree_schemes(branching: tuple[int, ...] = (2, 2)) -> list[TreeScheme]:
    """Every correct (method, sibling kind) pair on the full tree with `branching`."""
    par = tuple(branching_parents(branching))
    return [TreeScheme(method, par, kind) for method in ("token", "traversal")
            for kind in SIBLING_KINDS]
