"""Recorded training data equal a teacher-forced pass of the target over the same tokens."""

from __future__ import annotations

import torch

from exactspec.training.data import batches, generate_batch
from tests.engine.tiny import tiny_llama

LAYERS = (1, -1)


def test_generate_batch_records_the_targets_features_and_p():
    model = tiny_llama(11, eos=0)
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    stopped = 0  # rows that ended on EOS before max_new_tokens, over all seeds
    for seed in range(4):
        mass = torch.zeros(model.config.vocab_size, dtype=torch.float64)
        seqs = generate_batch(model, prompts, hidden_layers=LAYERS, max_new_tokens=6,
                              greedy=False, eos=[0], generator=torch.Generator().manual_seed(seed),
                              mass=mass)
        assert [s.prompt_len for s in seqs] == [5, 2, 3]
        stopped += sum(len(s.tokens) - s.prompt_len < 6 for s in seqs)
        total = 0
        for s, p in zip(seqs, prompts, strict=True):
            assert s.tokens[: len(p)].tolist() == p and 0 not in s.tokens.tolist()
            assert len(s.tokens) <= len(p) + 6
            with torch.no_grad():
                out = model(input_ids=s.tokens[None], output_hidden_states=True)
            feats = torch.cat([out.hidden_states[i] for i in LAYERS], -1)[0]
            torch.testing.assert_close(s.feats.float(), feats, atol=2e-2, rtol=1e-2)
            final = out.hidden_states[-1][0]
            torch.testing.assert_close(s.final.float(), final, atol=2e-2, rtol=1e-2)
            # the soft label: p = softmax(lm_head(final)) = exp(lm_head(final) - lse), recorded
            # from the last prompt token on (the positions that predict a reply token)
            first = len(p) - 1
            assert torch.isnan(s.lse[:first]).all() and not torch.isnan(s.lse[first:]).any()
            p_rec = torch.exp(s.final[first:].float() @ model.lm_head.weight.T
                              - s.lse[first:, None])
            torch.testing.assert_close(p_rec, torch.softmax(out.logits[0, first:], -1),
                                       atol=2e-2, rtol=0)
            total += len(s.tokens) - first
        assert abs(float(mass.sum()) - total) < 1e-3  # one unit of p mass per labelled position
    assert stopped > 0  # the EOS path (row dropped, EOS neither fed nor recorded) was exercised


def test_batches_cover_every_sequence_once():
    model = tiny_llama(11, eos=0)
    prompts = [[3] * n for n in (2, 3, 4, 5, 6, 7)]
    seqs = generate_batch(model, prompts, hidden_layers=LAYERS, max_new_tokens=3, greedy=True,
                          eos=[], generator=torch.Generator().manual_seed(0))
    seen = []
    for (tokens, _, _, _, n), plen in batches(seqs, 20, torch.Generator().manual_seed(1)):
        assert tokens.shape[0] * tokens.shape[1] <= 20 or tokens.shape[0] == 1
        seen += [tuple(tokens[i, : n[i]].tolist()) for i in range(len(n))]
        assert plen.tolist() == [len(t) - 3 for t in seen[-len(n):]]
    assert sorted(seen) == sorted(tuple(s.tokens.tolist()) for s in seqs)


def _first_reply_counts(model, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First reply token of `rows` T=1 replies to one prompt, and the target's exact p there."""
    prompt = [3, 4, 5]
    seqs = generate_batch(model, [prompt] * rows, hidden_layers=LAYERS, max_new_tokens=1,
                          greedy=False, eos=[], generator=torch.Generator().manual_seed(seed))
    vocab = model.config.vocab_size
    counts = torch.bincount(torch.stack([s.tokens[len(prompt)] for s in seqs]), minlength=vocab)
    with torch.no_grad():
        p = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double(), -1)
    return counts, p


def test_sampled_replies_follow_the_targets_p(monkeypatch):
    """Chi-square at false-alarm rate 1e-6 (exactspec.audit.stats.ALPHA): the T=1 replies of the
    training data are drawn from p. A sampler that draws from p^2 (sharpened, the law the data
    would have at T=0.5) is rejected, so the check can fail."""
    import exactspec.sampling.streams as streams
    from exactspec.audit.stats import chi_square

    model = tiny_llama(12, vocab=16)
    counts, p = _first_reply_counts(model, 4000, seed=0)
    assert not chi_square(counts, p).rejected
    right = streams.sample
    monkeypatch.setattr(streams, "sample", lambda probs, gen: right(probs ** 2, gen))
    counts, p = _first_reply_counts(model, 4000, seed=0)
    assert chi_square(counts, p).rejected
