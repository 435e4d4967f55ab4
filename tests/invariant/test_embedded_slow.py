"""On the embedded real model (slow): rollouts with the int8 self-draft under the mode carry
logprobs that transformers' own forward reproduces bit for bit, in a padded batch and alone;
transformers' ordinary forward does not."""

from __future__ import annotations

import pytest
import torch

import exactspec as es

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    return es.load("smollm2-135m")


def test_smollm2_rollouts_equal_the_trainer_bit_for_bit(smollm):
    prompts = [smollm.encode("Name a colour.", chat=True),
               smollm.encode("Write one sentence about the sea.", chat=True)]
    params = es.SamplingParams(temperature=0.9, top_p=0.95, seed=3)
    with es.batch_invariant():
        gens = es.generate(smollm, prompts, drafter=es.QuantizedDraft(8), params=params,
                           max_new_tokens=20, return_logprobs=True)
    assert sum(g.stats.accepted for g in gens) > 0
    seqs = [p + g.token_ids for p, g in zip(prompts, gens, strict=True)]
    plens = [len(p) for p in prompts]
    refs = [torch.tensor(g.logprobs) for g in gens]
    with es.batch_invariant():
        together = es.token_logprobs(smollm, seqs, plens, params).detach()
        alone = [es.token_logprobs(smollm, [s], [n], params).detach()[0]
                 for s, n in zip(seqs, plens, strict=True)]
    plain = es.token_logprobs(smollm, seqs, plens, params).detach()
    for i, ref in enumerate(refs):
        assert torch.equal(together[i, : len(ref)], ref)
        assert torch.equal(alone[i][: len(ref)], ref)
    assert not any(torch.equal(plain[i, : len(r)], r) for i, r in enumerate(refs))
