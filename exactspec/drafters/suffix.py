"""Suffix decoding (Oliaro et al. 2024, arXiv 2411.04975): point-mass drafts from suffix tries.

Two tries of bounded depth D count every substring of up to D tokens:
- a local trie per row, over its prompt and its output so far (grown as tokens are emitted);
- a global trie over earlier outputs (each with the last prompt tokens before it), shared by
  every `generate` call and every server request that uses the same `SuffixDrafter`, bounded
  in memory: whole outputs are evicted oldest first until the trie holds at most `max_nodes`.
The longest suffix of the context (up to D - 1 tokens) that occurred before with a
continuation is looked up in each trie; from there the most frequent child is followed while
the product of the empirical next-token frequencies stays >= `min_prob`, and for at most
`spec_factor * match length` tokens (a short match is weak evidence, so it drafts little).
Of the two candidates, the one with the larger score (sum of the path's products: the expected
number of accepted tokens if the frequencies were the target's) is proposed. q is a point mass,
so `propose` returns None for draft_probs and the output is exact whatever is proposed.
Tree mode (`branches` > 1): instead of one chain, the `tree_nodes` most probable continuations
(path probability = the product of the frequencies, best first, at most `branches` children
per node, at most `depth` deep, each >= min_prob) as a trie of point masses, verified as a token
tree (exact by the point-mass rule: a child is accepted with the residual's mass at it, which
then loses it). Its score is again the sum of the nodes' path probabilities.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from exactspec.drafters.base import DraftContext, TargetInfo
from exactspec.drafters.tree_shape import Branching
from exactspec.errors import InvalidValue
from exactspec.sampling import DraftTree


class _Node:
    """One substring: how often it occurred and the tokens that followed it."""

    __slots__ = ("children", "count", "last")

    def __init__(self) -> None:
        self.count = 0  # occurrences of the substring this node spells
        self.last = 0  # the trie's clock when it last occurred (ties go to the latest)
        self.children: dict[int, _Node] = {}  # next token -> node of the longer substring


class SuffixTrie:
    """Counts of every substring of length <= `max_depth` of the sequences added to it."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth  # longest substring counted
        self.root = _Node()
        self.nodes = 0  # nodes below the root: the memory this trie holds
        self.clock = 0  # tokens added so far: orders occurrences by recency

    def _walk(self, seq: Sequence[int], delta: int) -> None:
        d = self.max_depth
        for i in range(len(seq)):
            node = self.root
            self.clock += delta > 0
            for t in seq[i:i + d]:
                child = node.children.get(t)
                if child is None:
                    assert delta > 0, "removing a sequence that was never added"
                    child = node.children[t] = _Node()
                    self.nodes += 1
                child.count += delta
                child.last = max(child.last, self.clock) if delta > 0 else child.last
                if child.count == 0:  # nothing below a dead node is alive either
                    del node.children[t]
                    self.nodes -= 1 + _size(child)
                    break
                node = child

    def add(self, seq: Sequence[int]) -> None:
        """Count every substring of `seq` of up to max_depth tokens."""
        self._walk(seq, +1)

    def remove(self, seq: Sequence[int]) -> None:
        """Undo `add(seq)`; nodes left with a zero count are freed."""
        self._walk(seq, -1)

    def grow(self, active: list[_Node], token: int) -> list[_Node]:
        """Append one token to a sequence being added incrementally.

        `active` holds the nodes of the sequence's current suffixes of length 1..D-1 (shortest
        first); returns the new list. Equivalent to `add` of the whole sequence at the end.
        """
        new = []
        self.clock += 1
        for node in (self.root, *active):
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
                self.nodes += 1
            child.count += 1
            child.last = self.clock
            new.append(child)
        return new[: self.max_depth - 1]

    def match(self, seq: Sequence[int]) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `seq` (at most D - 1 tokens) with a continuation.

        Both "occurs" and "occurs followed by a token" only get rarer as the suffix grows, so
        the search stops at the first length that fails.
        """
        best, length = None, 0
        for m in range(1, min(len(seq), self.max_depth - 1) + 1):
            node = self.root
            for t in seq[len(seq) - m:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is None or not node.children:
                break
            best, length = node, m
        return best, length

    def continuation(self, seq: list[int], limit: int, min_prob: float,
                     spec_factor: float) -> tuple[list[int], float]:
        """The most frequent continuation of `seq`'s longest matching suffix, and its score."""
        node, m = self.match(seq)
        if node is None:
            return [], 0.0
        limit = min(limit, max(1, int(spec_factor * m)))
        out: list[int] = []
        prob, score, depth = 1.0, 0.0, m
        while len(out) < limit:
            if not node.children or depth >= self.max_depth:  # the trie ends: look up again
                node, depth = self.match((seq + out)[-(self.max_depth - 1):])
                if node is None:
                    break
            total = sum(c.count for c in node.children.values())
            token, child = max(node.children.items(), key=lambda kv: (kv[1].count, kv[1].last))
            prob *= child.count / total
            if prob < min_prob:
                break
            out.append(token)
            score += prob
            node, depth = child, depth + 1
        return out, score

    def tree(self, seq: list[int], depth: int, budget: int, branches: int, min_prob: float,
             spec_factor: float) -> tuple[list[int], list[int], float]:
        """The `budget` most probable continuation nodes of `seq`'s longest matching suffix,
        best first (so a parent precedes its children): tokens, parent indices (-1 = root),
        and the score (sum of the nodes' path probabilities)."""
        node, m = self.match(seq)
        if node is None or depth <= 0:
            return [], [], 0.0
        depth = min(depth, max(1, int(spec_factor * m)))
        tokens: list[int] = []
        parents: list[int] = []
        score, tie = 0.0, itertools.count()
        heap: list[tuple] = []  # (-path probability, tie, token, trie node, trie depth, parent, path)

        def push(at: _Node, d: int, parent: int, path: list[int], prob: float) -> None:
            if not at.children or d >= self.max_depth:  # the trie ends: look up again
                found, d = self.match((seq + path)[-(self.max_depth - 1):])
                if found is None:
                    return
                at = found
            total = sum(c.count for c in at.children.values())
            top = sorted(at.children.items(), key=lambda kv: (-kv[1].count, -kv[1].last))[:branches]
            for token, child in top:
                if prob * child.count / total >= min_prob:
                    heapq.heappush(heap, (-prob * child.count / total, next(tie), token, child,
                                          d + 1, parent, path))

        push(node, m, -1, [], 1.0)
        while heap and len(tokens) < budget:
            neg, _, token, child, d, parent, path = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent)
            score -= neg
            if len(path) + 1 < depth:
                push(child, d, len(tokens) - 1, [*path, token], -neg)
        return tokens, parents, score


def _size(node: _Node) -> int:
    """Nodes strictly below `node`."""
    stack, n = list(node.children.values()), 0
    while stack:
        cur = stack.pop()
        n += 1
        stack.extend(cur.children.values())
    return n


class _Row:
    """One row's local trie and what of its context it has seen."""

    __slots__ = ("active", "prompt_length", "tokens", "trie")

    def __init__(self, max_depth: int, prompt_length: int) -> None:
        self.trie = SuffixTrie(max_depth)  # substrings of the row's prompt and output so far
        self.active: list[_Node] = []  # nodes of the row's current suffixes, shortest first
        self.tokens: list[int] = []  # the row's context as far as it was added to the trie
        self.prompt_length = prompt_length  # leading tokens of `tokens` that are prompt

    def extend(self, new: list[int]) -> None:
        for t in new:
            self.active = self.trie.grow(self.active, t)
        self.tokens += new


class SuffixDrafter:
    """Point-mass drafts from suffix tries over the row's context and earlier outputs.

    max_depth: longest substring counted (memory per token grows with it). max_nodes: bound of
    the global trie of earlier outputs (oldest outputs evicted first; 0 turns it off).
    min_prob: stop drafting when the continuation's estimated probability falls below this.
    spec_factor: draft at most spec_factor * (length of the matched suffix) tokens (4; 1
    drafted too few on the bench's grounded workloads: docs/performance.md).
    branches: > 1 drafts token trees, at most this many children per node, at most
    `tree_nodes` nodes and `depth` deep (the engine then runs tree steps; num_draft_tokens
    does not apply). One instance can serve many calls (its global trie is shared and thread-safe).
    """

    standardized_q = True  # point masses, not re-checked (base.trusts_q)
    siblings = "deterministic"  # tree nodes are point masses (copied continuations)

    hidden_layers = None  # reads no target features

    def __init__(self, max_depth: int = 24, max_nodes: int = 1 << 19, min_prob: float = 0.1,
                 spec_factor: float = 4.0, branches: int = 1, depth: int = 6,
                 tree_nodes: int = 8) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 2:
            raise InvalidValue(f"max_depth={max_depth!r} must be an int >= 2 (e.g. 24)")
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 0:
            raise InvalidValue(f"max_nodes={max_nodes!r} must be an int >= 0 (0 = no cache of "
                               "earlier outputs)")
        if not isinstance(min_prob, int | float) or not 0 <= min_prob <= 1:
            raise InvalidValue(f"min_prob={min_prob!r} must be a number in [0, 1] (e.g. 0.1)")
        if not isinstance(spec_factor, int | float) or not spec_factor > 0:
            raise InvalidValue(f"spec_factor={spec_factor!r} must be a number > 0 (e.g. 4.0)")
        for name, v in (("branches", branches), ("depth", depth), ("tree_nodes", tree_nodes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidValue(f"{name}={v!r} must be an int >= 1")
        self.branches = branches  # children per tree node at most (1: chains)
        self.depth = depth  # tree depth at most (tree mode)
        self.tree_nodes = tree_nodes  # nodes per tree at most: the verify width is this + 1
        # not None: the engine runs tree steps (the widest shape; the trees are often smaller)
        self.tree = Branching((branches,) + (1,) * (depth - 1)) if branches > 1 else None
        self.max_depth = max_depth  # longest substring counted by every trie
        self.max_nodes = max_nodes  # memory bound of the global trie, in nodes
        self.min_prob = float(min_prob)  # continuation probability below which drafting stops
        self.spec_factor = float(spec_factor)  # draft length per matched token
        self.cache = SuffixTrie(max_depth)  # earlier outputs, shared across calls
        self._cached: OrderedDict[int, list[int]] = OrderedDict()  # oldest first
        self._next_id = 0
        self._lock = threading.Lock()
        self._rows: list[_Row] = []  # per row of the batch being drafted for

    def __repr__(self) -> str:
        return (f"SuffixDrafter(max_depth={self.max_depth}, max_nodes={self.max_nodes}, "
                f"min_prob={self.min_prob}, spec_factor={self.spec_factor}"
                + (f", branches={self.branches}, depth={self.depth}, "
                   f"tree_nodes={self.tree_nodes})" if self.tree else ")"))

    def remember(self, tokens: Sequence[int]) -> None:
        """Add one earlier output (with the prompt tokens just before it) to the global trie."""
        seq = list(tokens)
        if self.max_nodes == 0 or not seq:
            return
        # a sequence adds at most len * max_depth nodes: keep only a tail that fits
        seq = seq[-max(1, self.max_nodes // self.max_depth):]
        with self._lock:
            self.cache.add(seq)
            self._cached[self._next_id] = seq
            self._next_id += 1
            while self.cache.nodes > self.max_nodes:
                _, old = self._cached.popitem(last=False)
                self.cache.remove(old)

    def _finish(self, row: _Row) -> None:
        start = max(0, row.prompt_length - (self.max_depth - 1))
        if len(row.tokens) > row.prompt_length:
            self.remember(row.tokens[start:])

    def begin(self, context: DraftContext, target: TargetInfo) -> None:
        """A new batch, or the same batch with rows appended: a row whose context continues
        what this drafter saw of the row at that index keeps its trie; every other earlier row
        has ended and joins the cache of earlier outputs."""
        new: list[_Row] = []
        kept: set[int] = set()
        lengths = context.lengths.tolist()
        for i, n in enumerate(context.prompt_lengths.tolist()):
            old = self._rows[i] if i < len(self._rows) else None
            if (old is not None and old.prompt_length == n and len(old.tokens) <= lengths[i]
                    and context.tokens[i, : len(old.tokens)].tolist() == old.tokens):
                new.append(old)
                kept.add(i)
            else:
                new.append(_Row(self.max_depth, int(n)))
        for i, row in enumerate(self._rows):  # rows that ended (a batch's last rows end here)
            if i not in kept:
                self._finish(row)
        self._rows = new

    def admit(self, context: DraftContext, target: TargetInfo, start: int) -> None:
        """Rows start.. are new: each gets an empty trie (filled at its next propose); the
        running rows keep theirs."""
        assert len(self._rows) == start, "begin() first, and select() when rows leave"
        self._rows += [_Row(self.max_depth, int(n))
                       for n in context.prompt_lengths[start:].tolist()]

    def select(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        for j in sorted(set(range(len(self._rows))) - set(keep)):
            self._finish(self._rows[j])
        self._rows = [self._rows[j] for j in keep]

    def _catch_up(self, context: DraftContext) -> list[list[int]]:
        """Each row's trie takes the tokens emitted since; returns each row's recent context."""
        assert len(self._rows) == context.tokens.shape[0], "begin() first, and select() when " \
            "rows leave"
        for i, (row, n) in enumerate(zip(self._rows, context.lengths.tolist(), strict=True)):
            if n > len(row.tokens):
                row.extend(context.tokens[i, len(row.tokens):n].tolist())
        return [row.tokens[-(self.max_depth - 1):] for row in self._rows]

    def propose_tree(self, context: DraftContext, max_depth: torch.Tensor  # [B]
                     ) -> DraftTree:  # [B, tree_nodes] point-mass nodes, -1 = unused
        """Per row the more promising of the local and the global trie's trees."""
        b, n = context.tokens.shape[0], self.tree_nodes
        tokens = torch.full((b, n), -1, dtype=torch.long)
        parents = torch.full((b, n), -1, dtype=torch.long)
        for i, (recent, cap) in enumerate(zip(self._catch_up(context), max_depth.tolist(),
                                              strict=True)):
            args = (min(self.depth, cap), n, self.branches, self.min_prob, self.spec_factor)
            best = self._rows[i].trie.tree(recent, *args)
            if self.max_nodes:
                with self._lock:
                    other = self.cache.tree(recent, *args)
                if other[2] > best[2]:
                    best = other
            if best[0]:
                tokens[i, : len(best[0])] = torch.tensor(best[0], dtype=torch.long)
                parents[i, : len(best[1])] = torch.tensor(best[1], dtype=torch.long)
        dev = context.tokens.device
        return DraftTree(tokens.to(dev), parents.to(dev), None, "deterministic")

    def propose(
        self, context: DraftContext, num_tokens: torch.Tensor  # [B]
    ) -> tuple[torch.Tensor, None]:  # [B, K] -1 padded, None (point mass)
        b = context.tokens.shape[0]
        k = int(num_tokens.max()) if b else 0
        drafts = torch.full((b, k), -1, dtype=torch.long)
        want = num_tokens.tolist()
        for i, recent in enumerate(self._catch_up(context)):
            if want[i] <= 0:
                continue
            best, best_score = self._rows[i].trie.continuation(
                recent, want[i], self.min_prob, self.spec_factor)
            if self.max_nodes:
                with self._lock:
                    other, score = self.cache.continuation(recent, want[i], self.min_prob,
                                                           self.spec_factor)
                if score > best_score:
                    best = other
            if best:
                drafts[i, : len(best)] = torch.tensor(best, dtype=torch.long)
        return drafts.to(context.tokens.device), None
