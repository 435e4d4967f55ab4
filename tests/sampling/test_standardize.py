"""probs_from_logits: order of transforms, agreement with transformers' processors, bad input."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from exactspec import SamplingParams, probs_from_logits


def _hf_probs(logits, prev, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, rep=1.0):
    """The same chain through transformers' own processors, as an independent reference."""
    x = logits.clone()
    if rep != 1.0:
        x = RepetitionPenaltyLogitsProcessor(rep)(prev, x)
    if temperature != 1.0:
        x = TemperatureLogitsWarper(temperature)(prev, x)
    if top_k:
        x = TopKLogitsWarper(top_k)(prev, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(prev, x)
    if min_p > 0:
        x = MinPLogitsWarper(min_p)(prev, x)
    return torch.softmax(x, -1)


@pytest.mark.parametrize("kwargs", [
    {}, {"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.8}, {"min_p": 0.1},
    {"temperature": 1.3, "top_k": 10, "top_p": 0.9, "min_p": 0.02},
    {"rep": 1.3, "temperature": 0.8, "top_p": 0.95},
])
def test_matches_transformers_processors(kwargs):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 3  # continuous: no ties at the filter edges
    prev = torch.randint(0, 50, (6, 12), generator=gen)
    rep = kwargs.pop("rep", 1.0)
    params = SamplingParams(repetition_penalty=rep, **kwargs)
    ours = probs_from_logits(logits, params, prev_tokens=prev)
    ref = _hf_probs(logits, prev, rep=rep, **kwargs)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)


def test_greedy_is_one_hot_lowest_id_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=0))
    assert torch.equal(probs, torch.tensor([[0.0, 1, 0, 0], [1.0, 0, 0, 0]]))


def test_batched_leading_dims_and_float32():
    logits = torch.randn(2, 3, 7, dtype=torch.float16)
    probs = probs_from_logits(logits, SamplingParams(top_k=3))
    assert probs.shape == (2, 3, 7) and probs.dtype == torch.float32
    assert ((probs > 0).sum(-1) == 3).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))


def test_top_k_keeps_ties_and_top_p_keeps_the_top_token():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    probs = probs_from_logits(logits, SamplingParams(top_k=2))
    assert (probs[0] > 0).tolist() == [True, True, True, False]
    probs = probs_from_logits(torch.tensor([[10.0, 0.0, 0.0]]), SamplingParams(top_p=0.01))
    assert probs[0].tolist() == [1.0, 0.0, 0.0]


def test_top_p_hand_computed():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps the first two (0.5 + 0.3 reaches it);
    # exact ties with the running sum are left out: they are decided by rounding in any library
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)
    probs = probs_from_logits(p.log(), SamplingParams(top_p=0.75))
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0, 0]], dtype=torch.float64))
    probs = probs_from_logits(p.log(), SamplingParams(top_p=0.85))
    assert (probs[0] > 0).sum() == 3


def test_min_p_hand_computed():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)
    probs = probs_from_logits(p.log(), SamplingParams(min_p=0.3))  # drops below 0.15
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.3, 0.15, 0]], dtype=torch.float64) / 0.95)


def test_penalties_semantics():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]], dtype=torch.float64)
    prev = torch.tensor([[0, 1, 2, 2, -1]])  # prompt = [0, 1], output = [2, 2]; -1 = padding
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    got = probs_from_logits(logits, params, prev_tokens=prev, prompt_len=2)
    # repetition on 0, 1, 2: 2 -> 1, -1 -> -2, 0.5 -> 0.25; then token 2 (output twice): -0.5 - 0.5
    expect = torch.softmax(torch.tensor([[1.0, -2.0, 0.25 - 0.5 - 0.5, 0.0]], dtype=torch.float64), -1)
    torch.testing.assert_close(got, expect)
    # without a history the penalties do nothing
    torch.testing.assert_close(probs_from_logits(logits, params), torch.softmax(logits, -1))


def test_per_position_history_broadcast():
    logits = torch.zeros(2, 3, 5)
    prev = torch.tensor([[[0, -1], [0, 1], [0, 1]], [[4, -1], [4, 4], [4, 4]]])  # [2, 3, 2]
    probs = probs_from_logits(logits, SamplingParams(frequency_penalty=1.0), prev_tokens=prev)
    assert probs[0, 0, 0] < probs[0, 0, 1] and probs[0, 1, 1] < probs[0, 1, 2]
    assert probs[1, 1, 4] < probs[1, 0, 4]


def test_logit_bias():
    probs = probs_from_logits(torch.zeros(1, 3), SamplingParams(logit_bias={2: 100.0}))
    assert probs[0, 2] > 0.999
    with pytest.raises(ValueError, match="outside the vocabulary"):
        probs_from_logits(torch.zeros(1, 3), SamplingParams(logit_bias={3: 1.0}))


@pytest.mark.parametrize("bad, word", [(float("nan"), "NaN"), (float("inf"), "inf"),
                                       (float("-inf"), "inf")])
def test_non_finite_logits_rejected(bad, word):
    logits = torch.zeros(2, 4)
    logits[1, 2] = bad
    with pytest.raises(ValueError, match=word):
        probs_from_logits(logits, SamplingParams())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 4_000, 49_151])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0)])
def test_one_non_finite_logit_anywhere_is_found(dtype, bad, where, params):
    """The finiteness check is one min / max pass: a single NaN, inf or -inf at the first, a
    middle or the last id of a large vocabulary, in any row and dtype, is refused with the
    count; huge finite logits (min and max far apart) pass."""
    logits = torch.randn(3, 49_152).to(dtype)
    logits[2, where] = bad
    with pytest.raises(ValueError, match=r"(NaN|inf) values \(1 of 147456\)"):
        probs_from_logits(logits, params)
    edge = torch.zeros(2, 8, dtype=dtype)
    edge[0, 0], edge[1, 7] = torch.finfo(dtype).max, torch.finfo(dtype).min
    assert torch.isfinite(probs_from_logits(edge, params)).all()
    assert probs_from_logits(torch.zeros(0, 5, dtype=dtype), params).shape == (0, 5)


def test_bad_types_and_history():
    with pytest.raises(TypeError):
        probs_from_logits(torch.zeros(2, 3), {"temperature": 1.0})
    with pytest.raises(TypeError):
        probs_from_logits(torch.zeros(2, 3, dtype=torch.long), SamplingParams())
    with pytest.raises(ValueError, match="prev_tokens"):
        probs_from_logits(torch.zeros(1, 3), SamplingParams(repetition_penalty=1.1),
                          prev_tokens=torch.tensor([[5]]))


def test_top_p_partial_sort_equals_full_sort():
    """The topk shortcut gives bit-identical results to sorting the whole vocabulary."""
    from exactspec.sampling.standardize import _top_p_threshold

    gen = torch.Generator().manual_seed(0)
    for scale in (0.1, 1.0, 5.0):  # flat (cut beyond the partial window) to peaked
        probs = torch.softmax(torch.randn(7, 3000, generator=gen) * scale, -1)
        for top_p in (0.1, 0.5, 0.9, 0.999):
            fast = _top_p_threshold(probs, top_p, partial=64)
            full = _top_p_threshold(probs, top_p, partial=3000)
            assert torch.equal(fast, full)
