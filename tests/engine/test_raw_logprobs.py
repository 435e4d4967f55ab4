"""logprobs_mode="raw": the model's own distribution, log_softmax of the raw logits (before
temperature, top-k/p, penalties), per emitted token and as top-N alternatives.

Exact tests: under es.batch_invariant() the engine's forward and a teacher-forced forward of
the same sequence give the same logits, so the raw logprobs equal a direct log_softmax of the
target's logits bit for bit (torch.equal), on every verification path; top-N always has N
entries; the default ("processed") is unchanged.
"""

from __future__ import annotations

import pytest
import torch

import exactspec as es
from exactspec.drafters import DraftModel, PromptLookup, QuantizedDraft
from exactspec.errors import InvalidValue
from exactspec.sampling.logprobs import raw_log_probs
from tests.engine.tiny import perturbed, tiny_llama

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
FILTERED = es.SamplingParams(temperature=0.3, top_k=5, top_p=0.9, repetition_penalty=1.3,
                             seed=4)
NEW = 12


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, hidden=64, head_scale=5.0)


def _gen(target, drafter, params, mode="raw", top=0, verify="token"):
    with es.batch_invariant():
        return es.generate(target, PROMPTS, drafter=drafter, params=params, max_new_tokens=NEW,
                           num_draft_tokens=3, verify=verify, return_logprobs=True,
                           logprobs_mode=mode, top_logprobs=top)


def _direct(target, prompt, tokens) -> torch.Tensor:  # [C, V] log_softmax of the target
    """The target's raw log_softmax at each generated position, one teacher-forced forward."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with es.batch_invariant(), torch.no_grad():
        logits = target(input_ids=ids, use_cache=False).logits[0]  # [T, V]
    return raw_log_probs(logits[len(prompt) - 1: -1])


DRAFTERS = {
    "plain": lambda t: None,
    "int8": lambda t: QuantizedDraft(8, backend="torch"),
    "draft_model": lambda t: DraftModel(perturbed(t, 0.3)),
    "lookup": lambda t: PromptLookup(),
    "tree": lambda t: DraftModel(perturbed(t, 0.3), tree=(2, 1)),
}


@pytest.mark.parametrize("params", [FILTERED, es.SamplingParams(temperature=0, seed=0)],
                         ids=["filtered", "greedy"])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_raw_logprobs_are_the_targets_log_softmax(target, name, params):
    gens = _gen(target, DRAFTERS[name](target), params, top=4)
    for prompt, g in zip(PROMPTS, gens, strict=True):
        direct = _direct(target, prompt, g.token_ids)  # [C, V]
        ids = torch.tensor(g.token_ids)
        assert torch.equal(torch.tensor(g.logprobs, dtype=torch.float32),
                           direct.gather(1, ids[:, None])[:, 0])
        assert all(len(top) == 4 for top in g.top_logprobs)  # always N entries
        for j, top in enumerate(g.top_logprobs):
            vals, idx = direct[j].topk(4)
            assert [i for i, _ in top] == idx.tolist()
            assert torch.equal(torch.tensor([v for _, v in top]), vals)
    if params.is_greedy:  # the model's own law, not the one-hot the token was drawn from
        assert all(lp < 0 for g in gens for lp in g.logprobs)


def test_processed_mode_is_unchanged(target):
    """The default reports the standardized law: log p of a filtered p (0.0 when greedy),
    and top lists hold only tokens with p > 0."""
    default = es.generate(target, PROMPTS, params=FILTERED, max_new_tokens=NEW,
                          return_logprobs=True)
    processed = _gen(target, None, FILTERED, mode="processed", top=8)
    raw = _gen(target, None, FILTERED, mode="raw")
    assert [g.token_ids for g in default] == [g.token_ids for g in processed]
    assert [g.logprobs for g in default] == [g.logprobs for g in processed]
    assert [g.token_ids for g in raw] == [g.token_ids for g in processed]  # same draws
    assert [g.logprobs for g in raw] != [g.logprobs for g in processed]
    assert all(len(top) <= 5 for g in processed for top in g.top_logprobs)  # top_k=5
    greedy = es.generate(target, PROMPTS[:1], params=es.SamplingParams(temperature=0),
                         max_new_tokens=4, return_logprobs=True)
    assert greedy[0].logprobs == [0.0] * 4 and greedy[0].top_logprobs is None


def test_a_bad_mode_is_named(target):
    with pytest.raises(InvalidValue, match="logprobs_mode='model'"):
        es.generate(target, PROMPTS[:1], max_new_tokens=2, logprobs_mode="model")
