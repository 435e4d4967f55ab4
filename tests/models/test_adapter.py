"""TargetAdapter: batched incremental forwards with ragged commits equal plain full forwards."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from exactspec.models.adapter import TargetAdapter
from tests.threads import one_thread as _one_thread  # noqa: F401 (autouse fixture)


def _llama(attn: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).eval()


def _gemma3(attn: str) -> Gemma3ForCausalLM:
    # sliding-window layers with a window shorter than the sequences below
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=4,
        max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"],
    )
    cfg._attn_implementation = attn
    return Gemma3ForCausalLM(cfg).eval()


def _full(model, ids: list[int]) -> torch.Tensor:  # [T, V]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("make", [_llama, _gemma3])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_ragged_extend_commit_matches_full_forward(make, attn):
    model = make(attn)
    ad = TargetAdapter(model)
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8], [9], [3, 3, 3, 3]]
    ad.prefill([s[:-1] for s in seqs])  # cache all but the pending last token
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        width = 1 + step % 4
        new = torch.randint(0, 40, (len(seqs), width - 1), generator=g)
        feed = torch.cat([torch.tensor([[s[-1]] for s in seqs]), new], 1)  # [B, W]
        logits = ad.extend(feed)
        for b, s in enumerate(seqs):
            expect = _full(model, s + new[b].tolist())[-width:]
            torch.testing.assert_close(logits[b], expect, atol=1e-5, rtol=1e-5)
        keep = torch.randint(1, width + 1, (len(seqs),), generator=g)  # ragged acceptance
        ad.commit(keep)
        for b in range(len(seqs)):
            seqs[b] = seqs[b] + new[b, : keep[b] - 1].tolist() + [int(10 + b + step)]
    assert ad.lengths.tolist() == [len(s) - 1 for s in seqs]


def test_rewind_select_and_identical_prompts():
    model = _llama("sdpa")
    ad = TargetAdapter(model)
    ad.prefill([[1, 2, 3], [4, 5], [1, 2, 3]])
    ad.extend(torch.tensor([[6, 7], [8, 9], [6, 7]]))
    ad.commit(torch.tensor([2, 2, 2]))
    ad.rewind(torch.tensor([4, 2, 3]))  # row 0 keeps 6, row 1 forgets 8 9, row 2 forgets 7
    ad.select(torch.tensor([2, 0]))
    logits = ad.extend(torch.tensor([[5], [5]]))
    torch.testing.assert_close(logits[0, -1], _full(model, [1, 2, 3, 5])[-1])
    torch.testing.assert_close(logits[1, -1], _full(model, [1, 2, 3, 6, 5])[-1])


def test_hidden_states_and_context_limit():
    model = _llama("sdpa")
    ad = TargetAdapter(model)
    ad.prefill([[1, 2]])
    logits, hidden = ad.extend(torch.tensor([[3, 4]]), return_hidden=True)
    assert logits.shape == (1, 2, 40) and hidden.shape == (1, 2, 32)
    ad.commit(torch.tensor([2]))
    with pytest.raises(ValueError, match="context"):
        ad.extend(torch.zeros(1, 61, dtype=torch.long))


def test_unsupported_attention_is_an_error():
    model = _llama("sdpa")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attention"):
        TargetAdapter(model)


@pytest.mark.parametrize("empty_prompts", [False, True], ids=["prefilled", "unfed"])
def test_feed_rows_equals_the_padded_batch_extend(empty_prompts):
    """`feed_rows` runs a few rows only (a drafter's probe catching one row up in a batch): the
    next logits of every row equal those after a padded whole-batch extend that commits the
    same tokens (bit for bit on the kernels; within float rounding on torch's operators), and
    the rows not fed keep their lengths; the cache grows past its capacity when it must."""
    from tests.models.test_lean_architectures import model_of

    model = model_of("llama", seed=7, vocab=40)
    g = torch.Generator().manual_seed(8)
    prompts = [[] if empty_prompts else torch.randint(0, 40, (n,), generator=g).tolist()
               for n in (5, 3, 7, 2)]
    feed = torch.randint(0, 40, (4, 9), generator=g)
    commit = torch.tensor([0, 6, 0, 9])
    rows = torch.tensor([1, 3])
    nxt = torch.randint(0, 40, (4, 1), generator=g)
    outs = []
    for use_rows in (False, True):
        ad = TargetAdapter(model)
        ad.prefill(prompts, capacity=8)  # too small for the feed: both paths grow it
        if use_rows:
            ad.feed_rows(rows, feed[rows], commit[rows])
        else:
            ad.extend(feed, logits_to_keep=1)
            ad.commit(commit)
        outs.append((ad.lengths.clone(), ad.extend(nxt)))
    (len_a, a), (len_b, b) = outs
    assert torch.equal(len_a, len_b)
    assert len_a.tolist() == [len(p) + int(c) for p, c in zip(prompts, commit, strict=True)]
    if TargetAdapter(model).lean is not None and TargetAdapter(model).lean.kernels:
        assert torch.equal(a, b)
    else:
        assert torch.allclose(a, b, atol=1e-5)
    assert not torch.equal(a[1], outs[0][1][0])  # rows differ: the comparison can fail
