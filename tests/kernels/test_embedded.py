"""The invariance on the real embedded model (smollm2-135m): a position's logits at width 1,
inside a width-5 verify and inside a ragged batch are the same bits, with 1 or 2 threads; greedy
speculative decoding with the int8 self-draft (its torch backend, on the int8 kernel) emits
plain's tokens with plain's logprobs."""

from __future__ import annotations

import pytest
import torch

import exactspec as es
from exactspec.models import load
from exactspec.models.adapter import TargetAdapter

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fib(n):\n    return", "Once upon a time, in a"]


@pytest.fixture(scope="module")
def smollm2():
    return load("smollm2-135m")


def test_embedded_width_batch_and_threads_invariance(smollm2, threads):
    model = smollm2.model
    ids = [smollm2.tokenizer.encode(p) for p in PROMPTS]
    feed = torch.tensor([[540, 314, 260, 1345, 30]])  # five tokens after the first prompt
    torch.set_num_threads(1)
    one = TargetAdapter(model)
    assert one.lean is not None and one.lean.kernels
    one.prefill(ids[:1], capacity=64)
    steps = []
    for t in range(feed.shape[1]):
        steps.append(one.extend(feed[:, t:t + 1])[0, 0])
        one.commit(torch.tensor([1]))
    torch.set_num_threads(2)
    wide = TargetAdapter(model)
    wide.prefill(ids[:1], capacity=64)
    assert torch.equal(wide.extend(feed)[0], torch.stack(steps))
    batch = TargetAdapter(model)
    batch.prefill(ids, capacity=64)  # ragged lengths
    out = batch.extend(feed.expand(3, -1))  # [3, 5, V]
    assert torch.equal(out[0], torch.stack(steps))


def test_embedded_greedy_int8_self_draft_equals_plain_with_its_logprobs(smollm2):
    greedy = es.SamplingParams(temperature=0)
    plain = es.generate(smollm2, PROMPTS, params=greedy, max_new_tokens=32,
                        return_logprobs=True)
    spec = es.generate(smollm2, PROMPTS, drafter=es.QuantizedDraft(8, backend="torch"),
                       params=greedy, max_new_tokens=32, num_draft_tokens=4,
                       return_logprobs=True)
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
    t1 = [es.SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    plain = es.generate(smollm2, PROMPTS, params=t1, max_new_tokens=24, return_logprobs=True)
    alone = es.generate(smollm2, PROMPTS[1:2], params=t1[1:2], max_new_tokens=24,
                        return_logprobs=True)[0]
    assert alone.token_ids == plain[1].token_ids and alone.logprobs == plain[1].logprobs
