"""Caller mistakes in generate / stream: each names the argument, the value and the fix; and
every combination that would silently change the output law is refused."""

from __future__ import annotations

import re

import pytest
import torch

from exactspec import SamplingParams
from exactspec.drafters import DraftModel, PromptLookup
from exactspec.engine import generate, stream
from exactspec.errors import InvalidType, InvalidValue
from exactspec.sampling import verify as exact_verify
from tests.engine.tiny import VOCAB, tiny_llama, tiny_model

PROMPTS = [[5, 6, 7, 5, 6, 7], [9, 9, 9]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"stop": 5}, InvalidType, ["stop=5", "string"]),
    ({"stop": ["a", 3]}, InvalidType, ["stop=", "int"]),
    ({"max_new_tokens": 1.5}, InvalidType, ["max_new_tokens=1.5", "int"]),
    ({"max_new_tokens": 0}, InvalidValue, ["max_new_tokens=0", ">= 1"]),
    ({"batch_size": "8"}, InvalidType, ["batch_size='8'"]),
    ({"num_draft_tokens": "many"}, InvalidValue, ["num_draft_tokens='many'", "auto"]),
    ({"num_draft_tokens": 2.0}, InvalidType, ["num_draft_tokens=2.0"]),
    ({"return_logprobs": "yes"}, InvalidType, ["return_logprobs='yes'", "True or False"]),
    ({"params": {"temperature": 0}}, InvalidType, ["params", "dict", "SamplingParams"]),
    ({"params": [SamplingParams()]}, InvalidValue, ["1 SamplingParams for 2 prompts"]),
    ({"params": [SamplingParams(), 3]}, InvalidType, ["params[1]", "int"]),
    ({"params": SamplingParams(logit_bias={VOCAB: 1.0})}, InvalidValue,
     [f"token id {VOCAB}", "vocabulary"]),
    ({"drafter": "lookup"}, InvalidType, ["drafter", "str"]),
    ({"verify": "exact"}, InvalidValue, ["'exact'", "token"]),
])
def test_bad_arguments_are_named(target, kwargs, error, words):
    with pytest.raises(error) as info:
        generate(target, PROMPTS, max_new_tokens=kwargs.pop("max_new_tokens", 4), **kwargs)
    for w in words:
        assert w in str(info.value)


@pytest.mark.parametrize(("seed", "error"), [(2**70, InvalidValue), (-1, InvalidValue),
                                             (2**63, InvalidValue), (1.0, InvalidValue),
                                             (True, InvalidValue)])
def test_seeds_outside_64_bits_are_refused(seed, error):
    with pytest.raises(error, match=re.escape(f"seed={seed!r}") + ".*2\\*\\*63"):
        SamplingParams(seed=seed)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1  # the largest accepted


def test_a_wrong_target_and_prompts_are_named(target):
    with pytest.raises(InvalidType, match="target: expected an exactspec Model"):
        generate("smollm2", PROMPTS)
    with pytest.raises(InvalidType, match="prompt 0 must hold int token ids, got float"):
        generate(target, [[1.0, 2.0]])
    with pytest.raises(InvalidValue, match=f"token id {VOCAB}, outside"):
        generate(target, [[1, VOCAB]])
    with pytest.raises(InvalidType, match="stream\\(\\) got unexpected keyword"):
        stream(tiny_model(0), "hi", temperature=0.5)


@pytest.mark.parametrize("drafter", [None, "lookup", "draft"])
def test_greedy_verification_at_a_temperature_is_refused(target, drafter):
    """verify="greedy" emits the argmax: at T > 0 the text would silently be greedy."""
    make = {None: lambda: None, "lookup": PromptLookup, "draft": lambda: DraftModel(target)}
    for params in (SamplingParams(temperature=0.7), [SamplingParams(temperature=0),
                                                     SamplingParams(temperature=1.0)]):
        with pytest.raises(InvalidValue, match="verify='greedy' with temperature="):
            generate(target, PROMPTS, drafter=make[drafter](), params=params, verify="greedy",
                     max_new_tokens=4)
    out = generate(target, PROMPTS, drafter=make[drafter](), params=SamplingParams(temperature=0),
                   verify="greedy", max_new_tokens=4)  # the exact combination still runs
    assert [len(g.token_ids) for g in out] == [4, 4]


class BadQ(DraftModel):
    """A user drafter (not exactspec's own class) whose q is spoiled by `spoil`."""

    def __init__(self, model, spoil) -> None:
        super().__init__(model)
        self.spoil = spoil

    def propose(self, context, num_tokens):
        drafts, q = super().propose(context, num_tokens)
        return drafts, self.spoil(q)


@pytest.mark.parametrize(("spoil", "words"), [
    (lambda q: q * 2.0, "sum to 1"),  # unnormalised
    (lambda q: torch.log(q.clamp(min=1e-30)), "negative"),  # log-probabilities passed as q
    (lambda q: torch.where(q > 0.5, float("nan"), q), "NaN"),
])
@pytest.mark.parametrize("verify", ["token", "block", "callable"])
def test_a_user_drafters_bad_q_is_rejected(target, spoil, words, verify):
    """Today the engine skips validating q on both verify paths: a user's q went unchecked."""
    method = exact_verify if verify == "callable" else verify
    with pytest.raises(InvalidValue, match=f"drafter BadQ returned draft_probs.*{words}"):
        generate(target, PROMPTS, drafter=BadQ(target, spoil), params=SamplingParams(seed=1),
                 verify=method, max_new_tokens=6)


def test_a_user_drafters_good_q_passes_the_check(target):
    out = generate(target, PROMPTS, drafter=BadQ(target, lambda q: q), params=SamplingParams(seed=1),
                   max_new_tokens=6)
    ref = generate(target, PROMPTS, drafter=DraftModel(target), params=SamplingParams(seed=1),
                   max_new_tokens=6)
    assert [g.token_ids for g in out] == [g.token_ids for g in ref]
