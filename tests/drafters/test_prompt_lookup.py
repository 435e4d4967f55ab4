"""PromptLookup: latest earlier match of the longest suffix n-gram, copied as point-mass drafts."""

from __future__ import annotations

import pytest
import torch

from exactspec import SamplingParams
from exactspec.drafters import DraftContext, PromptLookup
from exactspec.sampling import RowStreams


def _context(rows: list[list[int]]) -> DraftContext:
    width = max(map(len, rows)) + 2
    tokens = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    return DraftContext(tokens, lengths, lengths.clone(), SamplingParams(),
                        RowStreams.from_seed(0, len(rows)))


def _reference(row: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(hi, lo - 1, -1):
        if len(row) < n + 1:
            continue
        suffix = row[-n:]
        for start in range(len(row) - n - 1, -1, -1):  # latest earlier match first
            if row[start : start + n] == suffix:
                return row[start + n : start + n + k]
    return []


def _propose(rows, k, lo=1, hi=3):
    drafts, q = PromptLookup(lo, hi).propose(_context(rows), torch.full((len(rows),), k))
    assert q is None  # point mass
    return [[t for t in r if t >= 0] for r in drafts.tolist()], drafts


def test_examples():
    got, drafts = _propose([[1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], [4, 5, 6], [7, 8, 7]], 3)
    # row 0: "1 2 3" last seen before at 4, followed by 7 5 1
    assert got == [[7, 5, 1], [], [8, 7]]
    assert drafts.shape == (3, 3) and drafts[1].tolist() == [-1, -1, -1]


def test_longest_ngram_wins_over_a_later_shorter_match():
    # suffix "2 3": the 2-gram matches at 1 (followed by 8); the 1-gram "3" matches later (at 5)
    got, _ = _propose([[1, 2, 3, 8, 0, 3, 4, 2, 3]], 2)
    assert got == [[8, 0]]


def test_draft_stops_at_the_end_of_the_context_and_respects_num_tokens():
    ctx = _context([[5, 6, 5], [1, 1, 1, 1]])
    drafts, _ = PromptLookup().propose(ctx, torch.tensor([4, 1]))
    assert drafts.tolist() == [[6, 5, -1, -1], [1, -1, -1, -1]]


@pytest.mark.parametrize("seed", range(20))
def test_matches_a_plain_python_reference(seed):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 4, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 30, (6,), generator=g)]
    for lo, hi in ((1, 3), (2, 2), (1, 1), (2, 4)):
        got, _ = _propose(rows, 5, lo, hi)
        assert got == [_reference(r, 5, lo, hi) for r in rows]


@pytest.mark.parametrize("args", [(0, 3), (3, 2), (1.5, 3), (True, 2)])
def test_bad_ngram_sizes(args):
    with pytest.raises(ValueError):
        PromptLookup(*args)
