"""SuffixDrafter: exact tries (against brute-force substring counts), the bounded shared cache,
greedy == plain bit for bit, and the sequence-level chi-square through `generate` (1e-6)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from exactspec import SamplingParams
from exactspec.audit import chi_square, target_law
from exactspec.audit.pitfalls import ResidualFromTarget, wrong_verify
from exactspec.audit.samplers import sequence_ids
from exactspec.audit.stats import bincount
from exactspec.audit.world import logits_table, model_world
from exactspec.drafters import DraftContext, SuffixDrafter
from exactspec.drafters.suffix import SuffixTrie, _size
from exactspec.engine import generate
from exactspec.errors import InvalidValue
from exactspec.sampling import DraftTree, RowStreams
from tests.audit.test_engine_lossless import FILTERED, PROMPT, V, tiny_llama
from tests.engine.test_lossless_greedy import GREEDY, PROMPTS
from tests.engine.tiny import tiny_llama as tiny_char_llama


def _substrings(seqs, depth) -> Counter:
    c: Counter = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                c[tuple(s[i:j])] += 1
    return c


def _trie_counts(trie: SuffixTrie) -> Counter:
    out: Counter = Counter()
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for t, child in node.children.items():
            out[(*path, t)] = child.count
            stack.append(((*path, t), child))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_trie_counts_every_substring_and_removal_undoes_it(seed):
    rng = random.Random(seed)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(8)]
    trie = SuffixTrie(5)
    for s in seqs:
        trie.add(s)
    assert _trie_counts(trie) == _substrings(seqs, 5)
    assert trie.nodes == _size(trie.root) == len(_substrings(seqs, 5))
    for s in seqs[:5]:
        trie.remove(s)
    assert _trie_counts(trie) == _substrings(seqs[5:], 5)
    assert trie.nodes == _size(trie.root)
    grown, active = SuffixTrie(5), []
    for t in seqs[0]:
        active = grown.grow(active, t)
    assert _trie_counts(grown) == _substrings(seqs[:1], 5)


def test_continuation_is_the_most_frequent_and_adapts_to_the_match():
    trie = SuffixTrie(8)
    for s in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [9, 2, 3, 7, 7]):
        trie.add(s)
    # "2 3" is followed by 4 twice and by 7 once: 4 (2/3), then 5 (1): probabilities 2/3, 2/3
    assert trie.continuation([0, 2, 3], 5, 0.0, 10.0) == ([4, 5], pytest.approx(4 / 3))
    assert trie.continuation([0, 2, 3], 5, 0.0, 1.0)[0] == [4, 5]  # match length 2: 2 tokens
    assert trie.continuation([0, 0, 3], 5, 0.0, 1.0)[0] == [4]  # match length 1: 1 token
    assert trie.continuation([0, 2, 3], 5, 0.7, 10.0) == ([], 0.0)  # 2/3 < min_prob
    assert trie.continuation([6], 5, 0.0, 10.0) == ([], 0.0)  # never seen


def _context(rows):
    width = max(map(len, rows)) + 4
    tokens = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    return DraftContext(tokens, lengths, lengths.clone(), SamplingParams(),
                        RowStreams.from_seed(0, len(rows)))


def test_propose_reads_the_rows_own_context_and_is_ragged():
    d = SuffixDrafter(max_depth=6, spec_factor=4.0)
    ctx = _context([[1, 2, 3, 4, 1, 2], [5, 6, 7], [8, 9, 8, 9, 8]])
    d.begin(ctx, None)
    drafts, q = d.propose(ctx, torch.tensor([3, 3, 1]))
    assert q is None
    assert drafts.tolist() == [[3, 4, 1], [-1, -1, -1], [9, -1, -1]]


def test_begin_with_rows_appended_keeps_the_running_rows():
    d = SuffixDrafter(max_depth=4)
    first = _context([[1, 2, 3, 1, 2]])
    d.begin(first, None)
    d.propose(first, torch.tensor([2]))
    grown = _context([[1, 2, 3, 1, 2, 3, 9], [7, 7]])  # row 0 went on, row 1 was admitted
    grown.prompt_lengths = torch.tensor([5, 2])
    d.begin(grown, None)
    assert d.cache.nodes == 0  # nothing ended yet
    d.propose(grown, torch.tensor([1, 1]))
    assert d._rows[0].tokens == [1, 2, 3, 1, 2, 3, 9]
    d.begin(_context([[5]]), None)  # a new batch: both rows ended; row 0's output is
    # remembered after the last max_depth - 1 tokens of its prompt, row 1 had no output
    assert list(d._cached.values()) == [[3, 1, 2, 3, 9]]


def test_the_cache_is_bounded_and_evicts_the_oldest():
    d = SuffixDrafter(max_depth=4, max_nodes=60)
    rng = random.Random(0)
    seqs = [[rng.randrange(100) for _ in range(10)] for _ in range(30)]
    for s in seqs:
        d.remember(s)
        assert d.cache.nodes <= 60
        assert d.cache.nodes == _size(d.cache.root)
    kept = list(d._cached.values())
    assert kept == seqs[-len(kept):] and 1 <= len(kept) < 30  # a suffix of the history
    assert _trie_counts(d.cache) == _substrings(kept, 4)
    with pytest.raises(InvalidValue, match="max_nodes"):
        SuffixDrafter(max_nodes=-1)


def test_greedy_equals_plain_and_the_cache_serves_a_repeated_request():
    target = tiny_char_llama(0)
    plain = [g.token_ids for g in generate(target, PROMPTS, params=GREEDY, max_new_tokens=40)]
    steps = {}
    for nodes in (0, 1 << 16):  # without and with the cache of earlier outputs
        drafter = SuffixDrafter(max_nodes=nodes)
        for call in ("first", "again"):
            out = generate(target, PROMPTS, drafter=drafter, params=GREEDY, max_new_tokens=40)
            assert [g.token_ids for g in out] == plain
            steps[nodes, call] = sum(g.stats.steps for g in out)
    # without a cache a repeated greedy request repeats itself; with it, the earlier outputs
    # are drafted from and the same text takes far fewer target steps
    assert steps[0, "again"] == steps[0, "first"] == steps[1 << 16, "first"]
    assert steps[1 << 16, "again"] < 0.6 * steps[0, "again"]


N, K, ROWS = 3, 2, 6000  # tokens compared (512 outcomes), drafts per step, rows per call


@pytest.fixture(scope="module")
def world_and_target():
    target = tiny_llama(0)
    logits = logits_table(lambda ids: target(ids).logits, PROMPT, V, N + K)
    return model_world(logits, logits, V, N + K, FILTERED, PROMPT), target


def _counts(target, drafter, verify, seed, rows=ROWS):
    """Counts of the first N tokens of `rows` generations after a warm-up batch (the cache of
    earlier outputs), and the drafts accepted; a tree drafter ignores num_draft_tokens."""
    kw = dict(drafter=drafter, max_new_tokens=N + K, num_draft_tokens=K, verify=verify,
              batch_size=rows)
    generate(target, [PROMPT] * 200, params=replace(FILTERED, seed=seed + 100), **kw)  # warm
    gens = generate(target, [PROMPT] * rows, params=replace(FILTERED, seed=seed), **kw)
    seqs = torch.tensor([g.token_ids[:N] for g in gens])  # [ROWS, N]
    return bincount(sequence_ids(seqs, V), V**N), sum(g.stats.accepted for g in gens)


def test_generate_with_suffix_drafts_matches_the_target(world_and_target):
    """Chi-square at false-alarm rate 1e-6 of the first N tokens against the exact target law."""
    world, target = world_and_target
    counts, accepted = _counts(target, SuffixDrafter(max_depth=8), "token", seed=3)
    assert accepted > ROWS // 2  # the cache of earlier outputs was really drafted from
    result = chi_square(counts, target_law(world, N))
    assert result.dof > 30 and not result.rejected, result


def test_a_wrong_point_mass_residual_is_caught(world_and_target):
    """The same test on a verifier that resamples from p after a rejection (x not removed);
    2,000 rows suffice (statistic ~890 against a threshold of ~285 when this was written)."""
    world, target = world_and_target
    counts, _ = _counts(target, SuffixDrafter(max_depth=8), wrong_verify(ResidualFromTarget),
                        seed=4, rows=2000)
    assert chi_square(counts, target_law(world, N)).rejected


# Tree mode: several continuations as a trie of point masses.


def test_tree_holds_the_most_probable_continuations_best_first():
    trie = SuffixTrie(8)
    for s in ([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4], [1, 2, 6, 7]):
        trie.add(s)
    # after "1 2": 3 (3 of 4), then 4 (2/3 of that) or 5 (1/3), or 6 (1 of 4), then 7
    tokens, parents, score = trie.tree([1, 2], depth=3, budget=4, branches=2, min_prob=0.1,
                                       spec_factor=4.0)
    assert tokens == [3, 4, 6, 5] and parents == [-1, 0, -1, 0]
    assert score == pytest.approx(3 / 4 + 1 / 2 + 1 / 4 + 1 / 4)
    assert trie.tree([1, 2], depth=3, budget=4, branches=1, min_prob=0.1,
                     spec_factor=4.0)[0] == [3, 4]  # one child per node: a chain
    assert trie.tree([1, 2], depth=3, budget=9, branches=2, min_prob=0.3,
                     spec_factor=4.0)[0] == [3, 4]  # 5 and 6 (1/4 each) fall below min_prob
    assert trie.tree([9], depth=3, budget=4, branches=2, min_prob=0.1,
                     spec_factor=4.0) == ([], [], 0.0)  # no match


def test_tree_mode_greedy_equals_plain_and_the_tree_is_bounded():
    target = tiny_char_llama(0)
    plain = [g.token_ids for g in generate(target, PROMPTS, params=GREEDY, max_new_tokens=40)]
    drafter = SuffixDrafter(branches=3, depth=4, tree_nodes=6)
    sizes = []
    original = drafter.propose_tree

    def recording(context, max_depth):
        tree = original(context, max_depth)
        sizes.append((int(tree.shape.valid.sum(1).max()), int(tree.shape.depth.max())))
        return tree

    drafter.propose_tree = recording
    for _ in ("first", "again"):  # the second call drafts from the cache of earlier outputs
        out = generate(target, PROMPTS, drafter=drafter, params=GREEDY, max_new_tokens=40)
        assert [g.token_ids for g in out] == plain
    assert max(n for n, _ in sizes) <= 6 and max(d for _, d in sizes) <= 4
    assert max(n for n, _ in sizes) > 1 and sum(g.stats.accepted for g in out) > 0


class SmoothedPointMass(SuffixDrafter):
    """Wrong: proposes the trie's nodes deterministically but reports q = 1/2 on the node and
    1/2 spread over the vocabulary, as if the node had been drawn from it."""

    def propose_tree(self, context, max_depth):
        tree = super().propose_tree(context, max_depth)
        q = torch.full((*tree.tokens.shape, V), 0.5 / V)
        q.scatter_add_(2, tree.tokens.clamp(min=0)[..., None], torch.full((*tree.tokens.shape,
                                                                            1), 0.5))
        return DraftTree(tree.tokens, tree.parents, q, "without_replacement")


def test_suffix_trees_through_generate_match_the_target(world_and_target):
    world, target = world_and_target
    drafter = SuffixDrafter(max_depth=8, branches=3, depth=3, tree_nodes=5)
    counts, accepted = _counts(target, drafter, "token", seed=7)
    assert accepted > ROWS // 2  # the trees of earlier outputs were really drafted from
    result = chi_square(counts, target_law(world, N))
    assert result.dof > 30 and not result.rejected, result


def test_a_tree_that_claims_a_smoothed_q_is_caught(world_and_target):
    world, target = world_and_target
    wrong = SmoothedPointMass(max_depth=8, branches=3, depth=3, tree_nodes=5)
    counts, _ = _counts(target, wrong, "token", seed=8, rows=2000)
    assert chi_square(counts, target_law(world, N)).rejected


def test_equally_frequent_continuations_go_to_the_latest():
    """'1 2' was followed by 3, then by 4: the draft continues with 4 (the latest), whether
    the trie was built at once (add) or token by token (grow, as a row's own trie is)."""
    seq = [1, 2, 3, 7, 1, 2, 4]
    whole = SuffixTrie(8)
    whole.add(seq)
    grown = SuffixTrie(8)
    active: list = []
    for t in seq:
        active = grown.grow(active, t)
    for trie in (whole, grown):
        out, _ = trie.continuation([5, 1, 2], 1, 0.1, 4.0)
        assert out == [4]
        tokens, _, _ = trie.tree([5, 1, 2], 1, 2, 2, 0.1, 4.0)
        assert tokens == [4, 3]
