"""DraftModel: q is exactly probs_from_logits of the draft's full forward, with the same history."""

from __future__ import annotations

import pytest
import torch

from exactspec import SamplingParams, probs_from_logits
from exactspec.drafters import DraftContext, DraftModel, TargetInfo
from exactspec.sampling import RowStreams
from tests.engine.tiny import VOCAB, tiny_llama


def _context(rows, params, prompt_lengths=None, width=64) -> DraftContext:
    tokens = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    plen = lengths.clone() if prompt_lengths is None else torch.tensor(prompt_lengths)
    return DraftContext(tokens, lengths, plen, params, RowStreams.from_seed(3, len(rows)))


def _expected_q(model, row, drafts, params, prompt_len):
    ids = row + drafts
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(row) - 1 : len(ids) - 1]  # [K, V]
    k = len(drafts)
    hist = torch.full((k, len(ids)), -1, dtype=torch.long)
    for j in range(k):
        hist[j, : len(row) + j] = torch.tensor(ids[: len(row) + j])
    return probs_from_logits(logits, params, hist, prompt_len)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, top_k=10),
])
def test_q_is_the_standardized_distribution_the_draft_sampled_from(params):
    model = tiny_llama(2)
    drafter = DraftModel(model)
    rows = [[1, 2, 3, 4, 1, 2], [7], [5, 5, 9]]
    prompt_lengths = [3, 1, 2]
    drafter.begin(_context(rows, params, prompt_lengths), TargetInfo(VOCAB, None))
    for step in range(3):  # several steps, with ragged acceptance in between
        ctx = _context(rows, params, prompt_lengths)
        drafts, q = drafter.propose(ctx, torch.tensor([4, 2, 3]))
        for b, row in enumerate(rows):
            d = [t for t in drafts[b].tolist() if t >= 0]
            assert len(d) == [4, 2, 3][b]
            expect = _expected_q(model, row, d, params, prompt_lengths[b])
            torch.testing.assert_close(q[b, : len(d)], expect, atol=1e-5, rtol=1e-4)
            assert (q[b, torch.arange(len(d)), torch.tensor(d)] > 0).all()
        ctx.streams.advance()
        # accept a ragged prefix, then a different "recovered" token
        for b in range(len(rows)):
            d = [t for t in drafts[b].tolist() if t >= 0]
            keep = (b + step) % (len(d) + 1)
            rows[b] = rows[b] + d[:keep] + [(d[keep] + 1) % VOCAB if keep < len(d) else 11]
        if step == 1:  # a row finishes
            drafter.select(torch.tensor([0, 2]))
            rows, prompt_lengths = [rows[0], rows[2]], [prompt_lengths[0], prompt_lengths[2]]
            rows.append(rows[0])  # keep three rows for the num_tokens above
            prompt_lengths.append(prompt_lengths[0])
            drafter.select(torch.tensor([0, 1, 0]))


def test_vocab_mismatch_says_what_differs():
    drafter = DraftModel(tiny_llama(0, vocab=VOCAB + 2))
    ctx = _context([[1, 2]], SamplingParams())
    with pytest.raises(ValueError, match=rf"{VOCAB + 2} logits, the target {VOCAB}"):
        drafter.begin(ctx, TargetInfo(VOCAB, None))


def test_not_a_model_is_a_type_error():
    with pytest.raises(TypeError):
        DraftModel("smollm2-135m")
