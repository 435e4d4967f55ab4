"""Statistical: rows with different SamplingParams in one generate call each follow their own law.

Chi-square at a false-alarm rate of 1e-6 per check (fixed seeds). Tiny random Llama models with
an 8-token vocabulary are built here from a config; the exact law of the first N tokens under
each row's parameters comes from full forward passes over every continuation of the prompt
(exactspec.audit.world), standardized by probs_from_logits. One batched call holds two halves
with different temperatures, filters and penalties, interleaved, and a draft model drafting for
both. The same test fails on a deliberately wrong engine that standardizes every row with the
first row's parameters (its power at this sample size is computed from the exact laws).
"""

from dataclasses import replace

import pytest
import torch
from transformers import LlamaForCausalLM

from exactspec.audit import power, target_law
from exactspec.audit.samplers import sequence_ids
from exactspec.audit.stats import bincount, chi_square
from exactspec.audit.world import logits_table, model_world
from exactspec.drafters import DraftModel
from exactspec.engine import generate
from exactspec.engine import step as step_module
from exactspec.sampling import SamplingParams
from exactspec.sampling.standardize import probs_from_logits_rows
from tests.engine.tiny import tiny_llama as tiny

V, N, K = 8, 3, 2  # vocabulary, generated tokens compared (512 outcomes), drafts per step
ROWS = 8000  # rows in the one generate call, half with each law
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
COOL = SamplingParams(temperature=0.6, top_k=6)
HOT = SamplingParams(temperature=1.4, top_p=0.95, repetition_penalty=1.2, presence_penalty=0.3)


def tiny_llama(seed: int) -> LlamaForCausalLM:
    """8-token vocabulary, a spread of probabilities (neither flat nor one-hot), no EOS: every
    row makes N tokens."""
    return tiny(seed, vocab=V, max_pos=64, head_scale=5.0)


@pytest.fixture(scope="module")
def models():
    target, draft = tiny_llama(0), tiny_llama(1)

    def table(model):
        return logits_table(lambda ids: model(ids).logits, PROMPT, V, N + K)

    return target, draft, table(target), table(draft)


def _law(models, params):
    return target_law(model_world(models[2], models[3], V, N + K, params, PROMPT), N)


def _counts(models, method, seed):
    """Counts [V**N] of the first N tokens for the COOL rows and the HOT rows of one call."""
    target, draft = models[0], models[1]
    params = [replace(COOL if i % 2 == 0 else HOT, seed=seed * ROWS + i) for i in range(ROWS)]
    gens = generate(target, [PROMPT] * ROWS, drafter=DraftModel(draft), params=params,
                    max_new_tokens=N + K, num_draft_tokens=K, verify=method, batch_size=ROWS)
    seqs = torch.tensor([g.token_ids[:N] for g in gens])  # [ROWS, N]
    ids = sequence_ids(seqs, V)
    accepted = sum(g.stats.accepted for g in gens)
    return bincount(ids[0::2], V**N), bincount(ids[1::2], V**N), accepted


@pytest.mark.parametrize("method", ["token", "block"])
def test_each_row_follows_its_own_params(models, method):
    cool, hot, accepted = _counts(models, method, seed=1)
    assert accepted > ROWS // 10  # drafts were really used
    for counts, params in ((cool, COOL), (hot, HOT)):
        result = chi_square(counts, _law(models, params))
        assert result.dof > 30 and not result.rejected, (params, result)


def _first_rows_params(logits, params, prev_tokens=None, prompt_len=None, groups=None,
                       allowed=None):
    """Wrong: every row standardized with the first row's parameters."""
    return probs_from_logits_rows(logits, [params[0]] * len(params), prev_tokens, prompt_len,
                                  allowed=allowed)


def test_one_law_for_every_row_is_caught(models, monkeypatch):
    cool_law, hot_law = _law(models, COOL), _law(models, HOT)
    assert power(hot_law, cool_law, ROWS // 2) > 1 - 1e-6  # ROWS // 2 hot rows suffice
    monkeypatch.setattr(step_module, "probs_from_logits_rows", _first_rows_params)
    _, hot, _ = _counts(models, "token", seed=2)
    assert chi_square(hot, hot_law).rejected
    assert not chi_square(hot, cool_law).rejected  # the engine did run the modelled mistake
