"""Tree attention: one forward over a token tree gives, at every node, the logits of the plain
forward of prefix + that node's path; after `commit_path` the cache continues like a chain."""

from __future__ import annotations

import pytest
import torch

from exactspec.models.adapter import TargetAdapter
from exactspec.models.tree_attention import commit_path, extend_tree, path_index
from exactspec.sampling import DraftTree, branching_parents
from tests.models.test_adapter import _full, _gemma3, _llama
from tests.threads import one_thread as _one_thread  # noqa: F401 (autouse fixture)


def _paths(tree: DraftTree, b: int) -> list[list[int]]:
    """Tokens on the path to each node of row b."""
    out = []
    for i in range(tree.num_nodes):
        path, j = [], i
        while j >= 0:
            path.append(int(tree.tokens[b, j]))
            j = int(tree.parents[b, j])
        out.append(path[::-1])
    return out


@pytest.mark.parametrize(("make", "attn", "lean"), [
    (_llama, "sdpa", True), (_llama, "eager", False), (_gemma3, "sdpa", False),
])
def test_tree_forward_and_path_commit_match_plain_forwards(make, attn, lean):
    model = make(attn)
    ad = TargetAdapter(model, lean=lean)
    assert (ad.lean is not None) == lean
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 3, 3]]  # ragged committed lengths
    ad.prefill([s[:-1] for s in seqs])
    g = torch.Generator().manual_seed(0)
    parents = torch.tensor(branching_parents((2, 2, 1))).expand(3, -1).clone()  # 10 nodes
    for step in range(3):
        tokens = torch.randint(0, 40, parents.shape, generator=g)
        tokens[1, 7:] = -1  # a ragged row: fewer nodes
        tree = DraftTree(tokens, parents, None, "deterministic")
        root = torch.tensor([s[-1] for s in seqs])
        logits = extend_tree(ad, root, tree)  # [B, N+1, V]
        for b, s in enumerate(seqs):
            torch.testing.assert_close(logits[b, 0], _full(model, s)[-1], atol=1e-5, rtol=1e-5)
            for i, path in enumerate(_paths(tree, b)):
                if tokens[b, i] < 0:
                    continue
                torch.testing.assert_close(logits[b, i + 1], _full(model, s + path)[-1],
                                           atol=1e-5, rtol=1e-5)
        # accept a random root path per row (possibly empty), then one more token
        path = torch.full(parents.shape, -1)
        for b in range(3):
            node, chosen = int(torch.randint(-1, 10, (1,), generator=g)), []
            while node >= 0 and tokens[b, node] >= 0:
                chosen.append(node)
                node = int(parents[b, node])
            path[b, :len(chosen)] = torch.tensor(chosen[::-1], dtype=torch.long)
        idx = path_index(path)  # the root and the path in the tree forward's outputs
        assert (idx[:, 0] == 0).all()
        commit_path(ad, path)
        for b in range(3):
            seqs[b] = seqs[b] + [int(tokens[b, i]) for i in path[b] if i >= 0] + [20 + step]
    assert ad.lengths.tolist() == [len(s) - 1 for s in seqs]
    feed = torch.tensor([[s[-1]] for s in seqs])
    out = ad.extend(feed)  # a plain step on the compacted cache
    for b, s in enumerate(seqs):
        torch.testing.assert_close(out[b, 0], _full(model, s)[-1], atol=1e-5, rtol=1e-5)
